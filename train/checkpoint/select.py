"""Checkpoint-time evaluation and best-head selection.

An evaluator is any callable `(head, target) -> dict[str, float]` (e.g. TauEvaluator (eval.engine),
injected by the entry point through Hydra; train/ never imports eval/). It runs on the main
process whenever the loop validates; its numbers are logged as `eval/<name>`. With
`TrainerConfig.best_metric` set (e.g. "eval/tau" or "val/loss"), the head with the best value
so far is kept in `<run_dir>/best_head/` with `best.json` beside it, so the kept head is the one
that decodes best, not merely the one with the lowest loss.

Crash safety: best_head/ is replaced as a whole (heads.base.atomic_save_dir) and carries its own
copy of the record (best_head/best.json) and a manifest; the outer best.json, written after the
folder, is a pointer that can always be rebuilt from the inner copy. A damaged best_head/ is set
aside when the run starts, so the run ends with a sound best head or none, never a corrupt one.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from train.checkpoint.folder import save_head_folder
from train.rundir import (
    BEST_DIR,
    BEST_FILE,
    HEAD_DIR,
    MANIFEST_FILE,
    RunDirError,
    kept_head,
    manifest_problems,
    read_json,
    write_json_atomic,
)

log = logging.getLogger(__name__)

Evaluator = Callable[[Any, Any], Mapping[str, float]]
__all__ = ["BEST_DIR", "BEST_FILE", "HEAD_DIR", "BestKeeper", "Evaluator", "kept_head"]


def run_evaluators(evaluators: Sequence[Evaluator], head, target) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for evaluator in evaluators:
        for name, value in evaluator(head, target).items():
            metrics[f"eval/{name}"] = float(value)
    return metrics


class BestKeeper:
    """Keeps the head with the best `metric` (mode "max" or "min") in run_dir/best_head.

    Only the main process (`is_main`) reads, repairs or writes anything."""

    def __init__(
        self, run_dir: str | Path, metric: str | None, mode: str = "max", is_main: bool = True
    ) -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"best_mode={mode!r}: use 'max' (e.g. eval/tau) or 'min' (losses).")
        self.run_dir, self.metric, self.mode = Path(run_dir), metric, mode
        self.best: float | None = None
        if metric is not None and is_main:
            self.best = self._recover()

    def _recover(self) -> float | None:
        """The best value so far, after making best_head/ and best.json agree (see module)."""
        folder, outer = self.run_dir / BEST_DIR, self.run_dir / BEST_FILE
        if not folder.is_dir():
            if outer.exists():
                log.warning("%s points at no %s/: removed it", outer, BEST_DIR)
                outer.unlink()
            return None
        problems = [p for p in manifest_problems(folder) if p != f"no {MANIFEST_FILE}"]
        if problems:
            _set_aside(folder, outer, problems)
            return None
        inner = _record(folder / BEST_FILE)
        if inner is not None:
            if _record(outer) != inner:
                log.warning("%s was missing or stale: rebuilt from %s", outer, folder / BEST_FILE)
                write_json_atomic(outer, inner)
            return _value_for(inner, self.metric, outer)
        record = _record(outer)  # a best_head/ from before it carried its own record
        if record is None and outer.exists():
            raise RunDirError(
                f"{outer} is damaged and {folder} (written by an older draftsmith) holds no "
                f"copy of it: delete both to choose the best head afresh, or fix {outer}."
            )
        return None if record is None else _value_for(record, self.metric, outer)

    def better(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        return value > self.best if self.mode == "max" else value < self.best

    def update(self, metrics: Mapping[str, float], step: int, head) -> bool:
        """Save `head` if `metrics[metric]` beats the best so far (main process only)."""
        if self.metric is None or self.metric not in metrics:
            return False
        value = float(metrics[self.metric])
        if not self.better(value):
            return False
        record = {"metric": self.metric, "value": value, "step": step}

        def also(tmp: Path) -> None:
            write_json_atomic(tmp / BEST_FILE, record)

        save_head_folder(head, self.run_dir / BEST_DIR, also)  # the folder first, whole and synced
        write_json_atomic(self.run_dir / BEST_FILE, record)  # then the pointer to it
        self.best = value
        return True


def _record(path: Path) -> dict | None:
    doc = read_json(path)
    ok = isinstance(doc, dict) and isinstance(doc.get("value"), int | float) and "metric" in doc
    return doc if ok else None


def _value_for(record: dict, metric: str | None, where: Path) -> float | None:
    if record["metric"] != metric:
        log.warning(
            "%s ranks heads by %s, this run by %s: its best value is not carried over",
            where,
            record["metric"],
            metric,
        )
        return None
    return float(record["value"])


def _set_aside(folder: Path, pointer: Path, problems: list[str]) -> None:
    aside = folder.with_name(f"{folder.name}.damaged")
    if aside.exists():
        shutil.rmtree(aside)
    os.replace(folder, aside)
    pointer.unlink(missing_ok=True)
    log.warning(
        "%s is damaged (%s): moved to %s; the best head is chosen again from this run's next "
        "evaluations",
        folder,
        "; ".join(problems[:3]),
        aside.name,
    )
