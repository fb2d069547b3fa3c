"""Every experiment's defaults run: `evaluate.py +experiment=X head_path=<a head of X>` with no
other override drafts with the tree X names (conf/experiment/*.yaml, `override /tree`), losslessly.

Each experiment runs on a tiny random Llama (the *_llama ones are SmolLM2, a Llama: only the
model is swapped; the head, its tree and the methods stay the experiment's), with a head built
from the experiment's own head config and saved, on the first MT-bench question (two turns) and
a few new tokens. A tree or method the head cannot use, given on the command line, ends the real
CLI with one line that names the fix.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

import heads
from data.errors import ConfigError
from eval.bench import report
from eval.bench.harness import ALL_METHODS, check_methods, run
from eval.bench.llama_cpp import LLAMA_CPP_METHODS, check_draft_head
from eval.bench.methods import METHODS, build_methods
from eval.bench.openvino import OPENVINO_METHODS
from eval.bench.vllm import VLLM_METHODS
from eval.engine.tree_spec import resolve_tree
from heads.target import load_target
from train.cli import EXIT_USER_ERROR

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
QUICK = ["bench.limit=1", "bench.max_new_tokens=6", "bench.warmup=0", "threads=1"]


def named_tree(experiment: str) -> str:
    """The conf/tree option an experiment's defaults list names (`override /tree: NAME`)."""
    doc = yaml.safe_load((CONF / "experiment" / f"{experiment}.yaml").read_text())
    found = [e["override /tree"] for e in doc["defaults"] if "override /tree" in e]
    assert len(found) == 1, f"{experiment}: name one tree (- override /tree: NAME)"
    return found[0]


def compose_eval(experiment: str, *extra: str):
    # the same family, tiny (the Qwen2.5-Coder target is assembled only on request)
    tiny = {"_llama": "tiny_random_llama", "_qwen_coder": "tiny_random_qwen2"}
    model = [f"model={m}" for key, m in tiny.items() if key in experiment]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("evaluate", overrides=[f"+experiment={experiment}", *model, *extra])


def save_head(cfg, folder: Path) -> Path:
    """A head of the experiment's own config (random weights; a reduced draft vocabulary takes
    the first ids, EOS always kept), saved as training would save it."""
    target = load_target(instantiate(cfg.model, _convert_="all"))
    torch.manual_seed(0)
    counts = torch.arange(target.vocab_size, 0, -1)
    head = heads.build_head(instantiate(cfg.head), target, token_counts=counts)
    head.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_the_experiment_defaults_evaluate_a_head_of_that_experiment(
    experiment, tmp_path, monkeypatch
):
    monkeypatch.setattr(report, "PLOTS", {})  # report.md, not the PNGs (seconds each)
    cfg = compose_eval(experiment, *QUICK, f"out_dir={tmp_path / 'out'}", "logger.mode=disabled")
    cfg.head_path = str(save_head(cfg, tmp_path / "head"))
    summary = run(cfg)
    tree = resolve_tree(named_tree(experiment))
    meta = summary["meta"]
    assert (meta["tree_nodes"], meta["tree_depth"]) == (tree.num_nodes, tree.depth)
    assert list(summary["methods"]) == ["plain", "hf_generate", "hf_prompt_lookup", "head"]
    head = summary["methods"]["head"]["overall"]
    assert meta["num_requests"] == 2 and head["tau"] >= 1.0
    assert head["greedy_mismatches"] == 0
    assert (tmp_path / "out" / "report.md").is_file()


# ---- mismatches on the command line: one line with the fix ----------------------------------


@pytest.fixture(scope="module")
def tiny_heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    return {
        name: save_head(compose_eval(name), root / name) for name in ("dspark_tiny", "medusa_tiny")
    }


def evaluate_cli(tmp_path, *args):
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "HYDRA_FULL_ERROR": "0",
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "evaluate.py", *args, *QUICK, f"hydra.run.dir={tmp_path}"]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.integration
@pytest.mark.parametrize(
    "experiment, override, fix",
    [
        # DSpark conditions each token on the one before: a chain of its block (4), not tree16
        ("dspark_tiny", "tree=tree16", "use tree=4 (a chain of 4)"),
        # Medusa fills static trees; its two heads draft two tokens
        ("medusa_tiny", "tree=dynamic", "not an EAGLE-2 dynamic tree; use a tree at most 2 deep"),
        ("medusa_tiny", "methods=[plain,bogus]", "unknown 'bogus'; use any of plain, hf_generate"),
    ],
)
def test_a_mismatch_on_the_command_line_is_one_line_with_the_fix(
    experiment, override, fix, tiny_heads, tmp_path
):
    head = tiny_heads[experiment]
    proc = evaluate_cli(tmp_path, f"+experiment={experiment}", f"head_path={head}", override)
    assert proc.returncode == EXIT_USER_ERROR, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fix in lines[0], proc.stderr
    assert not (tmp_path / "summary.json").exists()


# ---- the lists and checks behind those messages ----------------------------------------------


def test_the_method_list_is_every_method_there_is():
    assert ALL_METHODS == (*METHODS, *LLAMA_CPP_METHODS, *OPENVINO_METHODS, *VLLM_METHODS)
    assert {"llama_cpp_plain", "llama_cpp_draft", "llama_cpp_ngram", "head"} <= set(ALL_METHODS)
    assert {"vllm_plain", "vllm_draft"} <= set(ALL_METHODS)
    with pytest.raises(ConfigError) as err:
        check_methods(["plain", "nope"], has_head=True)
    assert all(name in str(err.value) for name in ALL_METHODS) and "'nope'" in str(err.value)
    with pytest.raises(ConfigError, match="give head_path"):
        check_methods(["head"], has_head=False)
    assert check_methods(["plain", "llama_cpp_ngram"], has_head=False) == [
        "plain",
        "llama_cpp_ngram",
    ]


def test_every_listed_engine_free_method_builds(tiny_llama):
    from heads.medusa import MedusaConfig, MedusaHeads

    medusa = MedusaHeads.for_target(MedusaConfig(num_heads=2), tiny_llama)
    built = build_methods(tiny_llama, list(METHODS), medusa, resolve_tree(2))
    assert [m.name for m in built] == list(METHODS)
    with pytest.raises(ConfigError, match="a tree at most 2 deep"):
        build_methods(tiny_llama, ["head"], medusa, resolve_tree("tree16"))


def test_llama_cpp_draft_refuses_a_head_llama_cpp_cannot_serve(tiny_llama):
    from heads.medusa import MedusaConfig, MedusaHeads

    medusa = MedusaHeads.for_target(MedusaConfig(num_heads=2), tiny_llama)
    with pytest.raises(ConfigError, match="drop llama_cpp_draft from methods"):
        check_draft_head(medusa)
    with pytest.raises(ConfigError, match="needs head_path"):
        check_draft_head(None)


def test_a_run_started_before_experiments_named_trees_still_resumes():
    """The tree is evaluate.py's: a training run's config gains `tree` from its experiment, and
    a checkpoint written without it resumes (the change is free, not a refused one)."""
    from train.checkpoint.resume import diff_settings, run_record
    from train.config import TrainerConfig

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=dspark_llama"])
    assert resolve_tree(dict(cfg.tree)).depth == 7  # the experiment's chain7
    trainer = TrainerConfig()
    before = run_record({"seed": 0}, trainer, None)
    after = run_record({"seed": 0, "tree": {"paths": [[0], [0, 0]]}}, trainer, None)
    diff = diff_settings(before, after)
    assert diff.free and not (diff.guarded or diff.never or diff.stretched)
