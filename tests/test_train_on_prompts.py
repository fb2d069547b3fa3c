"""data.train_on_prompts: every token after a conversation's first is a training label, the
validation split keeps answer tokens only, and the cached features are shared."""

from __future__ import annotations

import json

import torch

import train.run as run_module

ORIGINAL_TRAIN = run_module.train  # each run below wraps this one, never an earlier spy


def test_every_token_labelled_changes_only_the_mask():
    from data.dataset import EveryTokenLabelled, ExampleDataset

    example = {
        "input_ids": torch.arange(6),
        "loss_mask": torch.tensor([0, 0, 0, 1, 1, 0]),
        "hidden": torch.randn(6, 4),
    }
    base = ExampleDataset([example])
    wrapped = EveryTokenLabelled(base)
    out = wrapped[0]
    assert len(wrapped) == 1
    assert out["loss_mask"].tolist() == [0, 1, 1, 1, 1, 1]
    assert out["loss_mask"].dtype == example["loss_mask"].dtype
    assert out["hidden"] is example["hidden"] and out["input_ids"] is example["input_ids"]
    assert base[0]["loss_mask"].tolist() == [0, 0, 0, 1, 1, 0]  # the base is not modified


def _labels_seen(monkeypatch, tmp_path, extra):
    """Run eagle3_tiny for two steps; return (the loss tokens the trainer counted, the loss-mask
    totals of the training and the validation datasets the trainer was given)."""
    from tests.test_experiments import _compose

    seen = {}
    real_train = ORIGINAL_TRAIN

    def spy(head, target, train_set, val_set, *args, **kwargs):
        seen["train"] = sum(int(train_set[i]["loss_mask"].sum()) for i in range(len(train_set)))
        seen["val"] = sum(int(val_set[i]["loss_mask"].sum()) for i in range(len(val_set)))
        return real_train(head, target, train_set, val_set, *args, **kwargs)

    monkeypatch.setattr(run_module, "train", spy)
    overrides = ["evaluators=[]", "trainer.best_metric=null", "trainer.log_every=1", *extra]
    result = run_module.run(_compose("eagle3_tiny", overrides), run_dir=tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    tokens = [r["train/loss_tokens"] for r in rows if "train/loss_tokens" in r][-1]  # running
    assert result.step == 2 and "val/step0/top1" in result.val_metrics
    return tokens, seen


def test_training_labels_grow_and_validation_keeps_answers(monkeypatch, tmp_path):
    answers, seen_answers = _labels_seen(monkeypatch, tmp_path / "a", [])
    every, seen_every = _labels_seen(monkeypatch, tmp_path / "b", ["data.train_on_prompts=true"])
    assert seen_every["val"] == seen_answers["val"] > 0
    assert seen_every["train"] > seen_answers["train"] > 0
    assert every > answers > 0  # the trainer counted the prompt labels too
