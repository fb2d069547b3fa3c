"""Training: one Accelerate loop for every head (train.loop) and the recipe (train.run.run).

Call the recipe as `from train.run import run`: once the submodule train.run is imported,
the attribute `train.run` is that module, so a package-level wrapper named `run` would be
shadowed (that bit scripts/gpu_check.py)."""

from __future__ import annotations
