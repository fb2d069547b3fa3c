"""Running train.py / evaluate.py as a study's subprocesses, and reading back what they wrote.

A study calls the entry points a user types (`python train.py +experiment=... k=v`), from the
repository root at a fixed thread count, and reads the run folder (metrics.jsonl) and the
evaluation's summary.json afterwards; nothing here imports the training loop.
"""

from __future__ import annotations

import os
import re
import resource
import shlex
import subprocess
from pathlib import Path

from data.errors import DraftsmithError
from lab.studies.store import read_jsonl

REPO = Path(__file__).resolve().parents[2]
# the per-depth accuracy names each head family logs: EAGLE-3's unrolled steps, a block
# drafter's slots, Medusa's heads (EAGLE-3 also logs step0 as head0; steps come first)
_DEPTH_FAMILIES = ("step", "slot", "head")


def child_env(threads: int) -> dict:
    """The environment of a study's subprocess: this repository first, `threads` threads."""
    t = str(threads)
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t}


def call(cmd: list[str], env: dict, log: Path) -> None:
    """Run a command from the repository root, its output appended to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise DraftsmithError(f"{' '.join(cmd[1:3])} failed (exit {proc.returncode}): see {log}")


def shell(cmd: list[str], threads: int) -> str:
    """A command as a user types it from the repository root."""
    return f"OMP_NUM_THREADS={threads} " + shlex.join(["python", *cmd[1:]])


def children_cpu_s() -> float:
    """CPU seconds (user + system) of every finished subprocess so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def train_rows(run_dir: Path) -> list[dict]:
    """The training records of a run's metrics.jsonl, one per step (a resumed run may have
    logged a step twice: the later record wins), in step order."""
    from train.rundir import METRICS_FILE

    path = run_dir / METRICS_FILE
    rows = read_jsonl(path) if path.is_file() else []
    by_step = {r["step"]: r for r in rows if "train/cpu_min" in r}
    return [by_step[s] for s in sorted(by_step)]


def depth_names(keys) -> list[str]:
    """The drafted-depth names among metric keys `val/NAME/top1`, shallowest first."""
    names = {k.split("/")[1] for k in keys if k.startswith("val/") and k.endswith("/top1")}
    for family in _DEPTH_FAMILIES:
        found = [n for n in names if re.fullmatch(rf"{family}\d+", n)]
        if found:
            return sorted(found, key=lambda n: int(n[len(family) :]))
    return []


def train_metrics(run_dir: Path) -> dict:
    """What a finished run measured: its training CPU-minutes and steps, held-out top-1 per
    drafted depth at the end, and training top-1 per depth of the last logged window (the
    mean over its last `log_every` steps)."""
    from train.rundir import METRICS_FILE

    rows = read_jsonl(run_dir / METRICS_FILE)
    train = train_rows(run_dir)
    val = [r for r in rows if any(k.startswith("val/") for k in r)]
    if not train or not val:
        raise DraftsmithError(f"{run_dir}/{METRICS_FILE} has no training or validation record: "
                              "the run did not finish; rerun to resume it.")  # fmt: skip
    last, held = train[-1], max(val, key=lambda r: r["step"])
    depths = depth_names(held)
    return {
        "cpu_min": last["train/cpu_min"],
        "trained_steps": last["step"],
        "depths": depths,
        "val_top1": [held.get(f"val/{d}/top1") for d in depths],
        "train_top1": [last.get(f"train/{d}/top1") for d in depths],
        "val_loss": held.get("val/loss"),
        "val_chain_tau_est": held.get("val/chain_tau_est"),
    }


def eval_metrics(summary: dict, names) -> dict:
    """tau, greedy mismatches (near ties apart) and acceptance by depth of each method `names`
    of an evaluate.py summary.json, as flat `{metric}_{name}` keys."""
    out: dict = {}
    for name in names:
        entry = summary["methods"].get(name)
        if entry is None:
            raise DraftsmithError(f"the evaluation summary has no method {name!r}: delete "
                                  "its folder and rerun.")  # fmt: skip
        m = entry["overall"]
        out[f"tau_{name}"] = m["tau"]
        out[f"mismatches_{name}"] = m["greedy_mismatches"]
        out[f"near_ties_{name}"] = m["near_tie_mismatches"]
        out[f"accept_{name}"] = m["accept_rate_by_depth"]
        out["bench_requests"] = m["requests"]
        tree = summary.get("meta", {}).get("heads", {}).get(name, {})
        out[f"tree_depth_{name}"] = tree.get("tree_depth")  # what the tree drafted at most
    return out
