"""Checkpoint-time evaluators: logged next to the losses, and the best-scoring head is kept."""

from __future__ import annotations

import json

from _dummy_head import DummyHead, collate_with_ids, make_examples, make_target

from train.config import TrainerConfig
from train.loop import train
from train.selection import BestKeeper


def test_best_keeper_keeps_the_best_value(tmp_path):
    saved = []

    class Head:
        def save_pretrained(self, path):
            saved.append(path)
            (path / "w").write_text("x")

    keeper = BestKeeper(tmp_path, "eval/tau", "max")
    assert keeper.update({"eval/tau": 1.5}, 1, Head())
    assert not keeper.update({"eval/tau": 1.2}, 2, Head())
    assert keeper.update({"eval/tau": 2.0}, 3, Head())
    assert not keeper.update({"val/loss": 0.1}, 4, Head())
    record = json.loads((tmp_path / "best.json").read_text())
    assert record == {"metric": "eval/tau", "value": 2.0, "step": 3}
    assert len(saved) == 2 and (tmp_path / "best_head" / "w").is_file()
    assert BestKeeper(tmp_path, "eval/tau").best == 2.0  # survives a restart
    low = BestKeeper(tmp_path / "min", "val/loss", "min")
    assert low.update({"val/loss": 2.0}, 1, Head()) and low.update({"val/loss": 1.0}, 2, Head())


def test_loop_runs_evaluators_and_keeps_best_head(tmp_path):
    scripted = iter([1.0, 3.0, 2.0])
    seen = []

    def evaluator(head, target):
        seen.append(type(head).__name__)
        return {"tau": next(scripted)}

    target = make_target()
    head = DummyHead()
    cfg = TrainerConfig(
        max_steps=6, batch_size=2, eval_every=2, progress=False, best_metric="eval/tau", lr=1e-2
    )
    train_set, val_set = make_examples(8), make_examples(2, seed=1)
    result = train(
        head, target, train_set, val_set, collate_with_ids, cfg, tmp_path, evaluators=[evaluator]
    )
    assert len(seen) == 3  # steps 2, 4, 6 (the final validation is the step-6 one)
    assert result.val_metrics["eval/tau"] == 2.0
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    taus = [(x["step"], x["eval/tau"]) for x in lines if "eval/tau" in x]
    assert taus == [(2, 1.0), (4, 3.0), (6, 2.0)]
    assert json.loads((tmp_path / "best.json").read_text())["step"] == 4
    assert (tmp_path / "best_head").is_dir()
