"""eval/bench/gpu_check.py, the steps of scripts/gpu_check.sh, and the script's command line."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from eval.bench import gpu_check

ROOT = Path(__file__).resolve().parents[1]


def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), *args],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip


def test_environment_records_packages_and_names_what_is_missing(tmp_path, monkeypatch):
    info = gpu_check.environment(tmp_path / "res")
    assert info["missing"] == [] and info["packages"]["torch"]
    assert json.loads((tmp_path / "res" / "env.json").read_text()) == info
    assert info["cuda"] in (True, False) and isinstance(info["gpus"], list)
    monkeypatch.setattr(gpu_check, "NEEDED", [*gpu_check.NEEDED, "no-such-package-draftsmith"])
    assert gpu_check.environment(tmp_path / "res")["missing"] == ["no-such-package-draftsmith"]


def test_the_character_tokenizer_round_trips_and_renders_chatml(tmp_path):
    from transformers import AutoTokenizer

    gpu_check.char_tokenizer(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    ids = tok("Hi there!")["input_ids"]
    assert len(ids) == len("Hi there!") and tok.decode(ids) == "Hi there!"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "ab"}], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")


def _fake_run(run: Path, losses, ranks, head: bool = True) -> Path:
    run.mkdir(parents=True)
    rows = [{"step": i, "train/loss": x} for i, x in enumerate(losses)] + [{"val/loss": 1.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for i, kind in enumerate(ranks):
        record = {"rank": i, "world": len(ranks), "distributed_type": kind, "elapsed_s": 2.0}
        (run / f"dist_rank{i}.json").write_text(json.dumps(record | {"tokens": 100}))
    if head:
        (run / "head").mkdir()
        (run / "head" / "model.safetensors").write_bytes(b"x")
    return run


def test_check_train_passes_a_sound_run_and_names_each_problem(tmp_path):
    good = gpu_check.check_train(_fake_run(tmp_path / "a", [2.0, 1.5], ["FSDP", "FSDP"]), "FSDP")
    assert good["ok"] and good["tokens_per_s"] == 50 and good["last_loss"] == 1.5
    assert json.loads((tmp_path / "a" / "check.json").read_text()) == good
    bad = gpu_check.check_train(
        _fake_run(tmp_path / "b", [2.0, math.nan], ["FSDP", "MULTI_GPU"], head=False), "FSDP"
    )
    assert not bad["ok"]
    problems = " | ".join(bad["problems"])
    for words in ("not all finite", "no head/model.safetensors", "ranks disagree"):
        assert words in problems, problems
    other = gpu_check.check_train(_fake_run(tmp_path / "c", [1.0], ["MULTI_GPU"]), "FSDP")
    assert other["problems"] == ["ran as MULTI_GPU, not FSDP"]


def _summary(folder: Path, head_mismatches: int, near_ties: int, with_head: bool = True) -> Path:
    overall = {"tau": 1.23456, "greedy_mismatches": 0, "requests": 4}
    methods = {"plain": {"overall": overall}}
    if with_head:
        head = overall | {"greedy_mismatches": head_mismatches, "near_tie_mismatches": near_ties}
        methods["head"] = {"overall": head}
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"methods": methods, "meta": {}}))
    return folder


def test_check_bench_allows_near_ties_only(tmp_path):
    check = gpu_check.check_bench(_summary(tmp_path / "a", head_mismatches=1, near_ties=1))
    assert check["ok"] and check["methods"]["head"]["tau"] == 1.235
    assert "requests" not in check["methods"]["plain"]
    assert not gpu_check.check_bench(_summary(tmp_path / "b", 2, 1))["ok"]
    missing = gpu_check.check_bench(_summary(tmp_path / "c", 0, 0, with_head=False))
    assert not missing["ok"] and missing["problems"] == ["no 'head' method in summary.json"]


@pytest.mark.integration
def test_summary_tables_every_step_and_the_script_exits_on_failures(tmp_path):
    res = tmp_path / "res"
    res.mkdir()
    _summary(res / "bench_medusa", 0, 0)
    gpu_check.check_bench(res / "bench_medusa")
    steps = "env\tPASS\t1\t\nbench_medusa\tPASS\t30\t\nfsdp_eagle\tFAIL\t150\ttimed out\n"
    (res / "steps.tsv").write_text(steps)
    text, failed = gpu_check.summary(res)
    assert failed == ["fsdp_eagle"] and (res / "summary.md").read_text() == text
    assert "| fsdp_eagle | FAIL | 150 | timed out |" in text
    assert '| bench_medusa | PASS | 30 | {"methods":{"plain":{"tau":1.235' in text

    proc = _script("summary", str(res))
    assert proc.returncode == 1 and "| env | PASS | 1 |  |" in proc.stdout, proc.stderr
    proc = _script("check-bench", str(res / "bench_medusa"))
    assert proc.returncode == 0 and json.loads(proc.stdout)["ok"], proc.stderr
    proc = _script("check-bench")
    assert proc.returncode == 2 and "eval_dir" in proc.stderr


@pytest.mark.integration
def test_a_tiny_training_step_records_its_ranks_and_passes_its_check(tmp_path):
    """The `ddp_medusa` step of the CPU dry run, in one process: the character tokenizer, two
    training steps through train.run, then check-train through the script."""
    tok = tmp_path / "tokenizer"
    assert _script("tokenizer", str(tok)).returncode == 0
    run = tmp_path / "ddp_medusa"
    overrides = [
        "+experiment=medusa_tiny", f"model.tokenizer={tok}", "head.draft_vocab_size=64",
        "trainer.max_steps=2", "trainer.save_every=2", "trainer.eval_every=2",
        "trainer.batch_size=4", "evaluators=[]", "trainer.best_metric=null",
        "data.max_length=256", "data.sources.0.max_rows=24",
    ]  # fmt: skip
    record = gpu_check.train_and_record(run, overrides)
    assert record["distributed_type"] == "NO" and record["step"] == 2 and record["world"] == 1
    proc = _script("check-train", str(run), "NO")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["distributed_type"] == "NO"
