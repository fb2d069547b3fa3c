"""Run under `accelerate launch` by tests/test_synthesize.py: synthesis + distillation of the
tiny writer target on every process, sharded by rank. argv: OUT."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from accelerate import PartialState

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.distill import DistillConfig, distill  # noqa: E402
from tests.test_synthesize import LOOSE, writer_target  # noqa: E402

torch.set_num_threads(1)
state = PartialState(cpu=True)
cfg = DistillConfig(
    prompts=[{"synthesize": 40, **LOOSE}], out=sys.argv[1], max_new_tokens=6, batch_size=4
)
distill(
    writer_target(),
    cfg,
    rank=state.process_index,
    world_size=state.num_processes,
    barrier=state.wait_for_everyone if state.num_processes > 1 else None,
    progress=False,
)
