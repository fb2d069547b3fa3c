"""FSDP (conf/accelerate/fsdp.yaml) on two CPU processes over gloo.

Accelerate 1.x enables FSDP only on GPU-like devices: on a CPU-only machine the FSDP config
quietly runs as DDP (MULTI_CPU). torch's FSDP2 `fully_shard` itself works over gloo, so the
script forces Accelerate's FSDP path (tests/_mp_script.py: force_fsdp_on_cpu) and the loop's
sharded code runs here. It does not get through a run yet (issue 13): the loop reads the
gathered state dict on every rank (FSDP's full state dict lives on rank 0 only), saves rank 0's
optimizer shards, and validates / saves the bare head, whose parameters are DTensor shards.
Strict xfail: once the loop handles FSDP this passes and the marker must go.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.test_multiprocess import REPO, SCRIPT, free_port


def launch_fsdp(run_dir, *extra: str) -> list[dict]:
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(REPO / "conf" / "accelerate" / "fsdp.yaml"),
        "--num_processes", "2", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()),
        str(SCRIPT), "--run-dir", str(run_dir), "--force-fsdp-on-cpu",
        "--max-steps", "4", "--save-every", "2", "--eval-every", "2", *extra,
    ]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO)}  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((run_dir / f"result_rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="train/loop.py does not handle FSDP's sharded head yet (see module docstring)",
)
def test_fsdp_on_two_cpu_processes_trains_saves_and_resumes(tmp_path):
    first = launch_fsdp(tmp_path / "run", "--stop-at", "2")
    assert {r["distributed_type"] for r in first} == {"DistributedType.FSDP"}
    results = launch_fsdp(tmp_path / "run", "--then-straight", str(tmp_path / "straight"))
    straight = [
        json.loads((tmp_path / "straight" / f"result_rank{r}.json").read_text()) for r in (0, 1)
    ]
    # both ranks see the same full weights, and stop + resume changed nothing
    assert len({r["weights"] for r in results + straight}) == 1
    assert [r["step"] for r in results] == [4, 4]
    assert (tmp_path / "run" / "head" / "model.safetensors").is_file()
