"""Checkpoint-time evaluation and best-head selection.

An evaluator is any callable `(head, target) -> dict[str, float]` (e.g. eval.hooks.TauEvaluator,
injected by the entry point through Hydra; train/ never imports eval/). It runs on the main
process whenever the loop validates; its numbers are logged as `eval/<name>`. With
`TrainerConfig.best_metric` set (e.g. "eval/tau" or "val/loss"), the head with the best value
so far is kept in `<run_dir>/best_head/` with `best.json` beside it, so the kept head is the one
that decodes best, not merely the one with the lowest loss.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from heads.base import CONFIG_NAME, atomic_save_dir

Evaluator = Callable[[Any, Any], Mapping[str, float]]
BEST_DIR = "best_head"
BEST_FILE = "best.json"
HEAD_DIR = "head"  # where the loop saves the final head


def kept_head(run_dir: str | Path) -> Path | None:
    """The head a run keeps: best_head when an evaluator chose one, else the final head; None
    when the run saved neither."""
    for name in (BEST_DIR, HEAD_DIR):
        if (Path(run_dir) / name / CONFIG_NAME).is_file():
            return Path(run_dir) / name
    return None


def run_evaluators(evaluators: Sequence[Evaluator], head, target) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for evaluator in evaluators:
        for name, value in evaluator(head, target).items():
            metrics[f"eval/{name}"] = float(value)
    return metrics


class BestKeeper:
    """Keeps the head with the best `metric` (mode "max" or "min") in run_dir/best_head."""

    def __init__(self, run_dir: str | Path, metric: str | None, mode: str = "max") -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"best_mode={mode!r}: use 'max' (e.g. eval/tau) or 'min' (losses).")
        self.run_dir, self.metric, self.mode = Path(run_dir), metric, mode
        record = self.run_dir / BEST_FILE
        self.best = json.loads(record.read_text())["value"] if record.is_file() else None

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
        atomic_save_dir(self.run_dir / BEST_DIR, head.save_pretrained)
        record = {"metric": self.metric, "value": value, "step": step}
        tmp = self.run_dir / f".{BEST_FILE}.tmp"
        tmp.write_text(json.dumps(record) + "\n")
        tmp.replace(self.run_dir / BEST_FILE)
        self.best = value
        return True
