"""Training checkpoints: written atomically, found again by `resume`, pruned to the last k.

A checkpoint is the folder `<run_dir>/checkpoints/step_<N>/`:

    head.safetensors     the head's trainable parameters (frozen shared target weights excluded)
    optimizer.pt         optimizer state (+ the fp16 grad scaler's, if any)
    scheduler.pt         learning-rate scheduler state
    rng.pt               python / numpy / torch / cuda RNG states, one entry per process
    trainer_state.json   step, epoch, data position, token counts
    run.json             the settings and data fingerprint the run had (train/resume.py)
    manifest.json        size and sha256 of each file above (written last)

Under FSDP2 the head's parameters and optimizer moments are DTensor shards; a checkpoint always
holds full tensors. The optimizer state is then keyed by parameter name (torch.distributed
.checkpoint's full state dict, `full_optimizer_state`) instead of by position, and
`load_optimizer_state` reads either form; `gathered_weights` lends code that runs the head
outside its FSDP forward (validation, evaluators, saving) a full copy of its weights.

The folder is filled under a temporary name in the same parent, fsynced and renamed into place
in one step, so a crash mid-write leaves only a dot-prefixed temporary folder, which
`list_checkpoints` never returns (and the next successful save deletes). A folder damaged after
it was written (a truncated file, a disk error) fails `checkpoint_problems`, and resume skips it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pickle
import random
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from data.errors import DraftsmithError
from heads.base import atomic_save_dir, check_finite
from train.optim import MultiOptimizer
from train.rundir import (
    CHECKPOINT_HEADS,
    CHECKPOINTS,
    MANIFEST_FILE,
    kept_head,
    manifest_problems,
    write_manifest,
)

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
HEAD_FILE = "head.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng.pt"
RUN_FILE = "run.json"
CHECKPOINT_INFO = "checkpoint.json"  # in a head folder made from a checkpoint: where, which step
_STEP_DIR = re.compile(r"^step_(\d+)$")
# what reading a truncated or garbled checkpoint file raises
_UNREADABLE = (
    OSError,
    EOFError,
    RuntimeError,
    ValueError,
    TypeError,
    KeyError,
    pickle.UnpicklingError,
    SafetensorError,
)


class CheckpointError(DraftsmithError):
    """A checkpoint cannot be trusted (damaged, incomplete) or does not fit this run."""


@dataclass
class TrainState:
    """Where a run stands. `batch_in_epoch` counts the micro-batches each process has consumed
    in `epoch` (the data position); token counts are summed over all processes."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    global_batch: int = 0  # batch_size * num_processes when written (to re-map the position)
    tokens: int = 0
    loss_tokens: int = 0
    # CPU seconds the optimizer steps took (process CPU time, all threads, summed over
    # processes; data loading and online features included, feature-cache builds and
    # evaluation not): the x axis of equal-CPU comparisons, carried across resumes
    cpu_s: float = 0.0
    # the run length a time budget planned (train/budget.py); 0: none planned
    planned_steps: int = 0


@dataclass
class Checkpoint:
    """Everything read back from a checkpoint folder (tensors on CPU)."""

    path: Path
    state: TrainState
    head: dict[str, Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    scaler: dict[str, Any] | None
    rng: list[dict[str, Any]]
    run: dict[str, Any] | None = None  # run.json; None in checkpoints older than it


def checkpoint_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINTS


def list_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Checkpoints under `run_dir` (step_<N> folders that were renamed into place: they hold a
    manifest, or a state file when older than manifests), oldest first, as (step, folder).
    Listed is not intact: see `checkpoint_problems`."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and any((child / name).is_file() for name in (MANIFEST_FILE, STATE_FILE)):
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def save_checkpoint(
    run_dir: str | os.PathLike,
    state: TrainState,
    head: dict[str, Tensor],
    optimizer: dict[str, Any],
    scheduler: dict[str, Any],
    rng: list[dict[str, Any]],
    scaler: dict[str, Any] | None = None,
    keep_last: int = 0,
    run: dict[str, Any] | None = None,
) -> Path:
    """Write `step_<state.step>/` atomically, then keep only the newest `keep_last` (0: all).

    `run` (the settings and data fingerprint, see train/resume.py) goes to run.json. Weights
    holding inf/NaN are refused: resuming from them could only continue a diverged run.
    Call on one process only (the main one); the others must wait for it.
    """
    # clone: safetensors refuses tensors that share storage, and we never want views here
    head = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in head.items()}
    path = checkpoint_root(run_dir) / f"step_{state.step}"
    check_finite(head, path)

    def write(tmp: Path) -> None:
        save_file(head, str(tmp / HEAD_FILE), metadata={"format": "pt"})
        torch.save({"optimizer": optimizer, "scaler": scaler}, tmp / OPTIMIZER_FILE)
        torch.save(scheduler, tmp / SCHEDULER_FILE)
        torch.save(rng, tmp / RNG_FILE)
        (tmp / STATE_FILE).write_text(json.dumps(dataclasses.asdict(state), indent=2) + "\n")
        if run is not None:
            (tmp / RUN_FILE).write_text(json.dumps(run, indent=1, sort_keys=True) + "\n")
        write_manifest(tmp)  # last: it vouches for everything above

    atomic_save_dir(path, write)
    prune_checkpoints(run_dir, keep_last)
    return path


