"""The one training loop for every draft head, on Hugging Face Accelerate.

The loop knows a head only through its protocol (heads/base.py: `feature_layers()`,
`loss(batch, features) -> LossOutput`, `save_pretrained(path)`); it never asks which method
it is training. Features come from the batch when the data carries cached target states
("offline"), otherwise from the frozen target under no_grad ("online").

One step = `grad_accum` micro-batches per process, then one AdamW update. A run continues
exactly from its latest checkpoint (weights, optimizer, scheduler, RNG and data position), so a
killed and resumed run ends with the same weights as an uninterrupted one. Resume trusts only
an intact checkpoint of the same run (train/checkpoint/resume.py). A non-finite loss or
gradient stops the run at once (NonFiniteError), and a head holding inf/NaN is never written.

Under FSDP (version 2) the head's parameters are DTensor shards between steps. Checkpoints
gather the full weights and optimizer state collectively and write them from rank 0 (so they
hold the same full tensors as without FSDP); validation, evaluators and head saving run on a
full copy of the head that every process gathers for the purpose (`gathered_weights`).

Beside the loop: train/accelerator.py builds the Accelerator, train/checkpoint/ writes and
resumes checkpoints and keeps the best head, train/budget.py keeps to a time budget,
train/validation.py validates and sums the logged statistics.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DistributedType, broadcast_object_list, set_seed
from torch import Tensor, nn
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from data.dataset import packed_collate
from data.errors import NonFiniteError
from train.accelerator import make_accelerator, place_target
from train.budget import BudgetDecision, budget_callback
from train.checkpoint import (
    BestKeeper,
    Evaluator,
    RunCheckpoints,
    TrainState,
    checkpoint_record,
    gathered_weights,
    run_evaluators,
)
from train.config import TrainerConfig
from train.features import batch_features, with_example_targets
from train.optim import build_optimizer, build_scheduler, replan_scheduler, trainable_parameters
from train.rundir import check_kept_head, write_run_config
from train.sampling import count_steps, epoch_batches, make_loader, sigchld_kept
from train.tracking import Tracker
from train.validation import StepCounts, TrainWindow, add_stats, evaluate_head

Callback = Callable[[TrainState], bool | None]  # return True to stop after this step
_DIVERGED_FIX = (
    "training diverged or its inputs overflowed. Lower trainer.lr, keep trainer.max_grad_norm "
    "> 0, and if the target's features exceed float16's range set data.feature_dtype=bfloat16; "
    "then resume from the last checkpoint or start over."
)


@dataclass
class TrainResult:
    """What a finished (or stopped) run produced.

    `epoch` is the (0-based) epoch the data position is in; `val_totals` maps a stat to
    [sum, count] over the whole validation set and all processes, `val_metrics` holds
    "val/<stat>" = sum / count; `head_dir` is None when a callback stopped the run early.
    """

    step: int
    epoch: int
    train_loss: float | None
    val_metrics: dict[str, float] = field(default_factory=dict)
    val_totals: dict[str, list[float]] = field(default_factory=dict)
    tokens: int = 0
    loss_tokens: int = 0
    head_dir: Path | None = None
    checkpoint: Path | None = None
    stopped_early: bool = False
    elapsed_s: float = 0.0
    planned_steps: int = 0  # the run length a time budget planned; 0: none
    step_s: float = 0.0  # wall seconds in this process's optimizer steps (no validation)
    step_tokens: int = 0  # the tokens those steps saw: the rate the progress bar shows


class _HeadLoss(nn.Module):
    """Routes `head.loss` through `forward`, so DDP's gradient hooks and Accelerate's autocast
    wrapper (both attached to `forward`) apply to it."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head

    def forward(self, batch: dict, features: dict) -> tuple[Tensor, dict[str, Tensor]]:
        out = self.head.loss(batch, features)
        return out.loss, out.stats


