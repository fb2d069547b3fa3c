"""Validation and the [sum, count] statistics heads report, summed over batches and processes;
the training loop's log window (`TrainWindow`), which sums the training batches' the same way,
and what one optimizer step counts (`StepCounts`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from torch import Tensor, nn
from torch.utils.data import Dataset

from heads.acceptance import Validates
from train.features import batch_features
from train.sampling import eval_batches, make_loader


def add_stats(sums: dict[str, Tensor], stats: Mapping[str, Tensor]) -> None:
    """Accumulate a head's stats ({name: tensor([sum, count])}) into `sums`, in float64."""
    for key, value in stats.items():
        value = value.detach().to(torch.float64)
        sums[key] = sums[key] + value if key in sums else value


def reduce_stats(acc: Accelerator, sums: dict[str, Tensor]) -> dict[str, list[float]]:
    """Sum [sum, count] stats over processes; a key missing on a process counts as zero there."""
    keys = sorted(sums)
    if acc.num_processes > 1:
        keys = sorted({k for ks in gather_object([keys]) for k in ks})
    if not keys:
        return {}
    zero = torch.zeros(2, dtype=torch.float64, device=acc.device)
    stacked = torch.stack([sums[k].to(acc.device) if k in sums else zero for k in keys])
    stacked = acc.reduce(stacked, "sum").cpu()
    return {k: [float(s), float(c)] for k, (s, c) in zip(keys, stacked.tolist(), strict=True)}


@torch.no_grad()
def evaluate_head(
    acc: Accelerator,
    head: nn.Module,
    dataset: Dataset,
    collate_fn: Callable[[list], dict],
    *,
    target: Any,
    layers: Sequence[int] | None,
    batch_size: int,
    num_workers: int = 0,
    seed: int = 0,
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Run `head.validate` (a `Validates` head) or else `head.loss` over the whole of `dataset`,
    each process on its own share.

    Returns ({"val/<stat>": sum / count}, {"<stat>": [sum, count]}), the sums taken over every
    batch and every process, so each example counts once whatever the number of processes.
    """
    batches = eval_batches(len(dataset), batch_size, acc.process_index, acc.num_processes)
    loader = make_loader(dataset, batches, collate_fn, num_workers, seed)
    was_training = head.training
    head.eval()
    measure = head.validate if isinstance(head, Validates) else head.loss
    sums: dict[str, Tensor] = {}
    for batch in loader:
        batch = {k: v.to(acc.device) if isinstance(v, Tensor) else v for k, v in batch.items()}
        with acc.autocast():
            out = measure(batch, batch_features(batch, target, layers, head))
        add_stats(sums, out.stats)
    head.train(was_training)
    totals = reduce_stats(acc, sums)
    metrics = {f"val/{k}": s / c for k, (s, c) in totals.items() if c > 0}
    return metrics, totals


class StepCounts(NamedTuple):
    """What one optimizer step counted, summed over processes: tokens (attention mask), loss
    tokens (loss mask), micro-batches whose loss was inf/NaN, and CPU seconds."""

    tokens: int
    loss_tokens: int
    bad_losses: int
    cpu_s: float

    @classmethod
    def summed(
        cls, acc: Accelerator, tokens: Tensor, loss_tokens: Tensor, bad_losses: int, cpu_s: float
    ) -> StepCounts:
        """This process's counts summed over every process, in one all-reduce."""
        packed = torch.stack(
            [
                tokens.to(acc.device, torch.float64),
                loss_tokens.to(acc.device, torch.float64),
                torch.tensor(float(bad_losses), dtype=torch.float64, device=acc.device),
                torch.tensor(cpu_s, dtype=torch.float64, device=acc.device),
            ]
        )
        total, loss, bad, cpu = acc.reduce(packed, "sum").tolist()
        return cls(int(total), int(loss), int(bad), float(cpu))


@dataclass
class TrainWindow:
    """What happened since the last train log, on this process (tokens: all processes)."""

    loss_sum: float = 0.0
    micro_batches: int = 0
    stats: dict[str, Tensor] = field(default_factory=dict)
    tokens: int = 0
    started: float = field(default_factory=time.perf_counter)
    lr: float = 0.0
    grad_norm: float | None = None

    def metrics(self, acc: Accelerator, state, batches_per_epoch: int) -> dict[str, float]:
        """The window's `train/*` metrics, reduced over processes (every process must call
        this); `state`: the loop's TrainState (tokens, loss tokens, CPU time, data position)."""
        loss = torch.tensor(self.loss_sum / self.micro_batches, device=acc.device)
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        metrics = {
            "train/loss": float(acc.reduce(loss, "mean")),
            "train/lr": self.lr,
            "train/tokens_per_s": self.tokens / elapsed,
            "train/tokens": state.tokens,
            "train/loss_tokens": state.loss_tokens,
            "train/cpu_min": state.cpu_s / 60,
            "train/epoch": state.epoch + state.batch_in_epoch / batches_per_epoch,
        }
        if self.grad_norm is not None:
            metrics["train/grad_norm"] = self.grad_norm
        for key, (total, count) in reduce_stats(acc, self.stats).items():
            if key != "loss" and count > 0:  # the stats' "loss" would shadow the objective
                metrics[f"train/{key}"] = total / count
        return metrics
