"""The Accelerator the training loop runs on (train/loop.py), and where the frozen target goes.

`accelerate launch` on a machine without accelerators joins its processes over gloo on the CPU;
a precision other than the one a process already set up gets a fresh AcceleratorState; FSDP
version 1 is refused, and an FSDP config that Accelerate does not apply is named.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from accelerate import Accelerator, DistributedDataParallelKwargs
from accelerate.utils import DistributedType

from data.hardware import cpu_has_fast_bf16
from train.config import TrainerConfig, resolve_mixed_precision

log = logging.getLogger(__name__)


def make_accelerator(cfg: TrainerConfig) -> Accelerator:
    # `accelerate launch --multi_gpu` on a machine without accelerators starts N processes
    # that would each train alone; forcing CPU makes Accelerate join them over gloo.
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    cpu = cfg.cpu or (launched and not torch.accelerator.is_available())
    ddp = DistributedDataParallelKwargs(find_unused_parameters=cfg.find_unused_parameters)
    precision = resolve_mixed_precision(cfg.mixed_precision)
    _release_other_precision(precision)
    acc = Accelerator(
        mixed_precision=precision,
        gradient_accumulation_steps=cfg.grad_accum,
        cpu=cpu,
        kwargs_handlers=[ddp],
    )
    _check_sharding(acc)
    _check_cpu_precision(acc)
    return acc


def _release_other_precision(precision: str) -> None:
    """Accelerate keeps one precision per process and refuses another: a later run in the same
    process (a notebook, a sweep, the tests) with another `trainer.mixed_precision` gets a fresh
    AcceleratorState. The process group (PartialState) is kept; DeepSpeed sets its own."""
    from accelerate.state import AcceleratorState

    shared = AcceleratorState._shared_state
    if not shared or shared.get("distributed_type") == DistributedType.DEEPSPEED:
        return
    if shared.get("_mixed_precision", precision) != precision:
        AcceleratorState._reset_state()


def _check_cpu_precision(acc: Accelerator) -> None:
    """bf16 on a CPU runs the step under torch.autocast: fast with AMX or AVX512-BF16 (1.6-1.8x the
    fp32 step on SmolLM2, docs/reports/2026-12-01-throughput/throughput.md), emulated and slower
    without."""
    if acc.device.type != "cpu" or acc.mixed_precision != "bf16" or not acc.is_main_process:
        return
    if not cpu_has_fast_bf16():
        log.warning(
            "trainer.mixed_precision=bf16 on a CPU without AMX or AVX512-BF16: bf16 matmuls "
            "are emulated there and the step is likely slower than fp32; set "
            "trainer.mixed_precision=no (or fast_bf16, which picks per machine)"
        )


def _check_sharding(acc: Accelerator) -> None:
    """Say so when an FSDP config is not what runs; refuse FSDP version 1 (its flat
    parameters are not DTensors, which is what the loop gathers and checkpoints)."""
    wanted = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if wanted and acc.distributed_type != DistributedType.FSDP and acc.is_main_process:
        log.warning(
            "an FSDP config was given, but Accelerate runs %s (it shards only on GPU-like "
            "devices, not with cpu=True): every process holds and updates the whole head",
            acc.distributed_type.value,
        )
    if acc.distributed_type == DistributedType.FSDP and not acc.is_fsdp2:
        raise ValueError(
            "FSDP version 1 is not supported by the training loop: set fsdp_config.fsdp_version"
            ": 2 in the accelerate config (conf/accelerate/fsdp.yaml does)."
        )


def place_target(target: Any, device: torch.device) -> None:
    """Move the frozen target next to the head, unless it is already spread over devices."""
    model = target.model
    if getattr(model, "hf_device_map", None):
        return
    if next(model.parameters()).device != device:
        model.to(device)


__all__ = ["make_accelerator", "place_target"]
