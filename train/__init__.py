"""Training: one Accelerate loop for every head (train.loop), and the recipe `run(cfg)`."""

from __future__ import annotations


def run(cfg, run_dir=None):
    """Train the head described by a composed Hydra config (see train/run.py)."""
    from train.run import run as _run

    return _run(cfg, run_dir)


__all__ = ["run"]
