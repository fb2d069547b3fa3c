"""The training loop's settings: one validated dataclass, built by Hydra in the entry point."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from data.errors import ConfigError
from data.hardware import bf16_is_fast

MIXED_PRECISION = ("no", "bf16", "fp16", "auto", "fast_bf16")
OPTIMIZERS = ("adamw", "muon")
MUON_LR_RULES = ("match_rms_adamw", "original")  # torch.optim.Muon's adjust_lr_fn


@dataclass
class TrainerConfig:
    """How to optimise a draft head.

    Steps are optimizer steps; one step consumes `grad_accum` micro-batches of `batch_size`
    examples on every process, so the global batch is batch_size * grad_accum * num_processes.
    `max_steps > 0` fixes the run length; otherwise it is `num_epochs` passes over the data.
    Periodic events (`log_every`, `eval_every`, `save_every`) count optimizer steps; 0 turns
    them off (validation still runs once at the end).
    """

    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: Sequence[float] = (0.9, 0.95)
    eps: float = 1e-8
    # adamw | muon: Muon on the draft's hidden weight matrices, AdamW (lr, weight_decay, betas,
    # eps) on the rest; train/optim.py says which go where
    optimizer: str = "adamw"
    muon_lr: float | None = None  # None: lr (Muon's update is scaled to match AdamW's RMS)
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.0
    muon_adjust_lr_fn: str = "match_rms_adamw"  # or "original" (Keller Jordan's scaling)
    warmup_steps: int = 0
    warmup_ratio: float = 0.0  # fraction of the total steps; use this or warmup_steps
    min_lr_ratio: float = 0.0  # the cosine decays to lr * min_lr_ratio
    max_steps: int = 0
    num_epochs: float = 1.0
    # Wall-clock minutes for the whole run, data preparation and feature cache included; 0: no
    # limit. Where the steps do not fit, fewer are planned and the schedule re-spread over them
    # (train/budget.py).
    time_budget_min: float = 0.0
    batch_size: int = 8  # per process
    eval_batch_size: int | None = None  # per process; None = batch_size
    grad_accum: int = 1
    # Pack each micro-batch's conversations into rows of at most this many tokens, with no
    # padding (attention, positions and labels stay inside each conversation; the loss is the
    # padded batch's). The batch is still `batch_size` conversations, so the data order and
    # resume are unchanged. None or 0: right-padded rows, one conversation each.
    pack_tokens: int | None = None
    max_grad_norm: float = 1.0  # 0 disables clipping
    # no | bf16 | fp16 | auto (bf16 where CUDA supports it). bf16 also runs on a CPU, under
    # torch.autocast with fp32 weights and optimizer (AMX / AVX512-BF16 matmuls)
    mixed_precision: str = "auto"
    eval_every: int = 0
    save_every: int = 0
    keep_last: int = 2  # checkpoints kept; 0 keeps all
    resume: str = "auto"  # auto | never | path to a checkpoint folder
    # Resume even though optimizer, schedule, batch, seed or data settings changed since the
    # checkpoint, applying the new values (train/checkpoint/resume.py lists what is checked).
    allow_config_change: bool = False
    seed: int = 0
    shuffle: bool = True
    log_every: int = 10
    num_workers: int = 0
    progress: bool = True
    cpu: bool = False  # force CPU even where an accelerator exists
    find_unused_parameters: bool = False  # DDP: set when a head leaves parameters unused
    # Keep the head with the best value of this metric in <run_dir>/best_head (e.g. "eval/tau"
    # from a checkpoint-time evaluator, or "val/loss" with best_mode=min); null keeps none.
    best_metric: str | None = None
    best_mode: str = "max"

    def __post_init__(self) -> None:
        self.betas = tuple(float(b) for b in self.betas)
        _check(self.lr > 0, f"lr={self.lr}: set a positive learning rate (e.g. lr=1e-4).")
        _check(self.weight_decay >= 0, f"weight_decay={self.weight_decay}: use 0 or more.")
        _check(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            f"betas={self.betas}: give two numbers in [0, 1), e.g. [0.9, 0.95].",
        )
        _check(
            self.optimizer in OPTIMIZERS,
            f"optimizer={self.optimizer!r}: use one of {', '.join(OPTIMIZERS)}.",
        )
        _check(
            self.muon_lr is None or self.muon_lr > 0,
            f"muon_lr={self.muon_lr}: set a positive learning rate, or null to use lr.",
        )
        _check(0 <= self.muon_momentum < 1, f"muon_momentum={self.muon_momentum}: use [0, 1).")
        _check(
            self.muon_weight_decay >= 0, f"muon_weight_decay={self.muon_weight_decay}: use >= 0."
        )
        _check(
            self.muon_adjust_lr_fn in MUON_LR_RULES,
            f"muon_adjust_lr_fn={self.muon_adjust_lr_fn!r}: use one of {', '.join(MUON_LR_RULES)}.",
        )
        _check(self.warmup_steps >= 0, f"warmup_steps={self.warmup_steps}: use 0 or more.")
        _check(
            0 <= self.warmup_ratio < 1, f"warmup_ratio={self.warmup_ratio}: use a value in [0, 1)."
        )
        _check(
            not (self.warmup_steps and self.warmup_ratio),
            "set warmup_steps or warmup_ratio, not both (set the other to 0).",
        )
        _check(0 <= self.min_lr_ratio <= 1, f"min_lr_ratio={self.min_lr_ratio}: use [0, 1].")
        _check(self.max_steps >= 0, f"max_steps={self.max_steps}: use 0 (epochs) or more.")
        _check(
            self.max_steps > 0 or self.num_epochs > 0,
            "max_steps=0 and num_epochs<=0: set max_steps>0 or num_epochs>0 (how long to train).",
        )
        _check(
            self.time_budget_min >= 0,
            f"time_budget_min={self.time_budget_min}: use minutes of wall time, or 0 (no limit).",
        )
        for name in ("batch_size", "grad_accum"):
            _check(getattr(self, name) >= 1, f"{name}={getattr(self, name)}: use 1 or more.")
        _check(
            self.pack_tokens is None or self.pack_tokens >= 0,
            f"pack_tokens={self.pack_tokens}: use a row length in tokens (e.g. 2048), or null.",
        )
        _check(
            self.eval_batch_size is None or self.eval_batch_size >= 1,
            f"eval_batch_size={self.eval_batch_size}: use 1 or more, or null for batch_size.",
        )
        _check(self.max_grad_norm >= 0, f"max_grad_norm={self.max_grad_norm}: 0 disables it.")
        _check(
            self.mixed_precision in MIXED_PRECISION,
            f"mixed_precision={self.mixed_precision!r}: use one of {', '.join(MIXED_PRECISION)}.",
        )
        for name in ("eval_every", "save_every", "keep_last", "log_every", "num_workers"):
            _check(getattr(self, name) >= 0, f"{name}={getattr(self, name)}: use 0 or more.")
        _check(
            self.resume in ("auto", "never") or Path(self.resume).is_dir(),
            f"resume={self.resume!r}: use 'auto', 'never', or an existing checkpoint folder.",
        )

    def warmup_for(self, total_steps: int) -> int:
        """Warmup length in optimizer steps for a run of `total_steps`."""
        if self.warmup_ratio:
            return int(self.warmup_ratio * total_steps)
        return self.warmup_steps


def resolve_mixed_precision(mode: str) -> str:
    """'auto' becomes 'bf16' where CUDA supports it, else 'no'. 'fast_bf16' also takes bf16 on a
    CPU with bf16 matmuls in hardware (AMX or AVX512-BF16: the EAGLE-3 step 1.8-2.6x fp32's,
    docs/reports/2026-12-01-throughput/throughput.md) and 'no' on one without, where autocast
    emulates bf16 and runs slower than fp32 (the 20-minute and 2-hour EAGLE-3 recipes use it).
    Other modes pass through."""
    if mode not in ("auto", "fast_bf16"):
        return mode
    if mode == "fast_bf16":
        return "bf16" if bf16_is_fast() else "no"
    return "bf16" if torch.cuda.is_available() and bf16_is_fast() else "no"  # auto: GPUs only


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(f"TrainerConfig: {message}")


def fold_chat_template(cfg) -> None:
    """One chat template for the whole run: `data.chat_template` (the documented key for a base
    model without one) is written into `model.chat_template` as template text, so the target's
    tokenizer carries it everywhere (data, checkpoint evaluation, the run's config.yaml that
    evaluate.py and the exports read). `model.chat_template` given alone is used as it is; two
    different templates are refused. A template file is replaced by its text. With `head_path`
    (evaluate.py) and no template given, the template of the run that head came from is used."""
    from omegaconf import open_dict

    from data.chat import template_text

    _template_of_the_heads_run(cfg)
    data, model = cfg.get("data") or {}, cfg.get("model") or {}
    wanted, have = data.get("chat_template"), model.get("chat_template")
    if not wanted:
        if have:  # a file's text, so the run's config.yaml carries the template itself
            with open_dict(cfg):
                cfg.model.chat_template = template_text(have)
        return
    text = template_text(wanted)
    if have and template_text(have) != text:
        raise ConfigError(
            "data.chat_template and model.chat_template name different templates; set one "
            "(model.chat_template is the target's, used by training and evaluation alike)."
        )
    with open_dict(cfg):
        cfg.model.chat_template = text
        cfg.data.chat_template = None


def _template_of_the_heads_run(cfg) -> None:
    """evaluate.py head_path=RUN/head without model.chat_template: RUN's own template, if set."""
    from omegaconf import OmegaConf, open_dict

    from train.rundir import CONFIG_FILE

    head = cfg.get("head_path")
    model = cfg.get("model") or {}
    if not head or model.get("chat_template") or (cfg.get("data") or {}).get("chat_template"):
        return
    run_config = Path(str(head)).expanduser().parent / CONFIG_FILE
    if not run_config.is_file():
        return
    template = (OmegaConf.load(run_config).get("model") or {}).get("chat_template")
    if template:
        with open_dict(cfg):
            cfg.model.chat_template = template
