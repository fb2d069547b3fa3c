"""A run's state beyond the checkpoint folder's files: the head's weights and optimizer state
under FSDP2, the RNG states of each process, and the data position across a changed batch.

Under FSDP2 the head's parameters and optimizer moments are DTensor shards; a checkpoint always
holds full tensors. The optimizer state is then keyed by parameter name (torch.distributed
.checkpoint's full state dict, `full_optimizer_state`) instead of by position, and
`load_optimizer_state` reads either form; `gathered_weights` lends code that runs the head
outside its FSDP forward (validation, evaluators, saving) a full copy of its weights.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from train.checkpoint.folder import CheckpointError, TrainState
from train.optim import MultiOptimizer

log = logging.getLogger(__name__)


def load_head_state(params: dict[str, nn.Parameter], tensors: dict[str, Tensor], path) -> None:
    """Copy checkpointed weights into a head's trainable parameters; names must match exactly."""
    missing, unexpected = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not fit this head (missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}): resume with the same head config, or set resume=never."
        )
    with torch.no_grad():
        for name, param in params.items():
            full = tensors[name].to(param.device, param.dtype)
            if isinstance(param, DTensor):  # FSDP2: keep this process's shard (no collective)
                full = distribute_tensor(
                    full, param.device_mesh, param.placements, src_data_rank=None
                )
            param.copy_(full)


@contextmanager
def gathered_weights(module: nn.Module) -> Iterator[nn.Module]:
    """`module` with each DTensor-sharded parameter (FSDP2) swapped for a full plain copy, for
    code that runs it outside its FSDP forward (validation, evaluators, saving); the shards are
    put back on exit. Collective when something is sharded: every process must enter it, and
    every process then holds the whole module. Without shards it yields `module` as it is."""
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    try:
        with torch.no_grad():
            for sub in module.modules():
                for name, param in list(sub._parameters.items()):
                    if isinstance(param, DTensor):
                        full = nn.Parameter(param.full_tensor(), param.requires_grad)
                        swapped.append((sub, name, param))
                        sub._parameters[name] = full  # not setattr: no hooks, no re-registration
        yield module
    finally:
        for sub, name, param in swapped:
            sub._parameters[name] = param


_FULL_ON_CPU = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_optimizer_state(model: nn.Module, optimizer: Optimizer, sharded: bool) -> dict:
    """The optimizer state to checkpoint. `sharded` (FSDP): the full state, keyed by parameter
    name, gathered collectively (every process must call this) and returned on rank 0 only
    (the others get {}); otherwise `optimizer.state_dict()` as it is."""
    if not sharded:
        return optimizer.state_dict()
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
    return get_optimizer_state_dict(model, inner, options=_FULL_ON_CPU)


def load_optimizer_state(model: nn.Module, optimizer: Optimizer, state: dict) -> None:
    """Load a checkpoint's optimizer state: a full, name-keyed one (written under FSDP) is
    spread over `model`'s parameters by torch.distributed.checkpoint (each process keeps its
    shard, with or without FSDP now); a positional one goes to `optimizer.load_state_dict`."""
    groups = state.get("param_groups") or []
    if not any(isinstance(p, str) for group in groups for p in group["params"]):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if any(isinstance(p, DTensor) for p in params):
            raise CheckpointError(
                "this checkpoint's optimizer state was written without FSDP (keyed by position) "
                "and cannot be spread over FSDP shards: resume it without FSDP, or start over "
                "with trainer.resume=never."
            )
        if "param_groups" not in state and not isinstance(
            getattr(optimizer, "optimizer", optimizer), MultiOptimizer
        ):
            raise CheckpointError(
                f"this checkpoint's optimizer state holds {', '.join(sorted(state))} (written with "
                "trainer.optimizer=muon): resume with it, or start over with trainer.resume=never."
            )
        optimizer.load_state_dict(state)
        return
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
    options = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(model, inner, state, options=options)


def remap_position(state: TrainState, global_batch: int) -> TrainState:
    """Keep the data position (in examples) when the global batch changed since the save."""
    if state.global_batch in (0, global_batch):
        state.global_batch = global_batch
        return state
    examples = state.batch_in_epoch * state.global_batch
    log.warning(
        "global batch changed from %d to %d since the checkpoint; resuming at example %d of "
        "epoch %d",
        state.global_batch,
        global_batch,
        examples,
        state.epoch,
    )
    state.batch_in_epoch = math.ceil(examples / global_batch)
    state.global_batch = global_batch
    return state


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch CPU, and CUDA when initialised)."""
    name, key, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "name": name,
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of `capture_rng_state`."""
    random.setstate(state["python"])
    n = state["numpy"]
    key = n["key"].numpy().astype(np.uint32)
    np.random.set_state((n["name"], key, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
