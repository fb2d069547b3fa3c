"""The engine-ceiling arithmetic and the fastest-plain selection, without llama.cpp processes
(the runs themselves: tests/test_llama_cpp.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from data.engines.llama_cpp import EngineError
from data.engines.llama_tools import CostCurve, parse_llama_bench
from eval.bench.engine_ceiling import (
    CeilingSettings,
    ServerStats,
    break_even_tau,
    chain_model,
    fit_step_cost,
    predicted_speedup,
    verify_only_break_even,
)


def _bench_test(n_prompt: int, avg_ms: float, n_gen: int = 0, depth: int = 256, threads: int = 2):
    """One object as llama-bench -o json prints it (a subset of its fields)."""
    return {
        "build_number": 11434, "cpu_info": "AMD EPYC", "model_type": "llama ?B Q4_0",
        "model_size": 91000000, "n_threads": threads, "type_k": "f16", "n_prompt": n_prompt,
        "n_gen": n_gen, "n_depth": depth, "avg_ns": int(avg_ms * 1e6), "stddev_ns": 120000,
        "avg_ts": 1000 * n_prompt / avg_ms, "samples_ns": [int(avg_ms * 1e6)] * 3,
    }  # fmt: skip


def test_llama_bench_json_becomes_a_cost_curve():
    text = json.dumps([_bench_test(1, 8.0), _bench_test(4, 14.4), _bench_test(0, 9.0, n_gen=16)])
    curve = parse_llama_bench(text)
    assert curve.ms == {1: 8.0, 4: 14.4}  # the generation test is not a verify batch
    assert curve.depth == 256 and curve.threads == 2
    assert curve.relative()[4] == pytest.approx(1.8)
    assert curve.info["cpu_info"] == "AMD EPYC" and curve.stddev_ms[1] == pytest.approx(0.12)
    # linear in between, the last slope beyond, the first value below
    assert curve.at(2) == pytest.approx(8.0 + (14.4 - 8.0) / 3)
    assert curve.at(8) == pytest.approx(14.4 + 4 * (14.4 - 8.0) / 3)
    assert curve.at(0) == 8.0
    with pytest.raises(EngineError, match="mix depths"):
        parse_llama_bench(json.dumps([_bench_test(1, 8.0), _bench_test(2, 9.0, depth=0)]))
    with pytest.raises(EngineError, match="-o json"):
        parse_llama_bench("| model | size |")
    with pytest.raises(EngineError, match="no prompt tests"):
        parse_llama_bench(json.dumps([_bench_test(0, 9.0, n_gen=16)]))


def test_step_cost_fit_and_break_even():
    # a step costs 20 ms plus 1 ms per accepted token; plain decoding 10 ms a token
    points = [(1.6, 21.6), (2.0, 22.0), (2.7, 22.7)]
    a, b = fit_step_cost(points)
    assert (a, b) == (pytest.approx(20.0), pytest.approx(1.0))
    tau = break_even_tau(a, b, 10.0)
    assert tau == pytest.approx(20.0 / 9.0)
    assert predicted_speedup(tau, a, b, 10.0) == pytest.approx(1.0)
    assert predicted_speedup(4.0, a, b, 10.0) == pytest.approx(40.0 / 24.0)
    assert break_even_tau(30.0, 12.0, 10.0) == math.inf  # each token costs more than plain's
    assert fit_step_cost([(1.6, 21.0)]) == (21.0, 0.0)  # one point: a flat cost
    curve = CostCurve({1: 10.0, 4: 18.0}, {}, 256, 2, {})
    assert verify_only_break_even(curve, 3) == pytest.approx(1.8)


def test_chain_model_gives_break_even_per_chain_length():
    plain = ServerStats(requests=2, tokens=202, decode_ms=2000.0, accepted=0)  # 10 ms/token
    assert plain.tokens_per_s == pytest.approx(100.0) and plain.tau == 1.0

    def run(tokens_per_step: float, step_ms: float) -> ServerStats:
        steps = 100
        accepted = round(steps * (tokens_per_step - 1))
        return ServerStats(2, 2 + steps + accepted, steps * step_ms, accepted)

    forced = [
        {"rates": [0.6], "stats": run(1.6, 14.0)},
        {"rates": [0.55, 0.3, 0.15], "stats": run(2.0, 22.0)},
        {"rates": [1.0, 1.0, 1.0], "stats": run(4.0, 24.0)},
    ]
    curve = CostCurve({1: 9.0, 2: 11.0, 4: 16.0}, {}, 256, 2, {})
    model = chain_model(forced, plain, curve)
    assert set(model) == {"1", "3"}
    three = model["3"]
    assert three["step_ms_fit"]["a"] == pytest.approx(20.0)
    assert three["step_ms_fit"]["b"] == pytest.approx(1.0)
    assert three["break_even_tau"] == pytest.approx(20.0 / 9.0)
    assert three["break_even_tau_verify_only"] == pytest.approx(16.0 / 9.0)
    assert [r["speedup"] for r in three["runs"]] == pytest.approx([2.0 * 10 / 22, 4.0 * 10 / 24])
    assert model["1"]["break_even_tau"] == pytest.approx(1.4)  # 14 ms a step, flat


def test_settings_refuse_rates_llama_server_would_refuse():
    with pytest.raises(ValueError, match="non-increasing"):
        CeilingSettings(rates=[[0.3, 0.5]])
    with pytest.raises(ValueError, match="non-increasing"):
        CeilingSettings(rates=[[1.2]])
    with pytest.raises(ValueError, match="include 1"):
        CeilingSettings(batches=[2, 4])


def _method(tokens_per_s: float | None, categories: dict | None = None) -> dict:
    overall = {"tokens_per_s": tokens_per_s, "speedup_vs_plain": None}
    cats = {c: {"tokens_per_s": v, "speedup_vs_plain": None} for c, v in (categories or {}).items()}
    return {"overall": overall, "categories": cats}


def test_fastest_plain_is_the_quickest_plain_llama_cpp_type():
    from eval.bench.llama_cpp_targets import add_fastest_plain, fastest_plain, fastest_plain_lines

    methods = {
        "plain": _method(300.0),  # the HF harness: not a llama.cpp type
        "llama_cpp_plain@auto": _method(80.0, {"coding": 70.0}),
        "llama_cpp_plain@q4_0": _method(100.0, {"coding": 90.0}),
        "llama_cpp_plain@f32": _method(50.0, {"coding": 45.0}),
        "llama_cpp_draft@f32": _method(75.0, {"coding": 45.0}),
        "llama_cpp_draft@q4_0": _method(None),
    }
    assert fastest_plain(methods) == "llama_cpp_plain@q4_0"
    meta = {"llama_cpp": {"resolved_types": {"auto": "q4_1", "q4_0": "q4_0", "f32": "f32"}}}
    summary = {"meta": meta, "definitions": {}, "methods": methods}
    add_fastest_plain(summary)
    assert summary["meta"]["fastest_plain"] == {
        "method": "llama_cpp_plain@q4_0", "type": "q4_0", "tokens_per_s": 100.0
    }  # fmt: skip
    draft = methods["llama_cpp_draft@f32"]
    assert draft["overall"]["speedup_vs_fastest_plain"] == pytest.approx(0.75)
    assert draft["categories"]["coding"]["speedup_vs_fastest_plain"] == pytest.approx(0.5)
    assert methods["llama_cpp_draft@q4_0"]["overall"]["speedup_vs_fastest_plain"] is None
    assert "speedup_vs_fastest_plain" not in methods["plain"]["overall"]
    assert "speedup_vs_fastest_plain" in summary["definitions"]
    text = "\n".join(fastest_plain_lines(summary))
    assert "`llama_cpp_plain@q4_0` (GGUF type q4_0" in text and "| llama_cpp_draft@f32 |" in text
    # no plain llama.cpp method: nothing is added
    bare = {"meta": {}, "definitions": {}, "methods": {"plain": _method(3.0)}}
    add_fastest_plain(bare)
    assert "fastest_plain" not in bare["meta"] and fastest_plain_lines(bare) == []


def test_several_target_types_make_typed_methods_with_their_own_baselines(tmp_path):
    from eval.bench.llama_cpp import LlamaCppSettings, build_llama_cpp_methods

    files = {}
    for label in ("q4_0", "f32"):
        files[label] = tmp_path / f"{label}.gguf"
        files[label].write_bytes(b"GGUF")
    draft = tmp_path / "draft.gguf"
    draft.write_bytes(b"GGUF")
    settings = LlamaCppSettings(
        target_gguf={k: str(v) for k, v in files.items()},
        draft_gguf=str(draft),
        spec_type="draft-eagle3",
    )
    methods = build_llama_cpp_methods(["llama_cpp_plain", "llama_cpp_draft"], settings)
    assert [m.name for m in methods] == [
        "llama_cpp_plain@q4_0", "llama_cpp_draft@q4_0", "llama_cpp_plain@f32", "llama_cpp_draft@f32"
    ]  # fmt: skip
    assert methods[1].baseline == "llama_cpp_plain@q4_0" and methods[1].config.model == str(
        files["q4_0"]
    )
    assert methods[3].baseline == "llama_cpp_plain@f32" and methods[0].baseline is None
    one = LlamaCppSettings(target_gguf=str(files["f32"]), draft_gguf=str(draft))
    one.spec_type = "draft-eagle3"
    names = [m.name for m in build_llama_cpp_methods(["llama_cpp_draft"], one)]
    assert names == ["llama_cpp_draft"]


def test_target_choices_resolve_to_labelled_files(monkeypatch):
    import heads.interop.gguf as gguf_mod
    from eval.bench.llama_cpp_targets import resolve_target_ggufs

    def fake(cfg, choice):  # each setting is parsed once into a TargetGGUF before the lookup
        name = choice.outtype if not choice.own else "auto"
        return Path(f"/c/{name}.gguf")

    monkeypatch.setattr(gguf_mod, "gguf_for_target", fake)
    monkeypatch.setattr(gguf_mod, "gguf_type_name", lambda p: Path(p).stem.replace("auto", "q4_1"))
    paths, types = resolve_target_ggufs(object(), ["q4_0", "auto"])
    assert paths == {"q4_0": "/c/q4_0.gguf", "auto": "/c/auto.gguf"}
    assert types == {"q4_0": "q4_0", "auto": "q4_1"}
    assert resolve_target_ggufs(object(), "f32") == ("/c/f32.gguf", {"": "f32"})
    with pytest.raises(ValueError, match="twice"):
        resolve_target_ggufs(object(), ["q4_0", "q4_0"])


def test_best_draft_length_reads_a_measured_verify_curve():
    from eval.bench.llama_cpp import best_draft_length, draft_length_limits

    at_least = [0.7, 0.5, 0.3, 0.1]
    # a flat curve up to 4 tokens (the multi-token matmul path): draft 3, even 1 pays
    flat = {1: 10.0, 2: 10.5, 4: 11.0, 8: 20.0}
    k, speed = best_draft_length(at_least, verify_ms=flat, draft_ms_per_token=0.5)
    assert k == 3 and speed[3] == pytest.approx(1000 * 2.5 / (11.0 + 1.5))
    assert draft_length_limits(speed) == (3, 1)
    # a row-by-row type (cost grows with every token): drafting never pays
    steep = {1: 10.0, 2: 18.0, 4: 34.0}
    k, speed = best_draft_length(at_least, verify_ms=steep, draft_ms_per_token=0.5)
    assert k == 0 and draft_length_limits(speed) == (0, 0)
    # the first drafted token is dear, the next ones cheap: a draft cut to one token by p-min
    # is slower than a plain step, so n-min is 2
    k, speed = best_draft_length([0.3, 0.3, 0.3], verify_ms={1: 10.0, 2: 14.0, 4: 15.0})
    assert draft_length_limits(speed) == (3, 2)
    # the server's per-step overhead counts in every step, the plain one included
    _, dearer = best_draft_length([0.3], verify_ms={1: 10.0, 2: 14.0}, overhead_ms=2.0)
    assert dearer == pytest.approx({0: 1000 / 12.0, 1: 1300 / 16.0})
    with pytest.raises(ValueError, match="exactly one"):
        best_draft_length(at_least)


def test_gguf_type_name_reads_the_file_type(tmp_path):
    import gguf
    import numpy as np

    from heads.interop.gguf import gguf_type_name

    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_K_M))
    writer.add_tensor("x", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_type_name(path) == "q4_k_m"


def test_ceiling_report_renders_every_table_and_plot(tmp_path):
    from eval.bench.engine_ceiling_report import render, write

    plain = ServerStats(2, 202, 2000.0, 0).to_json() | {"speedup_vs_fastest_plain": 1.0}
    run = {"rates": [1.0], "forced_tau": 2.0, "tau": 2.0, "speedup": 1.5,
           "speedup_vs_fastest_plain": 1.5}  # fmt: skip
    entry = {
        "gguf_type": "q4_0",
        "verify_curve": CostCurve({1: 8.0, 4: 12.0}, {}, 256, 1, {}).to_json(),
        "plain": plain,
        "chains": {"1": {"step_ms_fit": {"a": 13.0, "b": 0.0}, "break_even_tau": None,
                         "break_even_tau_verify_only": 1.2, "runs": [run]}},
        "own": {"chain": 1, "tau": 1.1, "tokens_per_s": 60.0, "speedup": 0.6,
                "speedup_vs_fastest_plain": 0.6, "predicted_speedup": 0.62,
                "draft_length": {"n_max": 0, "n_min": 0}},
    }  # fmt: skip
    summary = {
        "command": "python scripts/engine_ceiling.py --types q4_0",
        "full_command": "python scripts/engine_ceiling.py --threads 2",
        "machine": {"cpu_model": "AMD EPYC", "logical_cpus": 2, "amx": False,
                    "avx512_bf16": False},
        "target": "smollm2_135m",
        "settings": CeilingSettings(types=["q4_0"], batches=[1, 4], rates=[[1.0]]).__dict__,
        "fastest_plain": {"type": "q4_0", "gguf_type": "q4_0", "tokens_per_s": 100.0},
        "types": {"q4_0": entry},
    }  # fmt: skip
    text = render(summary, ["verify_cost.png"])
    assert "AMX: no" in text and "**q4_0**" in text and "| q4_0 (q4_0) | 8.0 ms | 1.50x |" in text
    assert "1.50x (1.50x)" in text and "never" in text and "0 / 0" in text
    assert "python scripts/engine_ceiling.py --threads 2" in text
    report = write(summary, tmp_path / "out")
    assert report.is_file() and (tmp_path / "out/verify_cost.png").stat().st_size > 1000
    assert json.loads((tmp_path / "out/summary.json").read_text())["types"]["q4_0"]["own"]


def test_draft_length_script_prices_lengths_on_a_ceiling_curve(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "draft_length", Path(__file__).resolve().parents[1] / "scripts/draft_length.py"
    )
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    run, ceiling = tmp_path / "run", tmp_path / "ceiling"
    run.mkdir()
    ceiling.mkdir()
    metrics = {"seconds": 1.0, "target_forwards": 100, "accept_rate_by_depth": [0.7, 0.5, 0.3]}
    methods = {"llama_cpp_plain": {"overall": metrics}, "llama_cpp_draft": {"overall": metrics}}
    (run / "summary.json").write_text(json.dumps({"methods": methods}))
    entry = {"verify_curve": {"ms": {"1": 10.0, "2": 10.5, "4": 11.0, "8": 20.0}},
             "own": {"draft_length": {"draft_ms_per_token": 0.5, "overhead_ms": 0.0}}}  # fmt: skip
    (ceiling / "summary.json").write_text(json.dumps({"types": {"q4_0": entry}}))
    assert cli.main([str(run), "--ceiling", str(ceiling), "--type", "q4_0"]) == 0
    out = capsys.readouterr().out
    assert "--spec-draft-n-max: 3, --spec-draft-n-min: 1" in out
    with pytest.raises(SystemExit, match="measured"):
        cli.main([str(run), "--ceiling", str(ceiling), "--type", "bf16"])


def test_step_costs_from_a_benchmark_and_from_a_ceiling_run():
    from data.errors import ConfigError
    from eval.bench.engine_ceiling import ceiling_costs
    from eval.bench.llama_cpp import measured_step_costs, ms_per_step

    assert ms_per_step({"seconds": 2.0, "target_forwards": 100}) == 20.0
    assert ms_per_step({"seconds": 0.5, "target_forwards": 0}) == 500.0  # no step: one
    plain = {"seconds": 1.0, "target_forwards": 100}
    draft = {"seconds": 1.5, "target_forwards": 50, "accept_rate_by_depth": [0.6, None, 0.1]}
    assert measured_step_costs(plain, draft) == ([0.6, 0.0, 0.1], {0: 10.0, 3: 30.0})
    entry = {"verify_curve": {"ms": {"1": 10.0, "4": 12.0}},
             "own": {"draft_length": {"draft_ms_per_token": 0.5, "overhead_ms": 1.5}}}  # fmt: skip
    summary = {"types": {"q4_0": entry, "f32": {"verify_curve": {"ms": {"1": 30.0}}, "own": None}}}
    assert ceiling_costs(summary, "q4_0") == {
        "verify_ms": {1: 10.0, 4: 12.0}, "draft_ms_per_token": 0.5, "overhead_ms": 1.5
    }  # fmt: skip
    no_own_run = ceiling_costs(summary, "f32")
    assert no_own_run["draft_ms_per_token"] == 0.0 and no_own_run["overhead_ms"] == 0.0
    with pytest.raises(
        ConfigError, match=r"--type bf16: the ceiling run measured \['f32', 'q4_0'\]"
    ):
        ceiling_costs(summary, "bf16")


def test_draft_length_script_prices_lengths_on_the_benchmark_itself(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "draft_length", Path(__file__).resolve().parents[1] / "scripts/draft_length.py"
    )
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    plain = {"seconds": 1.0, "target_forwards": 100}
    draft = {"seconds": 1.2, "target_forwards": 100, "accept_rate_by_depth": [0.9, 0.8]}
    methods = {"llama_cpp_plain": {"overall": plain}, "llama_cpp_draft": {"overall": draft}}
    (tmp_path / "summary.json").write_text(json.dumps({"methods": methods}))
    assert cli.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "per-position acceptance [0.9, 0.8]; ms per step: plain 10.0, draft of 2 12.0" in out
    assert "  draft 2: expected 225.0 tokens/s  <- best" in out
    assert "best --spec-draft-n-max: 2, --spec-draft-n-min: 1" in out
    del methods["llama_cpp_draft"]
    (tmp_path / "summary.json").write_text(json.dumps({"methods": methods}))
    assert cli.main([str(tmp_path)]) == 1
    assert "the run has no ['llama_cpp_draft']" in capsys.readouterr().err


def test_settings_from_the_command_lines_spelling(monkeypatch):
    from eval.bench.engine_ceiling import ceiling_target

    settings = CeilingSettings.from_text("q4_0,,f32", "1, 4,", "0.6;0.5,0.25;", threads=1)
    assert settings.types == ["q4_0", "f32"] and settings.batches == [1, 4]
    assert settings.rates == [[0.6], [0.5, 0.25]] and settings.threads == 1
    with pytest.raises(ValueError, match="non-increasing"):
        CeilingSettings.from_text("q4_0", "1", "0.2,0.5")
    with pytest.raises(ValueError):  # not a number
        CeilingSettings.from_text("q4_0", "1,x", "0.5")
    monkeypatch.setenv("DRAFTSMITH_CACHE", "/tmp/cache-here")
    cfg = ceiling_target("smollm2_135m")
    assert (cfg.name_or_path, cfg.cache_dir) == ("smollm2_135m", "/tmp/cache-here")


def test_engine_ceiling_script_runs_the_study_and_writes_the_report(tmp_path, monkeypatch, capsys):
    import importlib.util

    from eval.bench import engine_ceiling, engine_ceiling_report

    spec = importlib.util.spec_from_file_location(
        "engine_ceiling_cli", Path(__file__).resolve().parents[1] / "scripts/engine_ceiling.py"
    )
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    seen = {}

    def fake_run(settings, model_cfg, command):
        seen.update(settings=settings, model=model_cfg.name_or_path, command=command)
        return {"types": {}}

    def fake_write(summary, out):
        seen["summary"] = summary
        return out / "report.md"

    monkeypatch.setattr(engine_ceiling, "run_ceiling", fake_run)
    monkeypatch.setattr(engine_ceiling_report, "write", fake_write)
    out = tmp_path / "ceiling"
    args = ["--types", "q4_0", "--batches", "1,2", "--rates", "1,1", "--out", str(out)]
    assert cli.main([*args, "--draft", "d.gguf"]) == 0
    assert capsys.readouterr().out == f"wrote {out / 'report.md'}\n"
    assert seen["settings"] == CeilingSettings(
        types=["q4_0"], batches=[1, 2], rates=[[1.0, 1.0]], draft_gguf="d.gguf"
    )
    assert seen["model"] == "smollm2_135m" and seen["command"].startswith(
        "python scripts/engine_ceiling.py --types q4_0 --batches 1,2"
    )
    assert seen["summary"]["full_command"] == engine_ceiling.FULL_COMMAND.format(draft="d.gguf")
    assert "--draft d.gguf --threads 2" in seen["summary"]["full_command"]
    assert cli.main([*args, "--batches", "2,4"]) == 1  # no batch of 1: refused in one line
    err = capsys.readouterr().err
    assert err.startswith("engine_ceiling failed: batches=[2, 4]") and err.count("\n") == 1
