"""AdamW over a head's trainable parameters, and a linear-warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

from torch import nn
from torch.optim import AdamW, Optimizer
from torch.optim.lr_scheduler import LambdaLR

from train.config import TrainerConfig


def trainable_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) for every parameter that requires grad; frozen ones (a shared target
    lm_head, embeddings) are left out of the optimizer and of checkpoints."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def build_optimizer(module: nn.Module, cfg: TrainerConfig) -> AdamW:
    """AdamW; matrices get weight decay, vectors (biases, norm scales) do not.

    A head may give some parameters their own learning rate through `param_lr(name) -> float |
    None` (Medusa-2's adapter); the schedule scales every group alike."""
    params = trainable_parameters(module)
    if not params:
        raise ValueError(
            "the head has no parameters with requires_grad=True: nothing to train. "
            "Check that the head does not freeze itself (only the target should be frozen)."
        )
    param_lr = getattr(module, "param_lr", None)
    groups: dict[tuple[float, bool], list[nn.Parameter]] = {}
    for name, p in params:
        lr = (param_lr(name) if param_lr is not None else None) or cfg.lr
        groups.setdefault((lr, p.ndim >= 2), []).append(p)
    return AdamW(
        [
            {"params": ps, "lr": lr, "weight_decay": cfg.weight_decay if decay else 0.0}
            for (lr, decay), ps in groups.items()
        ],
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
    )


def lr_multiplier(step: int, warmup: int, total: int, min_ratio: float = 0.0) -> float:
    """The factor on the peak lr for the optimizer update with 0-based index `step`.

    Linear warmup reaches 1.0 on update `warmup - 1` (the first update is not wasted at lr 0),
    then a half cosine falls from 1.0 at update `warmup` towards `min_ratio` at update `total`.
    """
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: Optimizer, warmup: int, total: int, min_ratio: float) -> LambdaLR:
    """A LambdaLR over `lr_multiplier`; step it once per optimizer update."""
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, warmup, total, min_ratio))
