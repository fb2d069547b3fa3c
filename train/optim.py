"""The optimizer over a head's trainable parameters (`trainer.optimizer`), and a linear-warmup +
cosine learning-rate schedule.

- `adamw`: AdamW everywhere.
- `muon`: Muon (Jordan et al., 2024, "Muon: an optimizer for hidden layers"; torch.optim.Muon) on
  the draft's hidden weight matrices (fc, attention and MLP projections) at `trainer.muon_lr`,
  AdamW on everything else at `trainer.lr`, as speculators does (PRs #607, #746). AdamW keeps:
  vectors (norm scales, biases) and [1, N] matrices, which Muon cannot orthogonalise; matrices
  with a vocabulary-sized side (an lm_head, Medusa's and DSpark's per-token tables), whose rows
  each belong to one token, so that an update orthogonalised across tokens means nothing (Muon's
  authors and speculators keep embeddings and output heads on AdamW too); and parameters the
  head gives their own lr (`param_lr`, Medusa-2's LoRA adapter: its lr was tuned for AdamW).

The two run as one `MultiOptimizer`, so that the training loop, accelerate, the lr schedule and
checkpoints see a single optimizer; its state_dict holds each one's.
"""

from __future__ import annotations

import math
from collections import ChainMap

from torch import nn
from torch.optim import AdamW, Muon, Optimizer
from torch.optim.lr_scheduler import LambdaLR

from data.errors import ConfigError
from train.config import TrainerConfig


def trainable_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) for every parameter that requires grad; frozen ones (a shared target
    lm_head, embeddings) are left out of the optimizer and of checkpoints."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def build_optimizer(module: nn.Module, cfg: TrainerConfig, sharded: bool = False) -> Optimizer:
    """The optimizer `cfg.optimizer` names over `module`'s trainable parameters (see the module
    docstring). `sharded`: the head will be sharded with FSDP, which Muon is not offered under."""
    params = trainable_parameters(module)
    if not params:
        raise ValueError(
            "the head has no parameters with requires_grad=True: nothing to train. "
            "Check that the head does not freeze itself (only the target should be frozen)."
        )
    if cfg.optimizer == "adamw":
        return adamw(module, params, cfg)
    if sharded:
        raise ConfigError(
            "trainer.optimizer=muon is not supported under FSDP (its checkpoints gather one "
            "optimizer's state): use trainer.optimizer=adamw, or train without FSDP."
        )
    vocab = vocabulary_sizes(module)
    custom_lr = getattr(module, "param_lr", None)
    hidden = [
        (n, p)
        for n, p in params
        if p.ndim == 2
        and min(p.shape) > 1
        and not vocab & set(p.shape)
        and not (custom_lr is not None and custom_lr(n))
    ]
    if not hidden:
        raise ConfigError(
            f"trainer.optimizer=muon: the {type(module).__name__} has no hidden weight matrices "
            "for Muon (only vectors and vocabulary tables): use trainer.optimizer=adamw."
        )
    names = {n for n, _ in hidden}
    rest = [(n, p) for n, p in params if n not in names]
    muon = Muon(
        [p for _, p in hidden],
        lr=cfg.muon_lr if cfg.muon_lr is not None else cfg.lr,
        weight_decay=cfg.muon_weight_decay,
        momentum=cfg.muon_momentum,
        adjust_lr_fn=cfg.muon_adjust_lr_fn,
    )
    return MultiOptimizer(
        {"muon": muon, "adamw": adamw(module, rest, cfg)} if rest else {"muon": muon}
    )


def adamw(module: nn.Module, params: list[tuple[str, nn.Parameter]], cfg: TrainerConfig) -> AdamW:
    """AdamW over `params`; matrices get weight decay, vectors (biases, norm scales) do not.

    A head may give some parameters their own learning rate through `param_lr(name) -> float |
    None` (Medusa-2's adapter); the schedule scales every group alike."""
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


def vocabulary_sizes(module: nn.Module) -> set[int]:
    """The vocabulary sizes a head scores or embeds (target and draft vocabularies)."""
    info = getattr(module, "target_info", None)
    sizes = {getattr(info, "vocab_size", None), getattr(module, "draft_vocab_size", None)}
    return {int(v) for v in sizes if isinstance(v, int)}


class MultiOptimizer(Optimizer):
    """Several optimizers over disjoint parameters, stepped together as one.

    `param_groups` lists every inner group (the same dicts, so an lr schedule reaches them all;
    re-linked after `load_state_dict`, which replaces them); `state_dict()` is {name: inner
    state_dict} and `load_state_dict` restores each inner optimizer exactly."""

    def __init__(self, optimizers: dict[str, Optimizer]):
        self.optimizers = dict(optimizers)
        super().__init__(self._inner_groups(), {})
        self._link()

    def _inner_groups(self) -> list[dict]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    def _link(self) -> None:
        self.param_groups = self._inner_groups()
        self.state = ChainMap(*(opt.state for opt in self.optimizers.values()))

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for opt in self.optimizers.values():
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state_dict: dict) -> None:
        if set(state_dict) != set(self.optimizers):
            saved = ", ".join(sorted(state_dict)) or "none"
            raise ConfigError(
                f"the saved optimizer state holds {saved}, not {', '.join(self.optimizers)}: it "
                "was written with another trainer.optimizer; resume with that one, or start "
                "over with trainer.resume=never."
            )
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state_dict[name])
        self._link()


def lr_multiplier(step: int, warmup: int, total: int, min_ratio: float = 0.0) -> float:
    """The factor on the peak lr for the optimizer update with 0-based index `step`.

    Linear warmup reaches 1.0 on update `warmup - 1` (the first update is not wasted at lr 0),
    then a half cosine falls from 1.0 at update `warmup` towards `min_ratio` at update `total`.
    """
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _schedule(warmup: int, total: int, min_ratio: float):
    return lambda step: lr_multiplier(step, warmup, total, min_ratio)


def build_scheduler(optimizer: Optimizer, warmup: int, total: int, min_ratio: float) -> LambdaLR:
    """A LambdaLR over `lr_multiplier`; step it once per optimizer update."""
    return LambdaLR(optimizer, _schedule(warmup, total, min_ratio))


def set_current_lr(scheduler: LambdaLR) -> None:
    """Put each group's lr where `scheduler`'s rules and peak lrs place it at its current step
    (after its rules or peak lrs changed)."""
    groups = scheduler.optimizer.param_groups
    for group, base, rule in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base * rule(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in groups]


def replan_scheduler(scheduler: LambdaLR, warmup: int, total: int, min_ratio: float) -> None:
    """Re-spread `scheduler` (from `build_scheduler`) over a run of `total` steps from where it
    stands, and set each group's current lr on the new curve (a time budget's plan)."""
    rule = _schedule(warmup, total, min_ratio)
    scheduler.lr_lambdas = [rule] * len(scheduler.optimizer.param_groups)
    set_current_lr(scheduler)
