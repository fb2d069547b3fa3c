"""The training loop on a tiny random Llama with a dummy head: optimisation, schedule,
accumulation, features, validation and tracking. Each test runs in well under a second."""

from __future__ import annotations

import dataclasses
import json
import math
import time

import pytest
import torch

from tests._dummy_head import (
    DummyHead,
    collate_with_ids,
    label_count,
    make_examples,
    make_target,
)
from train.config import TrainerConfig, resolve_mixed_precision
from train.loop import Trainer, batch_features, train
from train.optim import build_optimizer, build_scheduler, lr_multiplier
from train.tracking import LoggerConfig, Tracker, read_metrics


@pytest.fixture(scope="module")
def target():
    return make_target()


def config(**overrides) -> TrainerConfig:
    base = dict(lr=1e-2, batch_size=2, max_steps=2, log_every=1, progress=False, seed=0)
    return TrainerConfig(**{**base, **overrides})


def head_loss(head, target, examples) -> float:
    batch = collate_with_ids(examples)
    head.eval()
    with torch.no_grad():
        return float(head.loss(batch, batch_features(batch, target, None)).loss)


def test_one_step_lowers_loss_on_a_fixed_batch(target, tmp_path):
    examples = make_examples(4)
    head = DummyHead()
    before = head_loss(head, target, examples)
    cfg = config(batch_size=4, max_steps=1, max_grad_norm=0.0, lr=5e-2)
    result = train(head, target, examples, None, collate_with_ids, cfg, tmp_path)
    assert result.step == 1 and result.tokens == sum(len(e["input_ids"]) for e in examples)
    assert result.loss_tokens == sum(int(e["loss_mask"].sum()) for e in examples)
    assert head_loss(head, target, examples) < before
    assert (tmp_path / "head" / "model.safetensors").is_file()


def test_warmup_then_cosine_schedule():
    values = [lr_multiplier(s, warmup=2, total=10) for s in range(11)]
    assert values[:3] == [0.5, 1.0, 1.0]
    assert values[6] == pytest.approx(0.5)  # halfway through the 8 decay updates
    assert values[10] == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(values[1:], values[2:], strict=False))
    assert lr_multiplier(10, 2, 10, min_ratio=0.1) == pytest.approx(0.1)

    head = DummyHead()
    opt = build_optimizer(head, config(lr=1.0))
    sched = build_scheduler(opt, warmup=2, total=10, min_ratio=0.0)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.5, 1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 8))])


