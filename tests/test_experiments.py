"""Every experiment config composes, instantiates, trains two steps, saves, reloads and resumes.

`medusa_llama` runs on the real embedded SmolLM2 (converted once into DRAFTSMITH_CACHE), with the
data cut to a few short conversations so the two steps take seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import heads
from heads.target import load_target
from train.run import run

CONF = Path(__file__).resolve().parents[1] / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
SMALL = [
    "data.max_train_examples=8",
    "data.max_val_examples=2",
    "data.max_length=128",
    "trainer.max_steps=2",
    "trainer.batch_size=2",
    "trainer.eval_every=0",
    "trainer.save_every=2",
    "trainer.progress=false",
    "logger.mode=disabled",
]


def _compose(name: str, extra: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[f"+experiment={name}", *SMALL, *extra])


def test_experiments_exist():
    assert {"medusa_llama", "medusa_tiny"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_runs_two_steps_saves_and_resumes(name, tmp_path):
    cfg = _compose(name, [])
    result = run(cfg, run_dir=tmp_path)
    assert result.step == 2 and not result.stopped_early
    assert any(k.endswith("head0/top1") for k in result.val_metrics)
    assert json.loads((tmp_path / "head" / "config.json").read_text())["method"]
    target = load_target(__import__("hydra").utils.instantiate(cfg.model))
    head = heads.from_pretrained(tmp_path / "head", target)
    h = torch.randn(3, target.hidden_size)
    assert torch.isfinite(head(h)).all()
    # A longer run in the same dir resumes from step 2 instead of starting over.
    longer = run(_compose(name, ["trainer.max_steps=3"]), run_dir=tmp_path)
    assert longer.step == 3
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert max(x.get("step", 0) for x in lines) == 3
    assert (tmp_path / "checkpoints" / "step_2").is_dir()
    assert (tmp_path / "config.yaml").is_file()
