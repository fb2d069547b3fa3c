"""Every experiment config composes, instantiates, trains two steps, saves, reloads and resumes.

`medusa_llama` runs on the real embedded SmolLM2 (converted once into DRAFTSMITH_CACHE), with the
data cut to a few short conversations so the two steps take seconds.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

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


@pytest.fixture(scope="module")
def shared_answers(tmp_path_factory) -> Path:
    """One folder for the self-distilled answers of every `_llama` experiment: they ask the same
    12 prompts of the same target with the same settings, so llama-server answers them once and
    the later experiments reuse the file (distill checks its settings before reusing it)."""
    return tmp_path_factory.mktemp("answers")


# Recipes on a target that the default set-up does not install (Qwen2.5-Coder, 1.1 GB, assembled
# on request) run here on the tiny random Qwen2, answering through HF: the recipe's own settings,
# another model.
OPTIONAL_TARGET = {"eagle3_qwen_coder": ["model=tiny_random_qwen2", "data.self_distill.backend=hf"]}


def _self_distilled(name: str) -> bool:
    return "_llama" in name or name in OPTIONAL_TARGET


def _compose(
    name: str, extra: list[str], tmp_path: Path | None = None, answers: Path | None = None
):
    extra = [*OPTIONAL_TARGET.get(name, []), *extra]
    if _self_distilled(name) and tmp_path is not None:
        # the real default path (self-distilled data, disk feature cache), cut to a few prompts
        extra = [
            "data.self_distill.prompts=[{path: data/corpora/oa_prompts_en/prompts.jsonl, "
            "skip: 16, max_rows: 12}]",
            "data.self_distill.max_new_tokens=12",
            f"data.self_distill.out={tmp_path}/sd/sd.jsonl",
            f"data.feature_cache={tmp_path}/features",
            *extra,
        ]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"+experiment={name}", *SMALL, *extra])
    with open_dict(cfg):
        if answers is not None and _self_distilled(name) and cfg.data.get("self_distill"):
            # experiments whose answers are made alike share one file (one per settings)
            settings = OmegaConf.to_container(cfg.data.self_distill, resolve=True)
            settings.pop("out", None)
            text = json.dumps([settings, cfg.model.name_or_path], sort_keys=True, default=str)
            key = hashlib.sha1(text.encode()).hexdigest()[:10]
            cfg.data.self_distill.out = str(answers / key / "sd.jsonl")
        for evaluator in cfg.get("evaluators") or []:  # the checkpoint-tau evaluator still runs,
            evaluator.limit, evaluator.max_new_tokens = 1, 8  # on one short prompt
    return cfg


def test_experiments_exist():
    assert {"medusa_llama", "medusa_tiny"} <= set(EXPERIMENTS)


@pytest.mark.parametrize(
    "name",
    # the *_llama recipes load the real SmolLM2 and self-distil through llama-server
    [pytest.param(n, marks=pytest.mark.integration) if "_llama" in n else n for n in EXPERIMENTS],
)
def test_experiment_runs_two_steps_saves_and_resumes(name, tmp_path, shared_answers):
    cfg = _compose(name, [], tmp_path, shared_answers)
    result = run(cfg, run_dir=tmp_path)
    assert result.step == 2 and not result.stopped_early
    assert any(k.endswith("head0/top1") for k in result.val_metrics)
    assert json.loads((tmp_path / "head" / "config.json").read_text())["method"]
    target = load_target(__import__("hydra").utils.instantiate(cfg.model))
    head = heads.from_pretrained(tmp_path / "head", target)
    h = torch.randn(3, target.hidden_size)
    assert torch.isfinite(head(h)).all()
    # A longer run in the same dir resumes from step 2 instead of starting over.
    longer = run(
        _compose(name, ["trainer.max_steps=3"], tmp_path, shared_answers), run_dir=tmp_path
    )
    assert longer.step == 3
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert max(x.get("step", 0) for x in lines) == 3
    assert (tmp_path / "checkpoints" / "step_2").is_dir()
    assert (tmp_path / "config.yaml").is_file()
    stats = json.loads((tmp_path / "data_stats.json").read_text())
    assert stats["train"]["examples"] > 0 and stats["train"]["loss_tokens"] > 0
    if _self_distilled(name):  # trained on the target's own answers, features from disk
        assert len(Path(cfg.data.self_distill.out).read_text().splitlines()) == 12
        if cfg.data.features == "disk":
            assert list((tmp_path / "features").glob("*/index.json"))
