"""What `trainer.resume` trusts: an intact checkpoint, and a run that is still the same run.

Choosing: `resume=auto` takes the newest checkpoint that passes `checkpoint_problems`. Damaged
newer ones are moved aside to `checkpoints/damaged_step_<N>` (so pruning never keeps them in
place of good ones) with a warning that names them; when none is intact the run stops and says
what to do.

Comparing: each checkpoint records the run's settings and a sha1 of its data (run.json). On
resume they are compared with this run's, setting by setting:
  - free: logging, evaluation and checkpoint cadence, W&B, evaluators, evaluate.py's tree, the
    resume switches; applied, listed in the log;
  - stretched: `max_steps`, `num_epochs`, `mixed_precision`, `time_budget_min`; applied with a
    warning (the cosine schedule is re-spread over the new length);
  - never: `head.*`, `model.*`: another head or target is another run; always refused;
  - guarded: everything else (optimizer, schedule, batch, seeds, the data): refused unless
    `trainer.allow_config_change=true`, which applies them, the new learning rate included.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from train.checkpoint.folder import CheckpointError, checkpoint_problems, list_checkpoints
from train.config import TrainerConfig
from train.optim import set_current_lr
from train.rundir import flatten

log = logging.getLogger(__name__)

DAMAGED_PREFIX = "damaged_"
FREE = (
    "logger",
    "callbacks",
    "evaluators",
    "export",
    "tree",  # the tree evaluate.py drafts with (an experiment names one); training ignores it
    "threads",
    "seed",  # the top-level seed only initialises the head; trainer.seed orders the data
    "init_from",
    "data.features",
    "data.feature_cache",
    "data.feature_dtype",
    "data.feature_autocast",
    "trainer.log_every",
    "trainer.eval_every",
    "trainer.save_every",
    "trainer.keep_last",
    "trainer.resume",
    "trainer.allow_config_change",
    "trainer.progress",
    "trainer.num_workers",
    "trainer.eval_batch_size",
    "trainer.cpu",
    "trainer.find_unused_parameters",
    "trainer.best_metric",
    "trainer.best_mode",
)
STRETCHED = (
    "trainer.max_steps",
    "trainer.num_epochs",
    "trainer.mixed_precision",
    "trainer.time_budget_min",
)
NEVER = ("head", "model")
DATA_KEY = "data_sha1"


# ---- choosing a checkpoint ------------------------------------------------------------------


def find_intact_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint that passes `checkpoint_problems`, or None when there is none.

    Damaged newer ones are moved aside with a warning; CheckpointError when checkpoints exist
    but none is intact. Main process only (it reads every file of the candidates)."""
    damaged: list[tuple[Path, list[str]]] = []
    for _, path in reversed(list_checkpoints(run_dir)):
        problems = checkpoint_problems(path)
        if not problems:
            for bad, why in damaged:
                aside = _move_aside(bad)
                log.warning(
                    "checkpoint %s is damaged (%s): moved to %s; resuming from %s instead",
                    bad,
                    "; ".join(why[:3]),
                    aside.name,
                    path.name,
                )
            return path
        damaged.append((path, problems))
    if damaged:
        listed = ", ".join(f"{p.name} ({'; '.join(why[:2])})" for p, why in damaged)
        raise CheckpointError(
            f"no intact checkpoint in {damaged[0][0].parent}: {listed}. Delete that folder (or "
            "set trainer.resume=never) to start over, or restore a checkpoint from a copy."
        )
    return None


def check_explicit_checkpoint(path: str | os.PathLike) -> Path:
    """`resume=<folder>`: that folder, refused when damaged (no silent fallback)."""
    problems = checkpoint_problems(path)
    if problems:
        raise CheckpointError(
            f"trainer.resume={path}: the checkpoint is damaged ({'; '.join(problems[:3])}); "
            "name another step_<N> folder, or use trainer.resume=auto to take the newest intact."
        )
    return Path(path)


def _move_aside(path: Path) -> Path:
    aside, n = path.with_name(DAMAGED_PREFIX + path.name), 1
    while aside.exists():
        aside, n = path.with_name(f"{DAMAGED_PREFIX}{path.name}.{n}"), n + 1
    os.replace(path, aside)
    return aside


# ---- comparing settings ---------------------------------------------------------------------


def run_record(
    config: Mapping[str, Any] | None, trainer: TrainerConfig, data_sha1: str | None
) -> dict[str, Any]:
    """What a checkpoint records about its run: the settings (the trainer section from the
    validated TrainerConfig itself) and the data fingerprint, as plain JSON values."""
    settings = {k: v for k, v in (config or {}).items() if k != "trainer"}
    settings["trainer"] = asdict(trainer)
    return json.loads(json.dumps({"config": settings, DATA_KEY: data_sha1}))