def test_weight_decay_skips_vectors():
    opt = build_optimizer(DummyHead(), config(weight_decay=0.1))
    decays = {tuple(p.shape): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert decays == {(128, 32): 0.1, (128,): 0.0}


def test_grad_accumulation_matches_a_big_batch(target, tmp_path):
    # equal lengths, so the mean of micro-batch means equals the mean over the big batch
    examples = make_examples(8, min_len=8, max_len=8)
    heads = []
    for name, bs, accum in (("big", 4, 1), ("accum", 2, 2)):
        head = DummyHead()
        cfg = config(batch_size=bs, grad_accum=accum, max_steps=2, warmup_steps=1)
        result = train(head, target, examples, None, collate_with_ids, cfg, tmp_path / name)
        assert result.step == 2 and result.tokens == 64
        heads.append(head)
    for a, b in zip(heads[0].parameters(), heads[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.equal(heads[0].proj.weight, DummyHead().proj.weight)


def test_batch_features_cached_or_online(target):
    batch = collate_with_ids(make_examples(2))
    online = batch_features(batch, target, None)
    assert online["hidden"].shape == (*batch["input_ids"].shape, 32)
    assert not online["hidden"].requires_grad
    cached = {**batch, "hidden": online["hidden"].half()}
    assert batch_features(cached, None, None)["hidden"] is cached["hidden"]
    with pytest.raises(ValueError, match="no target was given"):
        batch_features(batch, None, None)
    with pytest.raises(ValueError, match="rebuild the feature cache"):
        batch_features(cached, target, [0, 1])


def test_offline_features_train_like_online(target, tmp_path):
    examples = make_examples(4)
    cached = []
    for e in examples:  # what a feature cache stores: the target's hidden states per example
        feats = target.features(e["input_ids"][None], torch.ones_like(e["input_ids"])[None])
        cached.append({**e, "hidden": feats["hidden"][0]})
    heads = [DummyHead(), DummyHead()]
    cfg = config(batch_size=2, max_steps=2)
    train(heads[0], target, examples, None, collate_with_ids, cfg, tmp_path / "online")
    train(heads[1], None, cached, None, collate_with_ids, cfg, tmp_path / "offline")
    torch.testing.assert_close(heads[0].proj.weight, heads[1].proj.weight)


def test_validation_sums_stats_over_the_whole_split(target, tmp_path):
    train_set, val_set = make_examples(6), make_examples(5, seed=1)
    cfg = config(max_steps=3, eval_every=2, eval_batch_size=2)
    result = train(DummyHead(), target, train_set, val_set, collate_with_ids, cfg, tmp_path)
    total, count = result.val_totals["head0/top1"]
    assert count == label_count(val_set)
    assert result.val_metrics["val/head0/top1"] == total / count
    records = read_metrics(tmp_path)
    val_steps = [r["step"] for r in records if "val/loss" in r]
    assert val_steps == [2, 3]  # every eval_every steps, and once at the end
    train_records = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train_records] == [1, 2, 3]
    for key in ("train/lr", "train/tokens_per_s", "train/head0/top1", "train/grad_norm"):
        assert key in train_records[0]
    assert train_records[-1]["train/tokens"] == result.tokens


def test_epochs_decide_the_length_when_max_steps_is_zero(target, tmp_path):
    cfg = config(max_steps=0, num_epochs=2, batch_size=2, grad_accum=2)
    result = train(DummyHead(), target, make_examples(9), None, collate_with_ids, cfg, tmp_path)
    assert result.step == 4  # 9 // 2 = 4 batches per epoch (last one dropped), 2 per step
    assert (result.epoch, result.stopped_early) == (1, False)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(lr=0), "positive learning rate"),
        (dict(mixed_precision="fp8"), "mixed_precision"),
        (dict(warmup_steps=2, warmup_ratio=0.1), "not both"),
        (dict(grad_accum=0), "grad_accum"),
        (dict(resume="/no/such/checkpoint"), "resume="),
        (dict(max_steps=0, num_epochs=0), "how long to train"),
    ],
)
def test_config_errors_say_what_to_change(overrides, message):
    with pytest.raises(ValueError, match=message):
        TrainerConfig(**overrides)


def test_config_accepts_hydra_style_lists():
    cfg = TrainerConfig(betas=[0.8, 0.9], warmup_ratio=0.25)
    assert cfg.betas == (0.8, 0.9) and cfg.warmup_for(8) == 2


def test_too_little_data_is_an_error(target, tmp_path):
    with pytest.raises(ValueError, match="fewer than one global batch"):
        Trainer(
            DummyHead(),
            config(batch_size=8),
            tmp_path,
            train_dataset=make_examples(3),
            collate_fn=collate_with_ids,
            target=target,
        )


def test_mixed_precision_auto_is_off_without_cuda():
    expected = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    assert resolve_mixed_precision("auto") == expected
    assert resolve_mixed_precision("fp16") == "fp16"


