"""Checkpoint-time evaluators: logged next to the losses, and the best-scoring head is kept."""

from __future__ import annotations

import json

import pytest
from _dummy_head import DummyHead, collate_with_ids, make_examples, make_target

from train.checkpoint.select import BestKeeper
from train.config import TrainerConfig
from train.loop import train


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
    assert json.loads((tmp_path / "best_head" / "best.json").read_text()) == record
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


class FileHead:
    """A stand-in head whose save_pretrained writes one small file."""

    def __init__(self, text: str = "weights") -> None:
        self.text = text

    def save_pretrained(self, path):
        (path / "w").write_text(self.text)


def test_a_damaged_best_json_is_rebuilt_from_best_head(tmp_path, caplog):
    keeper = BestKeeper(tmp_path, "eval/tau")
    assert keeper.update({"eval/tau": 2.5}, 4, FileHead())
    (tmp_path / "best.json").write_text('{"metric": "eval/ta')  # torn by a crash
    with caplog.at_level("WARNING", logger="train.checkpoint.select"):
        again = BestKeeper(tmp_path, "eval/tau")
    assert again.best == 2.5
    assert json.loads((tmp_path / "best.json").read_text())["step"] == 4
    assert any("rebuilt" in r.getMessage() for r in caplog.records)


def test_the_pointer_is_written_after_the_folder(tmp_path, monkeypatch):
    import train.checkpoint.select as selection

    keeper = BestKeeper(tmp_path, "eval/tau")
    keeper.update({"eval/tau": 1.0}, 1, FileHead("one"))
    real = selection.write_json_atomic

    def crash_on_pointer(path, doc):
        if path == tmp_path / "best.json":
            raise KeyboardInterrupt  # killed between the folder and the pointer
        real(path, doc)

    monkeypatch.setattr(selection, "write_json_atomic", crash_on_pointer)
    with pytest.raises(KeyboardInterrupt):
        keeper.update({"eval/tau": 3.0}, 2, FileHead("two"))
    monkeypatch.undo()
    assert (tmp_path / "best_head" / "w").read_text() == "two"  # the new folder is whole
    assert BestKeeper(tmp_path, "eval/tau").best == 3.0  # and the pointer is rebuilt from it
    assert json.loads((tmp_path / "best.json").read_text())["value"] == 3.0


def test_a_damaged_best_head_is_set_aside(tmp_path, caplog):
    keeper = BestKeeper(tmp_path, "eval/tau")
    keeper.update({"eval/tau": 2.0}, 3, FileHead())
    (tmp_path / "best_head" / "w").write_text("we")  # cut short
    with caplog.at_level("WARNING", logger="train.checkpoint.select"):
        again = BestKeeper(tmp_path, "eval/tau")
    assert again.best is None and not (tmp_path / "best.json").exists()
    assert (tmp_path / "best_head.damaged" / "w").is_file()
    assert any("best_head is damaged (w has 2 bytes" in r.getMessage() for r in caplog.records)
    assert again.update({"eval/tau": 0.5}, 5, FileHead())  # any value now makes a new best


def test_run_resumed_over_a_damaged_best_head_ends_with_a_sound_one(tmp_path):
    from train.rundir import check_kept_head, manifest_problems

    target, train_set = make_target(), make_examples(8)
    scripted = iter([1.0, 3.0, 2.0])

    def fit(stop_at=None):
        cfg = TrainerConfig(max_steps=6, batch_size=2, eval_every=2, save_every=2,
                            progress=False, best_metric="eval/tau", lr=1e-2)  # fmt: skip
        stop = [lambda s: s.step == stop_at] if stop_at else []
        return train(DummyHead(), target, train_set, None, collate_with_ids, cfg, tmp_path,
                     evaluators=[lambda h, t: {"tau": next(scripted)}], callbacks=stop)  # fmt: skip

    fit(stop_at=4)  # best_head holds the step-4 head (tau 3.0)
    weights = tmp_path / "best_head" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:30])
    fit()
    assert check_kept_head(tmp_path) == tmp_path / "best_head"
    assert manifest_problems(tmp_path / "best_head") == []
    assert json.loads((tmp_path / "best.json").read_text())["step"] == 6


def test_a_run_never_ends_on_a_damaged_kept_head(tmp_path):
    from train.rundir import RunDirError

    def damage_best(state):
        if state.step == 2:  # after the step-2 evaluation saved best_head
            (tmp_path / "best_head" / "model.safetensors").write_bytes(b"x")

    cfg = TrainerConfig(max_steps=2, batch_size=2, eval_every=2, progress=False,
                        best_metric="val/loss", best_mode="min", lr=1e-2)  # fmt: skip
    with pytest.raises(RunDirError, match="best_head is damaged"):
        train(DummyHead(), make_target(), make_examples(4), make_examples(2, seed=1),
              collate_with_ids, cfg, tmp_path, callbacks=[damage_best])  # fmt: skip
