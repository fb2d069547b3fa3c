"""The training loop's checkpoint-time work (train/loop.py): writing a step's checkpoint and the
final head from the main process, and resuming from a checkpoint, each with the collectives that
every process must join.

Checkpoints hold the full weights and optimizer state (gathered under FSDP) with the RNG state of
every process, so a resumed run continues exactly (state.py captures and restores it); which
checkpoint to trust and whether this run may continue it is resume.py's decision, the file
layout folder.py's.
"""

from __future__ import annotations

import logging
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list, gather_object
from torch import nn

from heads.base import check_finite
from train.checkpoint.folder import (
    TrainState,
    checkpoint_root,
    load_checkpoint,
    save_checkpoint,
    save_head_folder,
)
from train.checkpoint.resume import (
    apply_optimizer_settings,
    check_explicit_checkpoint,
    check_settings,
    find_intact_checkpoint,
    optimizer_settings,
    run_record,
)
from train.checkpoint.state import (
    capture_rng_state,
    full_optimizer_state,
    gathered_weights,
    load_head_state,
    load_optimizer_state,
    remap_position,
    restore_rng_state,
)
from train.config import TrainerConfig
from train.optim import trainable_parameters
from train.rundir import HEAD_DIR

log = logging.getLogger(__name__)


def checkpoint_record(config: dict | None, cfg: TrainerConfig, data_sha1: str | None) -> dict:
    """What a checkpoint records (resume.py), without `pack_tokens`: packing changes
    neither the data order nor the loss, so a run may resume with it switched on or off, and
    checkpoints written before the setting existed still match."""
    record = run_record(config, cfg, data_sha1)
    record["config"]["trainer"].pop("pack_tokens", None)
    return record


class RunCheckpoints:
    """Checkpoints of one run in `run_dir`: `model` and `optimizer` as Accelerate prepared them,
    `head` the bare head inside `model`; `record` (checkpoint_record) is what each checkpoint
    records of the run and what a resume compares."""

    def __init__(
        self,
        acc: Accelerator,
        model: nn.Module,
        optimizer,
        scheduler,
        head: nn.Module,
        run_dir: Path,
        cfg: TrainerConfig,
        record: dict,
    ) -> None:
        self.acc, self.model, self.optimizer, self.scheduler = acc, model, optimizer, scheduler
        self.head, self.run_dir, self.cfg, self.record = head, Path(run_dir), cfg, record
        self.sharded = acc.distributed_type == DistributedType.FSDP

    def save(self, state: TrainState) -> Path:
        """Write `checkpoints/step_<N>` from the main process; every process must call this."""
        acc = self.acc
        # collective under ZeRO-3 / FSDP, where the full state dicts are filled on rank 0 only
        full = acc.get_state_dict(self.model)
        optimizer = full_optimizer_state(self.model, self.optimizer, self.sharded)
        rng = gather_object([capture_rng_state()])  # one entry per process, rank order
        if acc.is_main_process:
            names = [n for n, _ in trainable_parameters(self.head)]
            save_checkpoint(
                self.run_dir,
                state,
                head={n: full[f"head.{n}"] for n in names},
                optimizer=optimizer,
                scheduler=self.scheduler.state_dict(),
                rng=rng,
                scaler=acc.scaler.state_dict() if acc.scaler is not None else None,
                keep_last=self.cfg.keep_last,
                run=self.record,
            )
        acc.wait_for_everyone()
        return checkpoint_root(self.run_dir) / f"step_{state.step}"

    def resume(self, global_batch: int) -> tuple[Path, TrainState] | None:
        """Load the checkpoint `cfg.resume` names ("auto": the newest intact one in run_dir, if
        any) into the head, optimizer, scheduler, scaler and RNG, after checking that this run's
        settings still fit it (resume.py); returns its path and the data position, remapped
        to `global_batch`, or None when there is nothing to resume."""
        found = self._choose_checkpoint()
        if found is None:
            return None
        ckpt = load_checkpoint(found)
        main = self.acc.is_main_process
        changed = check_settings(
            ckpt.run, self.record, self.cfg.allow_config_change, ckpt.path, verbose=main
        )
        fresh = optimizer_settings(self.optimizer, self.scheduler)
        load_head_state(dict(trainable_parameters(self.head)), ckpt.head, ckpt.path)
        load_optimizer_state(self.model, self.optimizer, ckpt.optimizer)
        self.scheduler.load_state_dict(ckpt.scheduler)
        if changed:
            apply_optimizer_settings(self.optimizer, self.scheduler, fresh)
        if ckpt.scaler is not None and self.acc.scaler is not None:
            self.acc.scaler.load_state_dict(ckpt.scaler)
        state = remap_position(ckpt.state, global_batch)
        rank = self.acc.process_index
        if rank >= len(ckpt.rng):
            log.warning("checkpoint has RNG states for %d processes only", len(ckpt.rng))
        restore_rng_state(ckpt.rng[rank % len(ckpt.rng)])
        if main:
            log.info("resumed from %s at step %d", ckpt.path, state.step)
        return ckpt.path, state

    def _choose_checkpoint(self) -> Path | None:
        """The main process checks the candidates (it reads and hashes them); every process
        follows its choice, or raises its error."""
        resume = self.cfg.resume
        if resume == "never":
            return None
        choice: str | Exception | None = None
        if self.acc.is_main_process:
            try:
                found = (
                    find_intact_checkpoint(self.run_dir)
                    if resume == "auto"
                    else check_explicit_checkpoint(resume)
                )
                choice = str(found) if found else None
            except Exception as err:  # handed to every process, raised below
                choice = err
        choice = broadcast_object_list([choice])[0]
        if isinstance(choice, Exception):
            raise choice
        return Path(choice) if choice else None

    def save_head(self) -> Path:
        """`head.save_pretrained(<run_dir>/head)` plus a manifest, on the main process,
        atomically; weights holding inf/NaN are refused (NonFiniteError). Every process must
        call this (under FSDP they gather the full head together)."""
        path = self.run_dir / HEAD_DIR
        with gathered_weights(self.head) as head:
            if self.acc.is_main_process:
                check_finite(head.state_dict(), path)
                save_head_folder(head, path)
            self.acc.wait_for_everyone()
        return path


__all__ = ["RunCheckpoints", "checkpoint_record"]