def prune_checkpoints(run_dir: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints (0 keeps all) and any temporary
    folders left by interrupted saves. Returns the folders removed."""
    removed = []
    found = list_checkpoints(run_dir)
    if keep_last > 0:
        removed += [path for _, path in found[:-keep_last]]
    root = checkpoint_root(run_dir)
    removed += [p for p in root.iterdir() if p.name.startswith(".") and p.is_dir()]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def checkpoint_problems(path: str | os.PathLike) -> list[str]:
    """What is wrong with a checkpoint folder, as short phrases; [] when it can be trusted.

    Checked against its manifest; one older than manifests must at least hold every file and a
    readable state file."""
    path = Path(path)
    problems = manifest_problems(path)
    if problems != [f"no {MANIFEST_FILE}"]:
        return problems
    names = (HEAD_FILE, OPTIMIZER_FILE, SCHEDULER_FILE, RNG_FILE, STATE_FILE)
    problems = [f"{n} is missing or empty" for n in names if not _has_bytes(path / n)]
    if not problems:
        try:
            TrainState(**json.loads((path / STATE_FILE).read_text()))
        except (ValueError, TypeError):
            problems.append(f"{STATE_FILE} is unreadable")
    return problems


def _has_bytes(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read a checkpoint folder written by `save_checkpoint`; CheckpointError when a file in
    it cannot be read (check `checkpoint_problems` first to also catch silent damage)."""
    path = Path(path)
    if not any((path / name).is_file() for name in (MANIFEST_FILE, STATE_FILE)):
        raise CheckpointError(
            f"{path} is not a checkpoint (no {MANIFEST_FILE}); pass a "
            f"<run_dir>/{CHECKPOINTS}/step_<N> folder, or trainer.resume=auto for the latest one."
        )
    try:
        state = TrainState(**json.loads((path / STATE_FILE).read_text()))
        optim = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        return Checkpoint(
            path=path,
            state=state,
            head=load_file(str(path / HEAD_FILE)),
            optimizer=optim["optimizer"],
            scheduler=torch.load(path / SCHEDULER_FILE, map_location="cpu", weights_only=True),
            scaler=optim["scaler"],
            rng=torch.load(path / RNG_FILE, map_location="cpu", weights_only=True),
            run=json.loads((path / RUN_FILE).read_text()) if (path / RUN_FILE).is_file() else None,
        )
    except _UNREADABLE as err:
        raise CheckpointError(
            f"{path} cannot be read ({type(err).__name__}: {str(err)[:120]}): delete it to "
            "resume from an older checkpoint, or set trainer.resume=never to start over."
        ) from err


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


def is_checkpoint(folder: str | os.PathLike) -> bool:
    """True for a checkpoint folder (RUN/checkpoints/step_N)."""
    folder = Path(folder)
    return (folder / STATE_FILE).is_file() and (folder / HEAD_FILE).is_file()


def head_from_checkpoint(checkpoint: str | os.PathLike) -> Path:
    """A head folder (what `heads.from_pretrained` loads) for the weights of a checkpoint, to
    evaluate or export a run at any saved step (e.g. at equal CPU time with another draft).

    A checkpoint holds the trained tensors only; the config and the fixed buffers (a reduced
    vocabulary's d2t/t2d) come from the head the same run kept (best_head/ or head/), which
    a run writes at its first evaluation or at its end. Written once, atomically and with a
    manifest, to RUN/checkpoint_heads/step_N; returns that folder."""
    from heads.base import CONFIG_NAME, WEIGHTS_NAME

    checkpoint = Path(checkpoint).resolve()
    if not is_checkpoint(checkpoint):
        raise CheckpointError(f"{checkpoint}: not a checkpoint folder ({STATE_FILE}, {HEAD_FILE})")
    run_dir = checkpoint.parent.parent
    out = run_dir / CHECKPOINT_HEADS / checkpoint.name
    if (out / CONFIG_NAME).is_file() and not manifest_problems(out):
        return out
    problems = checkpoint_problems(checkpoint)
    if problems:
        raise CheckpointError(f"{checkpoint} is damaged ({'; '.join(problems[:3])})")
    kept = kept_head(run_dir)
    if kept is None:
        raise CheckpointError(
            f"{run_dir} has no saved head (best_head/ or head/) to take the head's config from; "
            "a run writes one at its first evaluation (trainer.eval_every with evaluators) or at "
            "its end: resume it until then."
        )
    reference = load_file(str(kept / WEIGHTS_NAME))
    trained = load_file(str(checkpoint / HEAD_FILE))
    for name, tensor in trained.items():
        if name not in reference or reference[name].shape != tensor.shape:
            raise CheckpointError(
                f"{checkpoint}: tensor {name} does not fit the run's kept head {kept} "
                "(another head config?)"
            )
    tensors = reference | trained

    def write(tmp: Path) -> None:
        shutil.copy2(kept / CONFIG_NAME, tmp / CONFIG_NAME)
        save_file(tensors, str(tmp / WEIGHTS_NAME), {"format": "pt"})
        state = json.loads((checkpoint / STATE_FILE).read_text())
        (tmp / CHECKPOINT_INFO).write_text(json.dumps({"from": str(checkpoint), **state}))
        write_manifest(tmp)

    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_save_dir(out, write)
    return out
