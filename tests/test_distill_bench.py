"""lab/distill_bench.py (scripts/bench_distill.py): the settings it runs and the numbers it
reports, with distill itself stood in for (no generation, no llama-server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab import distill_bench
from lab.distill_bench import bench_distill, bench_settings, summary_rows


def test_settings_run_hf_dtypes_then_each_gguf_at_each_slot_count():
    names = [s[0] for s in bench_settings([1, 8], [None], [4], ["own.gguf"])]
    assert names == ["hf-1", "hf-8", "llama_cpp-4"]
    settings = bench_settings([8], ["float32", "bfloat16"], [8, 32], ["a/Q4_1.gguf", "b/f32.gguf"])
    assert [s[0] for s in settings] == [
        "hf-float32-8", "hf-bfloat16-8", "Q4_1-8", "Q4_1-32", "f32-8", "f32-32",
    ]  # fmt: skip
    assert settings[0][1:] == ("hf", 8, {"batch_size": 8, "dtype": "float32"})
    engine = {"backend": "llama_cpp", "gguf": "a/Q4_1.gguf", "parallel": 8}
    assert settings[2][1:] == ("llama_cpp", 8, {"batch_size": 8, **engine})
    assert settings[3][3]["batch_size"] == 32  # at least 8 requests in flight, else the slots
    assert bench_settings([], [None], [], []) == []  # nothing asked, nothing run


def test_bench_compares_every_setting_with_the_first(monkeypatch):
    speeds = {"hf": 10.0, "llama_cpp": 25.0}
    seen = []

    def fake_distill(target, cfg, progress):
        assert target == "target" and progress is False and cfg.max_new_tokens == 5
        source = Path(cfg.prompts[0]["path"])  # the scratch prompts file
        prompts = [json.loads(line) for line in source.read_text().splitlines()]
        seen.append((cfg.backend, cfg.batch_size, [p["prompt"] for p in prompts]))
        differs = cfg.backend == "llama_cpp"  # quantised kernels: the second answer differs
        rows = [{"id": p["id"], "messages": [{"role": "assistant",
                 "content": f"{p['prompt']}!" + ("?" if differs and p["id"] == 1 else "")}]}
                for p in prompts]  # fmt: skip
        Path(cfg.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return {"new_tokens": 50, "seconds": 2.0, "tokens_per_s": speeds[cfg.backend]}

    monkeypatch.setattr(distill_bench, "distill", fake_distill)
    prompts = [{"turns": ["hi", "more"]}, {"turns": ["bye"]}]
    settings = bench_settings([8], [None], [4], ["own.gguf"])
    lines = []
    results = bench_distill("target", prompts, settings, 5, log=lines.append)
    assert seen == [("hf", 8, ["hi", "bye"]), ("llama_cpp", 8, ["hi", "bye"])]  # first turns
    assert [r["same_as_first"] for r in results] == [2, 1]
    assert [r["ratio_to_first"] for r in results] == [1.0, 2.5]
    assert results[1]["gguf"] == "own.gguf" and results[0]["dtype"] is None
    assert lines[1].startswith("llama_cpp-4 ") and "25.0 tokens/s; 1/2 answers equal" in lines[1]
    assert summary_rows(results) == [
        ("hf", None, None, 8, 10.0, 1.0), ("llama_cpp", "own", None, 4, 25.0, 2.5)
    ]  # fmt: skip


def test_a_zero_speed_first_setting_gives_no_ratios(monkeypatch):
    def fake_distill(target, cfg, progress):
        Path(cfg.out).write_text("")
        return {"new_tokens": 0, "seconds": 0.0, "tokens_per_s": 0.0}

    monkeypatch.setattr(distill_bench, "distill", fake_distill)
    results = bench_distill(None, [{"turns": ["x"]}], bench_settings([1], [None], [], []), 1,
                            log=lambda line: None)  # fmt: skip
    assert results[0]["ratio_to_first"] is None
    with pytest.raises(TypeError):  # summary_rows needs ratios
        summary_rows(results)
