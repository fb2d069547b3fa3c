"""The checkpoint folder: written atomically, listed, checked, read back, pruned to the last k.

A checkpoint is the folder `<run_dir>/checkpoints/step_<N>/`:

    head.safetensors     the head's trainable parameters (frozen shared target weights excluded)
    optimizer.pt         optimizer state (+ the fp16 grad scaler's, if any)
    scheduler.pt         learning-rate scheduler state
    rng.pt               python / numpy / torch / cuda RNG states, one entry per process
    trainer_state.json   step, epoch, data position, token counts
    run.json             the settings and data fingerprint the run had (resume.py)
    manifest.json        size and sha256 of each file above (written last)

A checkpoint always holds full tensors, also under FSDP2 (state.py gathers
and spreads them).

The folder is filled under a temporary name in the same parent, fsynced and renamed into place
in one step, so a crash mid-write leaves only a dot-prefixed temporary folder, which
`list_checkpoints` never returns (and the next successful save deletes). A folder damaged after
it was written (a truncated file, a disk error) fails `checkpoint_problems`, and resume skips it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from data.errors import DraftsmithError
from heads.base import atomic_save_dir, check_finite
from train.rundir import (
    CHECKPOINT_HEADS,
    CHECKPOINTS,
    MANIFEST_FILE,
    kept_head,
    manifest_problems,
    write_manifest,
)

STATE_FILE = "trainer_state.json"
HEAD_FILE = "head.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng.pt"
RUN_FILE = "run.json"
CHECKPOINT_INFO = "checkpoint.json"  # in a head folder made from a checkpoint: where, which step
_STEP_DIR = re.compile(r"^step_(\d+)$")
# what reading a truncated or garbled checkpoint file raises
_UNREADABLE = (
    OSError,
    EOFError,
    RuntimeError,
    ValueError,
    TypeError,
    KeyError,
    pickle.UnpicklingError,
    SafetensorError,
)


class CheckpointError(DraftsmithError):
    """A checkpoint cannot be trusted (damaged, incomplete) or does not fit this run."""


@dataclass
class TrainState:
    """Where a run stands. `batch_in_epoch` counts the micro-batches each process has consumed
    in `epoch` (the data position); token counts are summed over all processes."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    global_batch: int = 0  # batch_size * num_processes when written (to re-map the position)
    tokens: int = 0
    loss_tokens: int = 0
    # CPU seconds the optimizer steps took (process CPU time, all threads, summed over
    # processes; data loading and online features included, feature-cache builds and
    # evaluation not): the x axis of equal-CPU comparisons, carried across resumes
    cpu_s: float = 0.0
    # the run length a time budget planned (train/budget.py); 0: none planned
    planned_steps: int = 0


@dataclass
class Checkpoint:
    """Everything read back from a checkpoint folder (tensors on CPU)."""

    path: Path
    state: TrainState
    head: dict[str, Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    scaler: dict[str, Any] | None
    rng: list[dict[str, Any]]
    run: dict[str, Any] | None = None  # run.json; None in checkpoints older than it


def checkpoint_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINTS


def list_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Checkpoints under `run_dir` (step_<N> folders that were renamed into place: they hold a
    manifest, or a state file when older than manifests), oldest first, as (step, folder).
    Listed is not intact: see `checkpoint_problems`."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and any((child / name).is_file() for name in (MANIFEST_FILE, STATE_FILE)):
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def save_checkpoint(
    run_dir: str | os.PathLike,
    state: TrainState,
    head: dict[str, Tensor],
    optimizer: dict[str, Any],
    scheduler: dict[str, Any],
    rng: list[dict[str, Any]],
    scaler: dict[str, Any] | None = None,
    keep_last: int = 0,
    run: dict[str, Any] | None = None,
) -> Path:
    """Write `step_<state.step>/` atomically, then keep only the newest `keep_last` (0: all).

    `run` (the settings and data fingerprint, see resume.py) goes to run.json. Weights
    holding inf/NaN are refused: resuming from them could only continue a diverged run.
    Call on one process only (the main one); the others must wait for it.
    """
    # clone: safetensors refuses tensors that share storage, and we never want views here
    head = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in head.items()}
    path = checkpoint_root(run_dir) / f"step_{state.step}"
    check_finite(head, path)

    def write(tmp: Path) -> None:
        save_file(head, str(tmp / HEAD_FILE), metadata={"format": "pt"})
        torch.save({"optimizer": optimizer, "scaler": scaler}, tmp / OPTIMIZER_FILE)
        torch.save(scheduler, tmp / SCHEDULER_FILE)
        torch.save(rng, tmp / RNG_FILE)
        (tmp / STATE_FILE).write_text(json.dumps(dataclasses.asdict(state), indent=2) + "\n")
        if run is not None:
            (tmp / RUN_FILE).write_text(json.dumps(run, indent=1, sort_keys=True) + "\n")
        write_manifest(tmp)  # last: it vouches for everything above

    atomic_save_dir(path, write)
    prune_checkpoints(run_dir, keep_last)
    return path


