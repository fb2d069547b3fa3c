"""Which examples each process reads, in which order: deterministic, sharded, resumable.

Every epoch has its own permutation, drawn from a generator seeded with `seed + epoch`, so the
order depends only on (seed, epoch) and a resumed run can skip the batches already consumed by
slicing a list. The permutation is cut into global batches of `batch_size * world_size`; process
`rank` takes its contiguous slice of each. A last partial global batch is dropped so every
process runs the same number of steps (DDP needs that).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from train.config import TrainerConfig


def epoch_batches(
    num_examples: int,
    batch_size: int,
    epoch: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    shuffle: bool = True,
) -> list[list[int]]:
    """Dataset indices of this process's micro-batches for one epoch, in order."""
    if shuffle:
        gen = torch.Generator().manual_seed(seed + epoch)
        order = torch.randperm(num_examples, generator=gen).tolist()
    else:
        order = list(range(num_examples))
    global_batch = batch_size * world_size
    start = rank * batch_size
    return [
        order[i * global_batch + start : i * global_batch + start + batch_size]
        for i in range(num_examples // global_batch)
    ]


def eval_batches(
    num_examples: int, batch_size: int, rank: int = 0, world_size: int = 1
) -> list[list[int]]:
    """This process's share of the validation set: indices rank, rank + W, ... in batches.

    Nothing is padded or repeated, so statistics summed over processes cover each example once.
    """
    mine = list(range(rank, num_examples, world_size))
    return [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]


@contextmanager
def sigchld_kept() -> Iterator[None]:
    """Give back the SIGCHLD disposition a block started with. torch's DataLoader installs, at its
    first worker, a Python SIGCHLD handler that stays for the life of the process; once OpenVINO
    is loaded into that process, delivering it when any child exits killed the process (a kernel
    SIGSEGV, exit 139: CI, 2026-12-02). Training with `num_workers` > 0 and then serving in one
    interpreter (a notebook, a script) must not inherit that. torch installs it once per process,
    so later loaders rely on their own liveness checks instead."""
    main = threading.current_thread() is threading.main_thread()
    if not (main and hasattr(signal, "SIGCHLD")):
        yield
        return
    before = signal.getsignal(signal.SIGCHLD)
    try:
        yield
    finally:
        signal.signal(signal.SIGCHLD, before)


def make_loader(
    dataset: Dataset,
    batches: list[list[int]],
    collate_fn: Callable[[list[Any]], dict],
    num_workers: int = 0,
    seed: int = 0,
) -> DataLoader:
    """A DataLoader that yields exactly `batches` (lists of indices), collated.

    It gets its own generator: a DataLoader otherwise draws its workers' base seed from the
    global torch RNG each time it is iterated, and a resumed run, which starts its loader at a
    different moment, would then see different random numbers (dropout, noise) afterwards.
    """
    return DataLoader(
        dataset,
        batch_sampler=batches,
        collate_fn=collate_fn,
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(seed),
    )


def count_steps(cfg: TrainerConfig, num_examples: int, num_processes: int) -> tuple[int, int]:
    """(micro-batches per epoch on each process, optimizer steps in the run)."""
    per_epoch = num_examples // (cfg.batch_size * num_processes)
    if per_epoch == 0:
        raise ValueError(
            f"the training set has {num_examples} examples, fewer than one global batch "
            f"(batch_size {cfg.batch_size} x {num_processes} processes): lower batch_size or "
            "add data."
        )
    total = cfg.max_steps or int(cfg.num_epochs * per_epoch // cfg.grad_accum)
    if total < 1:
        raise ValueError(
            f"num_epochs={cfg.num_epochs} gives less than one optimizer step ({per_epoch} "
            f"batches per epoch, grad_accum {cfg.grad_accum}): raise num_epochs, set "
            "max_steps, or lower grad_accum."
        )
    return per_epoch, total
