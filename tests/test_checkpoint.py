"""Checkpoints: atomic writes, keep-last-k, and resume that reproduces an uninterrupted run
bit for bit (weights, optimizer, scheduler, RNG and data position)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests._dummy_head import DummyHead, collate_with_ids, make_examples, make_target
from train import checkpoint as ckpt
from train.config import TrainerConfig
from train.loop import Trainer
from train.tracking import read_metrics

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def target():
    return make_target()


def run(target, run_dir, *, stop_at=None, head=None, examples=10, **overrides) -> tuple:
    """Train a dropout DummyHead with grad_accum 2 for up to 6 steps; returns (head, result).

    10 examples in micro-batches of 2 make 5 per epoch, so step 3 ends inside epoch 1 and the
    run crosses two epoch boundaries; dropout makes the result depend on the RNG state.
    """
    base = dict(
        lr=1e-2,
        warmup_steps=2,
        max_steps=6,
        batch_size=2,
        grad_accum=2,
        save_every=3,
        log_every=1,
        progress=False,
        seed=0,
    )
    cfg = TrainerConfig(**{**base, **overrides})
    head = head or DummyHead(dropout=0.1)
    trainer = Trainer(
        head,
        cfg,
        run_dir,
        train_dataset=make_examples(examples),
        collate_fn=collate_with_ids,
        target=target,
        val_dataset=make_examples(3, seed=1),
        callbacks=[lambda state: state.step == stop_at] if stop_at else (),
    )
    return head, trainer.fit()


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def train_losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r}


def test_resume_reproduces_the_uninterrupted_run_exactly(target, tmp_path):
    straight, full = run(target, tmp_path / "straight")
    _, first = run(target, tmp_path / "resumed", stop_at=3)
    assert first.stopped_early and first.step == 3 and first.head_dir is None
    assert ckpt.latest_checkpoint(tmp_path / "resumed").name == "step_3"
    state = json.loads((first.checkpoint / ckpt.STATE_FILE).read_text())
    assert (state["epoch"], state["batch_in_epoch"]) == (1, 1)  # 6 micro-batches, 5 per epoch

    resumed, second = run(target, tmp_path / "resumed", head=DummyHead(dropout=0.1, seed=99))
    assert second.step == 6 and not second.stopped_early
    assert_same_weights(straight, resumed)
    assert (second.tokens, second.loss_tokens) == (full.tokens, full.loss_tokens)
    assert second.val_metrics == full.val_metrics
    assert train_losses(tmp_path / "resumed") == train_losses(tmp_path / "straight")
    steps = [r["step"] for r in read_metrics(tmp_path / "resumed") if "train/loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]  # no step logged twice


def test_cpu_time_is_logged_and_carried_across_a_resume(target, tmp_path, monkeypatch):
    # a fake process clock that advances 0.5 s per reading: each step costs exactly 0.5 s
    ticks = iter(range(10_000))
    monkeypatch.setattr("train.loop.time.process_time", lambda: next(ticks) * 0.5)
    run(target, tmp_path / "resumed", stop_at=3)
    state = json.loads((ckpt.latest_checkpoint(tmp_path / "resumed") / ckpt.STATE_FILE).read_text())
    assert state["cpu_s"] == pytest.approx(1.5)
    run(target, tmp_path / "resumed")
    rows = read_metrics(tmp_path / "resumed")
    cpu = {r["step"]: r["train/cpu_min"] for r in rows if "train/cpu_min" in r}
    assert sorted(cpu) == [1, 2, 3, 4, 5, 6]
    assert [cpu[s] * 60 for s in sorted(cpu)] == pytest.approx([0.5, 1.0, 1.5, 2.0, 2.5, 3.0])


def test_resume_restores_the_rng(target, tmp_path, monkeypatch):
    # the same stop/resume without restoring RNG states must differ (dropout masks change),
    # which shows the exact-resume test really exercises the RNG path
    straight, _ = run(target, tmp_path / "straight")
    run(target, tmp_path / "resumed", stop_at=3)
    monkeypatch.setattr("train.checkpoint.run.restore_rng_state", lambda state: None)
    resumed, _ = run(target, tmp_path / "resumed")
    assert not torch.equal(straight.proj.weight, resumed.proj.weight)


def test_resume_ignores_a_checkpoint_left_half_written(target, tmp_path):
    straight, _ = run(target, tmp_path / "straight")
    run(target, tmp_path / "crashed", stop_at=3)
    root = ckpt.checkpoint_root(tmp_path / "crashed")
    tmp = root / ".step_6.tmp-crash"  # what a kill during the rename-less write leaves
    tmp.mkdir()
    (tmp / ckpt.HEAD_FILE).write_bytes(b"half a file")
    (tmp / ckpt.STATE_FILE).write_text(json.dumps({"step": 6}))
    (root / "step_9").mkdir()  # a copy without its state file is not complete either
    assert ckpt.latest_checkpoint(tmp_path / "crashed").name == "step_3"

    resumed, result = run(target, tmp_path / "crashed")
    assert result.step == 6
    assert_same_weights(straight, resumed)
    assert not tmp.exists()  # the next successful save cleared the leftover


def test_a_failed_write_leaves_no_checkpoint(tmp_path, monkeypatch):
    real_save = torch.save

    def failing_save(obj, path, *args, **kwargs):
        if Path(path).name == ckpt.SCHEDULER_FILE:
            raise OSError("disk full")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr("train.checkpoint.folder.torch.save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint(
            tmp_path,
            ckpt.TrainState(step=4),
            head={"w": torch.ones(2)},
            optimizer={},
            scheduler={},
            rng=[ckpt.capture_rng_state()],
        )
    assert list(ckpt.checkpoint_root(tmp_path).iterdir()) == []


def test_keep_last_prunes_old_checkpoints(target, tmp_path):
    _, result = run(target, tmp_path, max_steps=4, save_every=1, keep_last=2)
    assert [step for step, _ in ckpt.list_checkpoints(tmp_path)] == [3, 4]
    assert result.checkpoint == ckpt.checkpoint_root(tmp_path) / "step_4"
    files = sorted(p.name for p in result.checkpoint.iterdir())
    assert files == sorted(
        [ckpt.HEAD_FILE, ckpt.OPTIMIZER_FILE, ckpt.SCHEDULER_FILE, ckpt.RNG_FILE, ckpt.STATE_FILE]
        + [ckpt.RUN_FILE, ckpt.MANIFEST_FILE]
    )
    loaded = ckpt.load_checkpoint(result.checkpoint)
    assert loaded.state.step == 4 and len(loaded.rng) == 1
    assert set(loaded.head) == {"proj.weight", "proj.bias"}


def test_resume_modes(target, tmp_path):
    run(target, tmp_path / "a", stop_at=3)
    first = ckpt.checkpoint_root(tmp_path / "a") / "step_3"
    _, fresh = run(target, tmp_path / "a", resume="never", max_steps=2, save_every=0)
    assert fresh.tokens < 100 and fresh.step == 2  # started from step 0
    _, elsewhere = run(target, tmp_path / "b", resume=str(first))
    assert elsewhere.step == 6 and (tmp_path / "b" / "head").is_dir()
    # a finished run launched again does no more steps and keeps its checkpoint
    head, again = run(target, tmp_path / "b")
    assert again.step == 6 and again.checkpoint.name == "step_6"
    assert not again.stopped_early


def test_rng_state_round_trip(tmp_path):
    state = ckpt.capture_rng_state()
    draws = (random.random(), np.random.rand(), torch.rand(1))
    torch.save([state], tmp_path / "rng.pt")
    ckpt.restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True)[0])
    assert (random.random(), np.random.rand(), torch.rand(1)) == draws


@pytest.mark.integration
def test_killed_process_resumes_to_the_same_weights(target, tmp_path):
    """A real crash: a subprocess dies (os._exit) while writing the step-4 checkpoint."""
    args = ["--max-steps", "6", "--save-every", "2", "--grad-accum", "2", "--dropout", "0.1"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(REPO / "tests" / "_mp_script.py"), "--run-dir", str(tmp_path)]
    proc = subprocess.run(
        [*cmd, *args, "--crash-in-save", "4"], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 17, proc.stderr[-2000:]
    root = ckpt.checkpoint_root(tmp_path)
    assert [p.name for p in root.iterdir() if p.name.startswith(".step_4.")]  # half-written
    assert ckpt.latest_checkpoint(tmp_path).name == "step_2"

    from tests._mp_script import datasets

    train_set, val_set = datasets(16, 7)
    heads = {}
    for name, run_dir in (("straight", tmp_path / "straight"), ("resumed", tmp_path)):
        cfg = TrainerConfig(lr=1e-2, warmup_steps=1, max_steps=6, batch_size=2, grad_accum=2,
                            save_every=2, keep_last=0, log_every=1, progress=False)  # fmt: skip
        heads[name] = DummyHead(dropout=0.1)
        Trainer(
            heads[name],
            cfg,
            run_dir,
            train_dataset=train_set,
            collate_fn=collate_with_ids,
            target=make_target(),
            val_dataset=val_set,
        ).fit()
    assert_same_weights(heads["straight"], heads["resumed"])


# ---- damaged checkpoints (resume=auto must not trust them) ----------------------------------


def save_tiny_checkpoint(run_dir, step: int) -> Path:
    return ckpt.save_checkpoint(
        run_dir,
        ckpt.TrainState(step=step),
        head={"w": torch.ones(4)},
        optimizer={"state": {}, "param_groups": []},
        scheduler={"last_epoch": step},
        rng=[ckpt.capture_rng_state()],
    )


@pytest.mark.parametrize(
    "name", [ckpt.HEAD_FILE, ckpt.OPTIMIZER_FILE, ckpt.SCHEDULER_FILE, ckpt.RNG_FILE]
)
def test_a_truncated_file_makes_a_checkpoint_damaged(tmp_path, name):
    path = save_tiny_checkpoint(tmp_path, 2)
    assert ckpt.checkpoint_problems(path) == []
    data = (path / name).read_bytes()
    (path / name).write_bytes(data[: len(data) // 2])
    assert ckpt.checkpoint_problems(path) == [f"{name} has {len(data) // 2} bytes, not {len(data)}"]
    with pytest.raises(ckpt.CheckpointError, match="trainer.resume=never"):
        ckpt.load_checkpoint(path)


def test_an_empty_state_file_makes_a_checkpoint_damaged(tmp_path):
    path = save_tiny_checkpoint(tmp_path, 2)
    size = (path / ckpt.STATE_FILE).stat().st_size
    (path / ckpt.STATE_FILE).write_text("")
    assert ckpt.checkpoint_problems(path) == [f"{ckpt.STATE_FILE} has 0 bytes, not {size}"]
    assert ckpt.latest_checkpoint(tmp_path) == path  # listed, yet not trusted by resume
    (path / ckpt.MANIFEST_FILE).unlink()  # as a checkpoint older than manifests would be
    assert ckpt.checkpoint_problems(path) == [f"{ckpt.STATE_FILE} is missing or empty"]


def test_resume_falls_back_to_the_newest_intact_checkpoint(target, tmp_path, caplog):
    straight, _ = run(target, tmp_path / "straight")
    run(target, tmp_path / "r", stop_at=5)  # checkpoints step_3 (save_every) and step_5 (stop)
    root = ckpt.checkpoint_root(tmp_path / "r")
    head_file = root / "step_5" / ckpt.HEAD_FILE
    head_file.write_bytes(head_file.read_bytes()[:40])  # a power cut during the copy

    with caplog.at_level("WARNING", logger="train.checkpoint.resume"):
        resumed, result = run(target, tmp_path / "r")
    assert result.step == 6
    assert_same_weights(straight, resumed)
    warning = next(r.getMessage() for r in caplog.records if "damaged" in r.getMessage())
    assert "step_5" in warning and "resuming from step_3" in warning
    assert (root / "damaged_step_5").is_dir()  # kept for inspection, out of pruning's way


def test_resume_without_an_intact_checkpoint_says_what_to_do(target, tmp_path):
    run(target, tmp_path, stop_at=3)
    state = ckpt.checkpoint_root(tmp_path) / "step_3" / ckpt.STATE_FILE
    state.write_text("")
    with pytest.raises(ckpt.CheckpointError, match=r"no intact checkpoint .*step_3.*resume=never"):
        run(target, tmp_path)


def test_an_explicit_damaged_checkpoint_is_refused(target, tmp_path):
    run(target, tmp_path / "a", stop_at=3)
    path = ckpt.checkpoint_root(tmp_path / "a") / "step_3"
    (path / ckpt.RNG_FILE).write_bytes(b"")
    with pytest.raises(ckpt.CheckpointError, match="the checkpoint is damaged"):
        run(target, tmp_path / "b", resume=str(path))


# ---- changed settings on resume -------------------------------------------------------------


def test_resume_refuses_a_changed_learning_rate(target, tmp_path):
    run(target, tmp_path, stop_at=3, lr=1e-2)
    with pytest.raises(ckpt.CheckpointError, match=r"trainer\.lr: 0\.01 -> 0\.02.*allow_config"):
        run(target, tmp_path, lr=2e-2)


def test_allowed_change_applies_the_new_learning_rate(target, tmp_path, caplog):
    from train.optim import lr_multiplier

    run(target, tmp_path, stop_at=3, lr=1e-2)
    cfg = TrainerConfig(
        lr=2e-2, warmup_steps=2, max_steps=6, batch_size=2, grad_accum=2, save_every=3,
        progress=False, allow_config_change=True,
    )  # fmt: skip
    trainer = Trainer(
        DummyHead(dropout=0.1),
        cfg,
        tmp_path,
        train_dataset=make_examples(10),
        collate_fn=collate_with_ids,
        target=target,
    )
    with caplog.at_level("WARNING", logger="train.checkpoint.resume"):
        trainer.resume()
    assert trainer.scheduler.base_lrs == [2e-2, 2e-2]
    want = 2e-2 * lr_multiplier(3, warmup=2, total=6)
    assert [g["lr"] for g in trainer.optimizer.param_groups] == pytest.approx([want, want])
    assert any("trainer.lr: 0.01 -> 0.02" in r.getMessage() for r in caplog.records)


def test_cadence_and_length_changes_are_applied_and_logged(target, tmp_path, caplog):
    run(target, tmp_path, stop_at=3)
    with caplog.at_level("INFO", logger="train.checkpoint.resume"):
        _, result = run(target, tmp_path, max_steps=8, log_every=2, save_every=4)
    assert result.step == 8
    messages = [r.getMessage() for r in caplog.records]
    assert any("trainer.max_steps: 6 -> 8" in m for m in messages)
    assert any("trainer.log_every: 1 -> 2" in m for m in messages)


def test_another_head_or_data_is_refused(target, tmp_path):
    from train.loop import train

    def once(run_config, data_sha1, **overrides):
        cfg = TrainerConfig(lr=1e-2, max_steps=4, batch_size=2, save_every=2, progress=False,
                            **overrides)  # fmt: skip
        return train(
            DummyHead(), target, make_examples(6), None, collate_with_ids, cfg, tmp_path,
            callbacks=[lambda s: s.step == 2], run_config=run_config, data_sha1=data_sha1,
        )  # fmt: skip

    once({"head": {"num_heads": 2}}, "a" * 40)
    assert (tmp_path / "config.yaml").is_file()
    with pytest.raises(ckpt.CheckpointError, match="head.num_heads: 2 -> 3"):
        once({"head": {"num_heads": 3}}, "a" * 40, allow_config_change=True)
    with pytest.raises(ckpt.CheckpointError, match=r"training data \(sha1 aaaa"):
        once({"head": {"num_heads": 2}}, "b" * 40)
    assert "num_heads: 2" in (tmp_path / "config.yaml").read_text()  # the refused run wrote none


def test_a_checkpoint_becomes_a_head_folder(target, tmp_path):
    from safetensors.torch import load_file

    from eval.publish.export import find_head
    from train.rundir import CHECKPOINT_HEADS, HEAD_DIR, manifest_problems

    run_dir = tmp_path / "run"
    run(target, run_dir, keep_last=0)  # checkpoints at steps 3 and 6, then head/
    final = load_file(str(run_dir / HEAD_DIR / "model.safetensors"))
    at_6 = ckpt.head_from_checkpoint(run_dir / "checkpoints" / "step_6")
    assert at_6 == run_dir / CHECKPOINT_HEADS / "step_6" and not manifest_problems(at_6)
    got = load_file(str(at_6 / "model.safetensors"))
    assert got.keys() == final.keys() and all(torch.equal(got[k], final[k]) for k in got)
    config = (at_6 / "config.json").read_text()
    assert config == (run_dir / HEAD_DIR / "config.json").read_text()
    info = json.loads((at_6 / ckpt.CHECKPOINT_INFO).read_text())
    assert info["step"] == 6
    # step 3 holds that step's trained weights, not the final ones
    at_3 = load_file(
        str(ckpt.head_from_checkpoint(run_dir / "checkpoints" / "step_3") / "model.safetensors")
    )
    trained = load_file(str(run_dir / "checkpoints" / "step_3" / ckpt.HEAD_FILE))
    assert all(torch.equal(at_3[k], trained[k]) for k in trained)
    assert not all(torch.equal(at_3[k], final[k]) for k in trained)
    # export and evaluate take the checkpoint folder itself
    assert find_head(run_dir / "checkpoints" / "step_3") == (
        at_3_dir := run_dir / CHECKPOINT_HEADS / "step_3",
        run_dir,
    )
    assert at_3_dir.is_dir()


def test_a_checkpoint_of_a_run_without_a_head_says_what_to_do(target, tmp_path):
    run(target, tmp_path / "run", stop_at=3)  # stopped before any head was written
    with pytest.raises(ckpt.CheckpointError, match="no saved head.*resume it"):
        ckpt.head_from_checkpoint(tmp_path / "run" / "checkpoints" / "step_3")
    with pytest.raises(ckpt.CheckpointError, match="not a checkpoint folder"):
        ckpt.head_from_checkpoint(tmp_path / "run")