def prune_checkpoints(run_dir: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints (0 keeps all) and any temporary
    folders left by interrupted saves. Returns the folders removed."""
    removed = []
    found = list_checkpoints(run_dir)
    if keep_last > 0:
        removed += [path for _, path in found[:-keep_last]]
    root = checkpoint_root(run_dir)
    removed += [p for p in root.iterdir() if p.name.startswith(".") and p.is_dir()]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def checkpoint_problems(path: str | os.PathLike) -> list[str]:
    """What is wrong with a checkpoint folder, as short phrases; [] when it can be trusted.

    Checked against its manifest; one older than manifests must at least hold every file and a
    readable state file."""
    path = Path(path)
    problems = manifest_problems(path)
    if problems != [f"no {MANIFEST_FILE}"]:
        return problems
    names = (HEAD_FILE, OPTIMIZER_FILE, SCHEDULER_FILE, RNG_FILE, STATE_FILE)
    problems = [f"{n} is missing or empty" for n in names if not _has_bytes(path / n)]
    if not problems:
        try:
            TrainState(**json.loads((path / STATE_FILE).read_text()))
        except (ValueError, TypeError):
            problems.append(f"{STATE_FILE} is unreadable")
    return problems


def _has_bytes(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read a checkpoint folder written by `save_checkpoint`; CheckpointError when a file in
    it cannot be read (check `checkpoint_problems` first to also catch silent damage)."""
    path = Path(path)
    if not any((path / name).is_file() for name in (MANIFEST_FILE, STATE_FILE)):
        raise CheckpointError(
            f"{path} is not a checkpoint (no {MANIFEST_FILE}); pass a "
            f"<run_dir>/{CHECKPOINTS}/step_<N> folder, or trainer.resume=auto for the latest one."
        )
    try:
        state = TrainState(**json.loads((path / STATE_FILE).read_text()))
        optim = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        return Checkpoint(
            path=path,
            state=state,
            head=load_file(str(path / HEAD_FILE)),
            optimizer=optim["optimizer"],
            scheduler=torch.load(path / SCHEDULER_FILE, map_location="cpu", weights_only=True),
            scaler=optim["scaler"],
            rng=torch.load(path / RNG_FILE, map_location="cpu", weights_only=True),
            run=json.loads((path / RUN_FILE).read_text()) if (path / RUN_FILE).is_file() else None,
        )
    except _UNREADABLE as err:
        raise CheckpointError(
            f"{path} cannot be read ({type(err).__name__}: {str(err)[:120]}): delete it to "
            "resume from an older checkpoint, or set trainer.resume=never to start over."
        ) from err


def is_checkpoint(folder: str | os.PathLike) -> bool:
    """True for a checkpoint folder (RUN/checkpoints/step_N)."""
    folder = Path(folder)
    return (folder / STATE_FILE).is_file() and (folder / HEAD_FILE).is_file()


def head_from_checkpoint(checkpoint: str | os.PathLike) -> Path:
    """A head folder (what `heads.from_pretrained` loads) for the weights of a checkpoint, to
    evaluate or export a run at any saved step (e.g. at equal CPU time with another draft).

    A checkpoint holds the trained tensors only; the config and the fixed buffers (a reduced
    vocabulary's d2t/t2d) come from the head the same run kept (best_head/ or head/), which
    a run writes at its first evaluation or at its end. Written once, atomically and with a
    manifest, to RUN/checkpoint_heads/step_N; returns that folder."""
    from heads.base import CONFIG_NAME, WEIGHTS_NAME

    checkpoint = Path(checkpoint).resolve()
    if not is_checkpoint(checkpoint):
        raise CheckpointError(f"{checkpoint}: not a checkpoint folder ({STATE_FILE}, {HEAD_FILE})")
    run_dir = checkpoint.parent.parent
    out = run_dir / CHECKPOINT_HEADS / checkpoint.name
    if (out / CONFIG_NAME).is_file() and not manifest_problems(out):
        return out
    problems = checkpoint_problems(checkpoint)
    if problems:
        raise CheckpointError(f"{checkpoint} is damaged ({'; '.join(problems[:3])})")
    kept = kept_head(run_dir)
    if kept is None:
        raise CheckpointError(
            f"{run_dir} has no saved head (best_head/ or head/) to take the head's config from; "
            "a run writes one at its first evaluation (trainer.eval_every with evaluators) or at "
            "its end: resume it until then."
        )
    reference = load_file(str(kept / WEIGHTS_NAME))
    trained = load_file(str(checkpoint / HEAD_FILE))
    for name, tensor in trained.items():
        if name not in reference or reference[name].shape != tensor.shape:
            raise CheckpointError(
                f"{checkpoint}: tensor {name} does not fit the run's kept head {kept} "
                "(another head config?)"
            )
    tensors = reference | trained

    def write(tmp: Path) -> None:
        shutil.copy2(kept / CONFIG_NAME, tmp / CONFIG_NAME)
        save_file(tensors, str(tmp / WEIGHTS_NAME), {"format": "pt"})
        state = json.loads((checkpoint / STATE_FILE).read_text())
        (tmp / CHECKPOINT_INFO).write_text(json.dumps({"from": str(checkpoint), **state}))
        write_manifest(tmp)

    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_save_dir(out, write)
    return out


def save_head_folder(
    head: nn.Module, path: str | os.PathLike, also: Callable[[Path], None] | None = None
) -> Path:
    """`head.save_pretrained(path)`, plus whatever `also(folder)` writes, plus a manifest over
    all of it, put in place atomically: how a run keeps a head (head/, best_head/). Call on one
    process only."""

    def write(tmp: Path) -> None:
        head.save_pretrained(tmp)
        if also is not None:
            also(tmp)
        write_manifest(tmp)

    return atomic_save_dir(path, write)