@dataclass
class SettingsDiff:
    """Changed settings between a checkpoint's run and this one, as "name: old -> new"."""

    free: list[str] = field(default_factory=list)
    stretched: list[str] = field(default_factory=list)
    guarded: list[str] = field(default_factory=list)
    never: list[str] = field(default_factory=list)


def diff_settings(saved: Mapping[str, Any], current: Mapping[str, Any]) -> SettingsDiff:
    old, new = flatten(saved.get("config") or {}), flatten(current.get("config") or {})
    data_known = saved.get(DATA_KEY) is not None and current.get(DATA_KEY) is not None
    diff = SettingsDiff()
    for name in sorted(set(old) | set(new)):
        if old.get(name, _UNSET) == new.get(name, _UNSET):
            continue
        text = f"{name}: {_show(old.get(name, _UNSET))} -> {_show(new.get(name, _UNSET))}"
        if _under(name, NEVER):
            diff.never.append(text)
        elif _under(name, STRETCHED):
            diff.stretched.append(text)
        elif _under(name, FREE) or (data_known and _under(name, ("data",))):
            diff.free.append(text)  # with a data fingerprint, the data decide, not the config
        else:
            diff.guarded.append(text)
    if data_known and saved[DATA_KEY] != current[DATA_KEY]:
        diff.guarded.append(
            f"the training data (sha1 {saved[DATA_KEY][:12]} -> {current[DATA_KEY][:12]})"
        )
    return diff


def check_settings(
    saved: Mapping[str, Any] | None,
    current: Mapping[str, Any],
    allow_change: bool,
    where: Path,
    verbose: bool = True,
) -> bool:
    """Refuse (CheckpointError) or accept resuming `where` with this run's settings; log what
    changed when `verbose`. True when guarded settings changed and were allowed: the caller
    then applies the new optimizer settings (`apply_optimizer_settings`)."""
    if saved is None:
        if verbose:
            log.warning("%s records no run settings (an older checkpoint): not compared", where)
        return False
    diff = diff_settings(saved, current)
    fix = "use a new run dir (hydra.run.dir=...) or trainer.resume=never to start over"
    if diff.never:
        raise CheckpointError(
            f"cannot resume {where}: {_listing(diff.never)}; another head or target makes "
            f"another run: {fix}."
        )
    if diff.guarded and not allow_change:
        raise CheckpointError(
            f"resuming {where} would silently continue the old run under new settings: "
            f"{_listing(diff.guarded)}. Set trainer.allow_config_change=true to apply them, "
            f"restore the old values, or {fix}."
        )
    if verbose:
        for text in diff.free:
            log.info("resume: %s", text)
        for text in diff.stretched:
            log.warning("resume: %s (the schedule is spread over the new length)", text)
        for text in diff.guarded:
            log.warning("resume: %s (applied: trainer.allow_config_change=true)", text)
    return bool(diff.guarded)


def _listing(texts: list[str]) -> str:
    more = f" (and {len(texts) - 3} more)" if len(texts) > 3 else ""
    return "; ".join(texts[:3]) + more


_UNSET = object()


def _show(value: Any) -> str:
    return "unset" if value is _UNSET else json.dumps(value)


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


# ---- applying new optimizer settings -----------------------------------------------------


_HYPER = ("weight_decay", "betas", "eps")


def optimizer_settings(optimizer: Optimizer, scheduler: LambdaLR) -> list[dict[str, Any]]:
    """The peak lr and hyperparameters of each parameter group as this run built them."""
    return [
        {"initial_lr": base, **{k: group[k] for k in _HYPER if k in group}}
        for base, group in zip(scheduler.base_lrs, optimizer.param_groups, strict=True)
    ]


def apply_optimizer_settings(
    optimizer: Optimizer, scheduler: LambdaLR, fresh: list[dict[str, Any]]
) -> None:
    """After loading a checkpoint's optimizer and scheduler state (which restore the old peak
    lr and hyperparameters), put back this run's and recompute the current lr on this run's
    schedule, so a changed `trainer.lr` really takes effect."""
    if len(fresh) != len(optimizer.param_groups):
        raise CheckpointError(
            "the checkpoint's optimizer has other parameter groups than this head's: "
            "resume with the same head, or start over with trainer.resume=never."
        )
    scheduler.base_lrs = [f["initial_lr"] for f in fresh]
    for group, settings in zip(optimizer.param_groups, fresh, strict=True):
        group.update(settings)
    set_current_lr(scheduler)