@pytest.mark.parametrize("amx,avx512_bf16,expected", [
    (False, False, "no"), (True, False, "bf16"), (False, True, "bf16"),
])  # fmt: skip
def test_fast_bf16_follows_the_cpu(monkeypatch, amx, avx512_bf16, expected):
    """fast_bf16: bf16 autocast only where the CPU multiplies bf16 in hardware."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    assert resolve_mixed_precision("fast_bf16") == expected
    assert resolve_mixed_precision("auto") == "no"  # the default stays fp32 on every CPU


def test_tracker_writes_jsonl_on_main_only(tmp_path):
    with Tracker(LoggerConfig(mode="disabled"), tmp_path / "main") as main:
        main.log({"train/loss": torch.tensor(1.5)}, step=3)
        main.log({"train/loss": 1.0}, step=4)
        main.rewind(3)
    assert read_metrics(tmp_path / "main") == [{"step": 3, "train/loss": 1.5}]
    with Tracker(LoggerConfig(mode="disabled"), tmp_path / "other", is_main=False) as other:
        other.log({"x": 1}, step=1)
    assert not (tmp_path / "other").exists()
    with pytest.raises(ValueError, match="offline"):
        LoggerConfig(mode="dryrun")


def test_wandb_offline_writes_locally(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_env"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens there
    cfg = LoggerConfig(mode="offline", run_name="t", tags=["test"], dir=str(tmp_path / "wb"))
    folder = tmp_path / "art"
    folder.mkdir()
    (folder / "w.txt").write_text("x")
    with Tracker(cfg, tmp_path / "run") as tracker:
        tracker.log_config({"lr": 0.1, "nested": {"a": 1}})
        tracker.log({"train/loss": 2.0}, step=1)
        tracker.log_artifact(folder, name="head", metadata={"tau": 1.0})
        run_id = tracker.wandb_run.id
    assert (tmp_path / "run" / "wandb_run_id").read_text().strip() == run_id
    assert list((tmp_path / "wb" / "wandb").glob(f"offline-run-*-{run_id}"))
    assert read_metrics(tmp_path / "run") == [{"step": 1, "train/loss": 2.0}]


def test_wandb_offline_records_artifact_plots_and_report(tmp_path, monkeypatch):
    from PIL import Image

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens there
    Image.new("RGB", (8, 8), "red").save(tmp_path / "tau.png")
    (tmp_path / "report.md").write_text("# report\n")
    head = tmp_path / "best_head"
    head.mkdir()
    (head / "config.json").write_text("{}")
    cfg = LoggerConfig(mode="offline", dir=str(tmp_path / "wb"))
    with Tracker(cfg, tmp_path / "run") as tracker:
        tracker.log_artifact(head, name="eagle3-head", metadata={"tau": 1.5})
        tracker.log_files({"bench/tau": tmp_path / "tau.png", "report": tmp_path / "report.md"})
        run_id = tracker.wandb_run.id
    (run_dir,) = (tmp_path / "wb" / "wandb").glob(f"offline-run-*-{run_id}")
    # wandb's service process may still be flushing the offline records after finish() returns
    # (seen on a loaded machine: only the file header was there); wait for it, up to a minute
    deadline = time.monotonic() + 60
    while True:
        records = b"".join(p.read_bytes() for p in run_dir.glob("*.wandb"))
        if b"bench/tau" in records or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert b"eagle3-head" in records  # the artifact, by name
    assert b"bench/tau" in records  # the plot, logged as an image under its key
    assert (run_dir / "files" / "report.md").read_text() == "# report\n"


# ---- non-finite numbers stop the run; no NaN head is ever written ---------------------------


def overflowing_target(scale: float = 1e5):
    """make_target() whose hidden states (after the final norm too) pass float16's 65504."""
    target = make_target()
    with torch.no_grad():
        target.model.model.embed_tokens.weight.mul_(scale)
        target.model.model.norm.weight.mul_(scale)
    return target


def test_a_non_finite_loss_stops_the_run_and_saves_nothing(target, tmp_path):
    from data.errors import NonFiniteError

    examples = make_examples(4)
    cached = []
    for e in examples:
        hidden = torch.zeros(len(e["input_ids"]), 32)
        hidden[0, 0] = float("inf")  # what float16 features of a too-large activation hold
        cached.append({**e, "hidden": hidden})
    cfg = config(batch_size=2, max_steps=3, save_every=1)
    with pytest.raises(NonFiniteError, match=r"step 1: the gradient norm is (nan|inf).*bfloat16"):
        train(DummyHead(), None, cached, None, collate_with_ids, cfg, tmp_path)
    assert not (tmp_path / "head").exists() and not (tmp_path / "checkpoints").exists()

    class NaNLoss(DummyHead):  # a NaN loss whose gradients stay finite
        def loss(self, batch, features):
            out = super().loss(batch, features)
            out.loss = out.loss + float("nan")
            return out

    with pytest.raises(NonFiniteError, match=r"step 1: the loss is inf/NaN in 2 micro-batch"):
        train(NaNLoss(), target, examples, None, collate_with_ids,
              config(batch_size=1, grad_accum=2, max_steps=3), tmp_path)  # fmt: skip
    assert not (tmp_path / "head").exists()


