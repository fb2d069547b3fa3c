"""FSDP (conf/accelerate/fsdp.yaml) on two CPU processes over gloo.

Accelerate 1.x enables FSDP only on GPU-like devices: on a CPU-only machine the FSDP config
quietly runs as DDP (MULTI_CPU). torch's FSDP2 `fully_shard` itself works over gloo, so the
script forces Accelerate's FSDP path (tests/_mp_script.py: force_fsdp_on_cpu) and the loop's
sharded code runs here: the head's parameters and optimizer moments are DTensor shards, the
checkpoint gathers them on rank 0, resume spreads them again, and validation and head saving
run on a full copy gathered on every process (train/loop.py, train/checkpoint/state.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests._dummy_head import HIDDEN, VOCAB
from tests.test_multiprocess import REPO, SCRIPT, free_port

pytestmark = pytest.mark.integration  # two launches of two processes each
ENV = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
       "PYTHONPATH": str(REPO)}  # fmt: skip


def launch_fsdp(run_dir, *extra: str) -> list[dict]:
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(REPO / "conf" / "accelerate" / "fsdp.yaml"),
        "--num_processes", "2", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()),
        str(SCRIPT), "--run-dir", str(run_dir), "--force-fsdp-on-cpu",
        "--max-steps", "4", "--save-every", "2", "--eval-every", "2", *extra,
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((run_dir / f"result_rank{r}.json").read_text()) for r in (0, 1)]


def test_fsdp_on_two_cpu_processes_trains_saves_and_resumes(tmp_path):
    first = launch_fsdp(tmp_path / "run", "--stop-at", "2")
    results = launch_fsdp(tmp_path / "run", "--then-straight", str(tmp_path / "straight"))
    straight = [
        json.loads((tmp_path / "straight" / f"result_rank{r}.json").read_text()) for r in (0, 1)
    ]
    kinds = {r["distributed_type"] for r in first + results + straight}
    assert kinds == {"DistributedType.FSDP"}
    # both ranks see the same full weights, and stop + resume changed nothing
    assert len({r["weights"] for r in results + straight}) == 1
    assert [r["step"] for r in results] == [4, 4]
    assert (tmp_path / "run" / "head" / "model.safetensors").is_file()
    # both ranks validated the same (full) head on their shares of the validation set
    assert len({json.dumps(r["val_totals"], sort_keys=True) for r in results}) == 1
    # the checkpoint holds the full optimizer state, keyed by parameter name
    saved = torch.load(tmp_path / "run" / "checkpoints" / "step_4" / "optimizer.pt")
    moments = saved["optimizer"]["state"]["head.proj.weight"]["exp_avg"]
    assert type(moments) is torch.Tensor and moments.shape == (VOCAB, HIDDEN)

    # an FSDP checkpoint also resumes in one process without FSDP (optimizer state by name)
    single = tmp_path / "single"
    shutil.copytree(tmp_path / "run" / "checkpoints" / "step_2", single / "checkpoints" / "step_2")
    cmd = [sys.executable, str(SCRIPT), "--run-dir", str(single), "--max-steps", "4"]
    proc = subprocess.run(
        cmd, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads((single / "result_rank0.json").read_text())
    assert (result["distributed_type"], result["step"]) == ("DistributedType.NO", 4)
    assert "resumed" in proc.stderr or (single / "checkpoints" / "step_4").is_dir()