class Trainer:
    """Trains `head` on `train_dataset` (items collated by `collate_fn`), see module docs.

    `callbacks` run after every step with the TrainState; one returning True stops the run
    (after writing a checkpoint of that step), which is how tests simulate an interruption.
    They must decide the same on every process. `run_config` (the resolved run config) and
    `data_sha1` are recorded in each checkpoint and compared on resume; `run_config` is also
    written to <run_dir>/config.yaml once resume has accepted it. `started` is when the run
    began on `clock` (time.monotonic; default: now), which `trainer.time_budget_min` counts from.
    """

    def __init__(
        self,
        head: nn.Module,
        cfg: TrainerConfig,
        run_dir: str | os.PathLike,
        *,
        train_dataset: Dataset,
        collate_fn: Callable[[list], dict],
        target: Any = None,
        val_dataset: Dataset | None = None,
        tracker: Tracker | None = None,
        callbacks: Sequence[Callback] = (),
        evaluators: Sequence[Evaluator] = (),
        run_config: dict | None = None,
        data_sha1: str | None = None,
        started: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg, self.run_dir, self.callbacks = cfg, Path(run_dir), list(callbacks)
        self.clock = clock
        self.evaluators = list(evaluators)
        self.run_config = run_config
        self.acc = acc = make_accelerator(cfg)
        self.best = BestKeeper(run_dir, cfg.best_metric, cfg.best_mode, acc.is_main_process)
        set_seed(cfg.seed, device_specific=True)  # seed + process index
        self.head, self.target, self.layers = head, target, head.feature_layers()
        # targets a head derives once per example from cached features (heads.base)
        self.train_dataset = with_example_targets(train_dataset, head)
        self.val_dataset = with_example_targets(val_dataset, head)
        self.collate_fn = collate_fn  # validation always reads padded batches
        self.train_collate = (
            partial(packed_collate, collate_fn, cfg.pack_tokens) if cfg.pack_tokens else collate_fn
        )
        if target is not None:
            place_target(target, acc.device)
        self.global_batch = cfg.batch_size * acc.num_processes
        self.batches_per_epoch, self.total_steps = count_steps(
            cfg, len(train_dataset), acc.num_processes
        )
        self.budget = budget_callback(
            cfg.time_budget_min, clock() if started is None else started, clock,
            recipe_steps=self.total_steps, eval_every=cfg.eval_every, save_every=cfg.save_every,
            share=lambda value: broadcast_object_list([value])[0],
        )  # fmt: skip
        optimizer = build_optimizer(head, cfg, acc.distributed_type == DistributedType.FSDP)
        self.warmup = cfg.warmup_for(self.total_steps)
        self.scheduler = build_scheduler(optimizer, self.warmup, self.total_steps, cfg.min_lr_ratio)
        self.model, self.optimizer = acc.prepare(_HeadLoss(head), optimizer)
        self.checkpoints = RunCheckpoints(
            acc, self.model, self.optimizer, self.scheduler, head, self.run_dir, cfg,
            checkpoint_record(run_config, cfg, data_sha1),
        )  # fmt: skip
        self.state = TrainState(global_batch=self.global_batch)
        self._own_tracker = tracker is None
        self.tracker = tracker or Tracker(None, self.run_dir, is_main=acc.is_main_process)
        self._last_loss, self._step_wall = None, [0.0, 0]  # wall s in steps, their tokens

    # ---- the run -----------------------------------------------------------------------

    def fit(self) -> TrainResult:
        """Train to `total_steps` (resuming if configured), validate, save the final head; the
        process's SIGCHLD disposition afterwards is the one it had (train.sampling.sigchld_kept)."""
        with sigchld_kept():
            return self._fit()

    def _fit(self) -> TrainResult:
        started = time.perf_counter()
        resumed = self.resume()
        cfg, acc, state = self.cfg, self.acc, self.state
        if self.run_config is not None and acc.is_main_process:
            write_run_config(self.run_dir, self.run_config)
        stream = self._micro_batches()
        bar = tqdm(
            total=self.total_steps,
            initial=state.step,
            desc="train",
            dynamic_ncols=True,
            disable=not (cfg.progress and acc.is_main_process),
        )
        window, evaluated_at, stopped = TrainWindow(), -1, False
        checkpoint = resumed
        val: tuple[dict, dict] = ({}, {})
        while state.step < self.total_steps and not stopped:
            began = self.clock()
            self._train_step(stream, window)
            state.step += 1
            bar.update(1)
            if cfg.log_every and state.step % cfg.log_every == 0:
                window = self._log_train(window, bar)
            self.budget.on_step_end(self.clock() - began)
            if cfg.eval_every and state.step % cfg.eval_every == 0:
                began = self.clock()
                val, evaluated_at = self.evaluate(log=True), state.step
                self.budget.on_validation(self.clock() - began)
            stopped = self._should_stop()
            if not stopped:
                decision = self.budget.decide(
                    state.step, self.total_steps, state.planned_steps, evaluated_at == state.step
                )
                self._follow(decision, bar)
            if (cfg.save_every and state.step % cfg.save_every == 0) or stopped:
                began = self.clock()
                checkpoint = self.save_checkpoint()
                self.budget.on_checkpoint(self.clock() - began)
        stream.close()  # its last loader's workers, if any, end here
        if window.micro_batches:
            self._log_train(window, bar)
        bar.close()
        head_dir = None
        if not stopped:
            if evaluated_at != state.step:
                val = self.evaluate(log=True)
            if cfg.save_every and (checkpoint is None or checkpoint.name != f"step_{state.step}"):
                checkpoint = self.save_checkpoint()
            head_dir = self.save_head()
            if acc.is_main_process:
                check_kept_head(self.run_dir)  # never end "successfully" on a damaged head
        if self._own_tracker:
            self.tracker.finish()
        return TrainResult(
            step=state.step,
            epoch=state.epoch,
            train_loss=self._last_loss,
            val_metrics=val[0],
            val_totals=val[1],
            tokens=state.tokens,
            loss_tokens=state.loss_tokens,
            head_dir=head_dir,
            checkpoint=checkpoint,
            stopped_early=stopped,
            elapsed_s=time.perf_counter() - started,
            planned_steps=state.planned_steps,
            step_s=self._step_wall[0],
            step_tokens=int(self._step_wall[1]),
        )

    def _train_step(self, stream: Iterator[dict], window: TrainWindow) -> None:
        """One optimizer update from `grad_accum` micro-batches."""
        acc = self.acc
        self.model.train()
        cpu_started, wall_started = time.process_time(), time.perf_counter()
        tokens = loss_tokens = torch.zeros((), dtype=torch.float64, device=acc.device)
        bad_losses = 0
        for _ in range(self.cfg.grad_accum):
            batch = next(stream)
            with acc.accumulate(self.model):
                with acc.autocast():
                    features = batch_features(batch, self.target, self.layers, self.head)
                loss, stats = self.model(batch, features)
                acc.backward(loss)
                if acc.sync_gradients:
                    window.lr = self.optimizer.param_groups[0]["lr"]
                    window.grad_norm = self._clip_gradients()
                    self._check_grad_norm(window.grad_norm)
                    self.optimizer.step()
                    if not self.optimizer.step_was_skipped:
                        self.scheduler.step()
                    self.optimizer.zero_grad(set_to_none=True)
            value = loss.detach().float().item()
            bad_losses += not math.isfinite(value)
            window.loss_sum += value
            window.micro_batches += 1
            add_stats(window.stats, stats)
            tokens = tokens + batch["attention_mask"].sum()
            loss_tokens = loss_tokens + batch.get("loss_mask", batch["attention_mask"]).sum()
        if not acc.sync_gradients:
            raise RuntimeError("gradient accumulation fell out of step with the loop (a bug)")
        counts = StepCounts.summed(
            acc, tokens, loss_tokens, bad_losses, time.process_time() - cpu_started
        )
        if counts.bad_losses > 0:  # every process sees the sum, so all stop together
            raise NonFiniteError(
                f"step {self.state.step + 1}: the loss is inf/NaN in {counts.bad_losses} "
                f"micro-batch(es): {_DIVERGED_FIX}"
            )
        self.state.tokens += counts.tokens
        self.state.loss_tokens += counts.loss_tokens
        self.state.cpu_s += counts.cpu_s
        window.tokens += counts.tokens
        self._step_wall = [self._step_wall[0] + time.perf_counter() - wall_started,
                           self._step_wall[1] + counts.tokens]  # fmt: skip

    def _clip_gradients(self) -> float | None:
        """Clip to `max_grad_norm` (0: no clipping, the norm is still measured)."""
        params = [p for _, p in trainable_parameters(self.head)]
        norm = self.acc.clip_grad_norm_(params, self.cfg.max_grad_norm or math.inf)
        return None if norm is None else float(norm)

    def _check_grad_norm(self, norm: float | None) -> None:
        """Stop before an update with inf/NaN gradients (the same norm on every process). With
        fp16's grad scaler they are expected now and then: the scaler skips those updates."""
        if norm is None or math.isfinite(norm) or self.acc.scaler is not None:
            return
        raise NonFiniteError(
            f"step {self.state.step + 1}: the gradient norm is {norm}: {_DIVERGED_FIX}"
        )

    def _micro_batches(self) -> Iterator[dict]:
        """This process's micro-batches, epoch after epoch, from the current data position."""
        cfg, acc, state = self.cfg, self.acc, self.state
        while True:
            batches = epoch_batches(
                len(self.train_dataset),
                cfg.batch_size,
                state.epoch,
                cfg.seed,
                acc.process_index,
                acc.num_processes,
                cfg.shuffle,
            )
            loader = make_loader(
                self.train_dataset,
                batches[state.batch_in_epoch :],
                self.train_collate,
                cfg.num_workers,
                seed=cfg.seed + state.epoch,
            )
            for batch in loader:
                state.batch_in_epoch += 1
                yield self._to_device(batch)
            state.epoch, state.batch_in_epoch = state.epoch + 1, 0

    def _follow(self, decision: BudgetDecision | None, bar: tqdm | None = None) -> None:
        """Do what the time budget decided: run to a new plan over a schedule re-spread to end
        there, or just stop earlier (train/budget.py); None: go on as planned."""
        if decision is None:
            return
        self.total_steps = decision.end
        if decision.replan:
            self.state.planned_steps = decision.end
            replan_scheduler(self.scheduler, self.warmup, decision.end, self.cfg.min_lr_ratio)
        if bar is not None:
            bar.total = decision.end

    def _should_stop(self) -> bool:
        if not self.callbacks:
            return False
        votes = [bool(callback(self.state)) for callback in self.callbacks]
        flag = torch.tensor(float(any(votes)), device=self.acc.device)
        return bool(self.acc.reduce(flag, "sum") > 0)

    # ---- validation and logging ---------------------------------------------------------

    def evaluate(self, log: bool = False) -> tuple[dict[str, float], dict[str, list[float]]]:
        """Validate on the whole validation set (see `evaluate_head`); log the means if `log`.

        Uses the bare head (under FSDP a full copy gathered on every process), never the
        wrapped model: a DDP or FSDP forward is a collective, which deadlocks when processes
        hold different numbers of validation batches.
        """
        metrics: dict[str, float] = {}
        totals: dict[str, list[float]] = {}
        with gathered_weights(self.head) as head:  # collective under FSDP
            if self.val_dataset is not None:
                metrics, totals = evaluate_head(
                    self.acc,
                    head,
                    self.val_dataset,
                    self.collate_fn,
                    target=self.target,
                    layers=self.layers,
                    batch_size=self.cfg.eval_batch_size or self.cfg.batch_size,
                    num_workers=self.cfg.num_workers,
                    seed=self.cfg.seed,
                )
            if self.evaluators:
                metrics.update(self._run_evaluators(head))
            if self.acc.is_main_process:
                self.best.update(metrics, self.state.step, head)
            self.acc.wait_for_everyone()
        if log:
            self.tracker.log(metrics, self.state.step)
        return metrics, totals

    def _run_evaluators(self, head: nn.Module) -> dict[str, float]:
        """Checkpoint-time evaluators run on the main process; every rank gets the numbers."""
        found: dict[str, float] = {}
        if self.acc.is_main_process:
            found = run_evaluators(self.evaluators, head, self.target)
        return broadcast_object_list([found])[0]

    def _log_train(self, window: TrainWindow, bar: tqdm) -> TrainWindow:
        """Reduce the window over processes, log it, and start a new one."""
        metrics = window.metrics(self.acc, self.state, self.batches_per_epoch)
        self.tracker.log(metrics, self.state.step)
        loss, tok_s = metrics["train/loss"], metrics["train/tokens_per_s"]
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{window.lr:.2e}", tok_s=f"{tok_s:.0f}")
        self._last_loss = loss
        return TrainWindow()

    # ---- checkpoints (train/checkpoint/run.py) ---------------------------------------------

    def save_checkpoint(self) -> Path:
        """Write `checkpoints/step_<N>` from the main process; every process must call this."""
        return self.checkpoints.save(self.state)

    def resume(self) -> Path | None:
        """Continue from the checkpoint `cfg.resume` names, if any (RunCheckpoints.resume)."""
        found = self.checkpoints.resume(self.global_batch)
        if found is None:
            return None
        path, self.state = found
        self.tracker.rewind(self.state.step)
        self._follow(self.budget.on_resume(self.state.planned_steps, self.total_steps))
        return path

    def save_head(self) -> Path:
        """`<run_dir>/head` with a manifest (RunCheckpoints.save_head); every process calls it."""
        return self.checkpoints.save_head()

    def _to_device(self, batch: dict) -> dict:
        device = self.acc.device
        return {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}


def train(
    head: nn.Module,
    target: Any,
    train_dataset: Dataset,
    val_dataset: Dataset | None,
    collate_fn: Callable[[list], dict],
    cfg: TrainerConfig,
    run_dir: str | os.PathLike,
    tracker: Tracker | None = None,
    callbacks: Sequence[Callback] = (),
    evaluators: Sequence[Evaluator] = (),
    run_config: dict | None = None,
    data_sha1: str | None = None,
    started: float | None = None,
) -> TrainResult:
    """Build a Trainer and run it (see Trainer)."""
    trainer = Trainer(
        head,
        cfg,
        run_dir,
        train_dataset=train_dataset,
        collate_fn=collate_fn,
        target=target,
        val_dataset=val_dataset,
        tracker=tracker,
        callbacks=callbacks,
        evaluators=evaluators,
        run_config=run_config,
        data_sha1=data_sha1,
        started=started,
    )
    return trainer.fit()
