"""The scale study (lab/studies/scaling.py, scripts/scaling_study.py): the data a point trains
on, the plan, the results file and the report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from data.errors import ConfigError
from lab.studies import scaling, scaling_report

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "scaling_study.py"


def test_corpus_rows_are_shuffled_reproducibly_and_keep_every_row():
    rows = [{"source": "oasst", "i": i} for i in range(50)] + [
        {"source": "roleplay", "i": i} for i in range(50)
    ]
    once, again = scaling.shuffled(rows), scaling.shuffled(rows)
    assert once == again  # seeded
    assert sorted(map(repr, once)) == sorted(map(repr, rows))  # a permutation: nothing lost
    assert once != rows and scaling.shuffled(rows, seed=1) != once
    # a budget's prefix now samples both sources instead of only the first one written
    assert {r["source"] for r in once[:20]} == {"oasst", "roleplay"}
    assert rows[:3] == [{"source": "oasst", "i": i} for i in range(3)]  # input untouched


def test_cut_to_tokens_stops_at_the_budget():
    rows = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    ] * 10
    cut = scaling.cut_to_tokens(rows, 1)
    assert 1 <= len(cut) < len(rows)


def _point(method, kind, budget, tau, **extra):
    common = {"steps": 10, "val/head0/top1": 0.3, "train/head0/top1": 0.5, "train_wall_s": 60.0}
    return {"method": method, "kind": kind, "budget": budget, "tau_tree16": tau} | common | extra


def test_report_keeps_curves_of_each_data_kind_apart(tmp_path):
    results = {
        # the first study: synth points whose rate was kept once, in meta
        "meta": {"gen_tokens_per_s": 100.0},
        "meta_by_kind": {"corpus": {"gen_tokens_per_s": 300.0}},
        "points": {
            "m-synth-1000": _point("m", "synth", 1000, 1.3),
            "m-synth-4000": _point("m", "synth", 4000, 1.4),
            "m-corpus-1000": _point("m", "corpus", 1000, 1.5),
            "m-corpus-4000": _point("m", "corpus", 4000, 1.6, gen_tokens_per_s=400.0),
            "m-human-1000": _point("m", "human", 1000, 1.2),
            "m-corpus_prompts-1000": _point("m", "corpus_prompts", 1000, 1.45),
        },
    }
    pts = results["points"]
    assert [scaling_report.in_series(pts[k]) for k in pts] == [True, True, True, True, False, False]
    rates = {k: scaling_report.gen_rate(results, r) for k, r in pts.items()}
    assert rates == {
        "m-synth-1000": 100.0, "m-synth-4000": 100.0,  # the old meta
        "m-corpus-1000": 300.0,  # its kind's meta
        "m-corpus-4000": 400.0,  # its own rate wins
        "m-human-1000": None,  # human text is not generated
        "m-corpus_prompts-1000": 100.0,
    }  # fmt: skip
    scaling_report.render(results, tmp_path)
    table = (tmp_path / "scaling" / "table.md").read_text().splitlines()
    assert len(table) == 2 + len(pts)
    corpus_big = next(line for line in table if "| corpus | 4,000 |" in line)
    assert "| 1.600 |" in corpus_big and corpus_big.endswith("| 1.0 | 0.2 |")  # 4000/400/60
    assert (tmp_path / "scaling" / "scaling.png").stat().st_size > 10_000


def test_results_are_merged_with_what_another_run_wrote(tmp_path):
    f = tmp_path / "results.json"
    assert scaling.load_results(f) == {"points": {}}
    scaling.record(f, "a", {"tau_tree16": 1.5}, "synth", {"data": "x"})
    # another invocation, which loaded the file before "a" existed, records its own point
    scaling.record(f, "b", {"tau_tree16": 1.6}, "corpus", {"data": "y"})
    # and a later evaluation of "a" adds a tree without dropping what "a" had
    scaling.record(f, "a", {"tau_dynamic": 1.7}, "synth", {"data": "x"})
    got = scaling.load_results(f)
    assert got["points"] == {"a": {"tau_tree16": 1.5, "tau_dynamic": 1.7}, "b": {"tau_tree16": 1.6}}
    assert got["meta_by_kind"] == {"synth": {"data": "x"}, "corpus": {"data": "y"}}
    assert not list(tmp_path.glob("*.tmp"))


def test_eagle3_positions_are_its_unrolled_steps_not_a_repeat_of_the_first():
    eagle = {"val/head0/top1": 0.3, "val/step0/top1": 0.3, "val/step1/top1": 0.2,
             "val/step2/top1": 0.1, "val/loss": 9.0}  # fmt: skip
    assert scaling_report.first_three(eagle) == ["step0", "step1", "step2"]
    medusa = {"val/head0/top1": 0.3, "val/head1/top1": 0.2}
    assert scaling_report.first_three(medusa) == ["head0", "head1", "-"]


@pytest.mark.integration
def test_a_data_kind_may_not_take_a_comparison_name():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--kind", "human"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "names a --compare point" in proc.stderr
    with pytest.raises(ConfigError, match="unknown comparison 'nonsense'"):
        scaling.StudyConfig(kind="corpus", compare=["human", "nonsense=f.jsonl"], report_only=True)
    with pytest.raises(ConfigError, match="--data is required"):
        scaling.StudyConfig()
    cfg = scaling.StudyConfig(
        budgets=[1000], methods=["medusa_llama"], kind="corpus", compare=["human"], data=Path("x")
    )
    points = scaling.plan(cfg, have=5000)
    assert [p["kind"] for p in points] == ["corpus", "human"]
    assert [p["key"] for p in points] == ["medusa_llama-corpus-1000", "medusa_llama-human-1000"]


def _conversation(i: int) -> dict:
    return {
        "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]
    }


def test_a_budget_beyond_the_data_waits_and_the_held_out_set_is_cut_once(tmp_path, capsys):
    data = tmp_path / "sd.jsonl"
    data.write_text("".join(json.dumps(_conversation(i)) + "\n" for i in range(5)) + '{"messa')
    cfg = scaling.StudyConfig(
        data=data, budgets=[10**9], methods=["medusa_llama"], val_rows=2,
        out=tmp_path / "out", docs=tmp_path / "docs",
    )  # fmt: skip
    assert scaling.run_study(cfg) == {"points": {}}  # nothing trained: every point waits
    printed = capsys.readouterr().out
    assert "5 rows; training rows 3" in printed and "waiting for data" in printed
    val = (tmp_path / "out" / "val.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in val] == [_conversation(0), _conversation(1)]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["val.jsonl"]
    cfg.val_rows = 9  # the held-out file exists: it is kept, not cut again
    scaling.run_study(cfg)
    assert len((tmp_path / "out" / "val.jsonl").read_text().splitlines()) == 2
