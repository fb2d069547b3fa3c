"""scripts/scaling_study.py: the data a comparison point trains on."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "scaling_study.py"


def _study():
    spec = importlib.util.spec_from_file_location("scaling_study", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_corpus_rows_are_shuffled_reproducibly_and_keep_every_row():
    study = _study()
    rows = [{"source": "oasst", "i": i} for i in range(50)] + [
        {"source": "roleplay", "i": i} for i in range(50)
    ]
    once, again = study.shuffled(rows), study.shuffled(rows)
    assert once == again  # seeded
    assert sorted(map(repr, once)) == sorted(map(repr, rows))  # a permutation: nothing lost
    assert once != rows and study.shuffled(rows, seed=1) != once
    # a budget's prefix now samples both sources instead of only the first one written
    assert {r["source"] for r in once[:20]} == {"oasst", "roleplay"}
    assert rows[:3] == [{"source": "oasst", "i": i} for i in range(3)]  # input untouched


def test_cut_to_tokens_stops_at_the_budget():
    study = _study()
    rows = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    ] * 10
    cut = study.cut_to_tokens(rows, 1)
    assert 1 <= len(cut) < len(rows)