def test_a_head_with_nan_weights_is_never_saved(tmp_path):
    from data.errors import NonFiniteError
    from heads.base import TargetInfo, save_head
    from train import checkpoint as ckpt

    @dataclasses.dataclass
    class Cfg:
        size: int = 2

    bad = {"w": torch.tensor([1.0, float("nan")])}
    with pytest.raises(NonFiniteError, match=r"refusing to save .*h: 1 tensor\(s\) hold inf/NaN"):
        save_head(tmp_path / "h", "dummy", Cfg(), TargetInfo(), bad)
    assert not (tmp_path / "h").exists()
    with pytest.raises(NonFiniteError):
        ckpt.save_checkpoint(tmp_path, ckpt.TrainState(step=1), bad, {}, {}, [])
    assert ckpt.list_checkpoints(tmp_path) == []
    head = DummyHead()
    with torch.no_grad():
        head.proj.bias[0] = float("inf")
    trainer = Trainer(head, config(), tmp_path, train_dataset=make_examples(2),
                      collate_fn=collate_with_ids)  # fmt: skip
    with pytest.raises(NonFiniteError, match="proj.bias"):
        trainer.save_head()
    assert not (tmp_path / "head").exists()


def test_float16_features_that_overflow_are_refused(tmp_path):
    from data.errors import FeatureRangeError
    from data.features import LazyFeatureDataset, compute_features

    target, examples = overflowing_target(), make_examples(3)
    peak = target.features(examples[0]["input_ids"][None], None)["hidden"].abs().max()
    assert peak > 65504  # the premise: float16 would store inf here
    lazy = LazyFeatureDataset(examples, target, dtype=torch.float16)
    with pytest.raises(FeatureRangeError, match="beyond float16's range.*feature_dtype=bfloat16"):
        lazy[0]
    with pytest.raises(FeatureRangeError, match="float16"):
        compute_features(examples, target, dtype=torch.float16, progress=False)
    safe = LazyFeatureDataset(examples, target, dtype=torch.bfloat16)[0]["hidden"]
    assert safe.dtype == torch.bfloat16 and bool(safe.isfinite().all())
    cfg = config(batch_size=1, max_steps=2)
    with pytest.raises(FeatureRangeError):
        train(DummyHead(), target, lazy, None, collate_with_ids, cfg, tmp_path)
    assert not (tmp_path / "head").exists()


# ---- a torn metrics.jsonl never blocks a resume ---------------------------------------------


def test_resume_survives_a_torn_metrics_line(target, tmp_path):
    base = dict(max_steps=4, save_every=2, batch_size=2, log_every=1)
    train(DummyHead(), target, make_examples(8), None, collate_with_ids,
          config(**base), tmp_path, callbacks=[lambda s: s.step == 2])  # fmt: skip
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "train/lo')  # the disk filled up mid-line
    result = train(DummyHead(), target, make_examples(8), None, collate_with_ids,
                   config(**base), tmp_path)  # fmt: skip
    assert result.step == 4
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == [1, 2, 3, 4]


def test_a_torn_last_line_is_cut_before_the_next_record(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "a": 1}\n{"step": 2, "a"')
    with Tracker(None, tmp_path, is_main=True) as tracker:
        tracker.log({"a": 3}, step=3)
    assert read_metrics(tmp_path) == [{"step": 1, "a": 1}, {"step": 3, "a": 3}]
