"""Two CPU processes under `accelerate launch --multi_gpu`: sharded data, gathered validation,
one writer, and an interrupted + resumed run equal to an uninterrupted one.

Runs in CI: two launches of two fresh interpreters, about 25-30 s on two cores."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests._dummy_head import DummyHead, label_count
from tests._mp_script import datasets
from train.checkpoint import list_checkpoints, load_checkpoint
from train.sampling import epoch_batches
from train.tracking import read_metrics

pytestmark = pytest.mark.integration  # two launches of two fresh interpreters
REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "_mp_script.py"
ARGS = ["--num-train", "16", "--num-val", "7", "--max-steps", "4", "--save-every", "2",
        "--eval-every", "2", "--dropout", "0.1"]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(run_dir: Path, *extra: str) -> list[dict]:
    """`accelerate launch --multi_gpu --num_processes 2` the script; returns each rank's result.

    CUDA is hidden, so this is a machine without GPUs (CI and GPU boxes alike): the loop must
    notice and join the processes over gloo instead of letting each train alone.
    """
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()),
        str(SCRIPT), "--run-dir", str(run_dir), *ARGS, *extra,
    ]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO)}  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((run_dir / f"result_rank{r}.json").read_text()) for r in (0, 1)]


def consumed(run_dir: Path, rank: int) -> list[list[int]]:
    lines = (run_dir / f"ids_rank{rank}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_two_processes_shard_gather_write_once_and_resume_exactly(tmp_path):
    run_dir = tmp_path / "resumed"
    first = launch(run_dir, "--stop-at", "2")
    for r, res in enumerate(first):
        assert (res["rank"], res["world"], res["step"]) == (r, 2, 2)
        assert res["distributed_type"] == "DistributedType.MULTI_CPU"
    assert [s for s, _ in list_checkpoints(run_dir)] == [2]
    assert len(load_checkpoint(run_dir / "checkpoints" / "step_2").rng) == 2  # one per rank
    results = launch(run_dir, "--then-straight", str(tmp_path / "straight"))
    straight = [
        json.loads((tmp_path / "straight" / f"result_rank{r}.json").read_text()) for r in (0, 1)
    ]

    # DDP kept the replicas equal, and stop + resume changed nothing
    digests = {res["weights"] for res in results + straight}
    assert len(digests) == 1 and [res["step"] for res in results] == [4, 4]

    # each process read its own shard of every global batch (2 x 2 examples), in order, with
    # no batch repeated or skipped across the resume
    for r in (0, 1):
        assert consumed(run_dir, r) == epoch_batches(16, 2, epoch=0, seed=0, rank=r, world_size=2)
    shards = [{i for batch in consumed(run_dir, r) for i in batch} for r in (0, 1)]
    assert not shards[0] & shards[1] and len(shards[0] | shards[1]) == 16

    # validation stats were summed over both processes: counts cover the whole val set once
    _, val_set = datasets(16, 7)
    for res in results:
        assert res["val_totals"]["head0/top1"][1] == label_count(val_set)
        assert res["val_totals"] == results[0]["val_totals"]

    # only rank 0 wrote checkpoints, the head and metrics (each step logged once)
    assert (run_dir / "writes_rank0.txt").read_text().split() == ["checkpoint"] * 2 + ["head"]
    assert not (run_dir / "writes_rank1.txt").exists()
    assert [s for s, _ in list_checkpoints(run_dir)] == [2, 4]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records if "train/loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in records if "val/head0/top1" in r] == [2, 4]
    saved = load_file(str(run_dir / "head" / "model.safetensors"))
    assert set(saved) == set(DummyHead().state_dict())
