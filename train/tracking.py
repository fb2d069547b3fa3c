"""Metric logging: always `<run_dir>/metrics.jsonl`, plus Weights & Biases when enabled.

Only the main process writes anything. It is recognised from the launcher's environment
(`RANK`, or the MPI equivalents), so a Tracker can be built before the training loop starts
its Accelerator. A line torn by a crash or a full disk (the last one, cut short) is dropped
with a warning when the file is next opened, so it never blocks a resume. W&B runs in one of
three modes: "online", "offline" (files under `dir`, sync later with `wandb sync`; never
touches the network) or "disabled" (W&B not even imported).
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data.errors import ConfigError
from train.rundir import METRICS_FILE, WANDB_ID_FILE

log = logging.getLogger(__name__)

WANDB_MODES = ("online", "offline", "disabled")


@dataclass
class LoggerConfig:
    """Where metrics go. `dir` holds W&B's local files (default: the run directory)."""

    project: str = "draftsmith"
    entity: str | None = None
    mode: str = "disabled"
    run_name: str | None = None
    tags: list[str] = field(default_factory=list)
    dir: str | None = None

    def __post_init__(self) -> None:
        self.tags = list(self.tags)
        if self.mode not in WANDB_MODES:
            raise ConfigError(
                f"LoggerConfig: mode={self.mode!r}: use one of {', '.join(WANDB_MODES)} "
                "(offline writes W&B files locally for a later `wandb sync`)."
            )


def env_rank() -> int:
    """Global rank as set by torchrun / accelerate launch / MPI; 0 when not launched."""
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


class Tracker:
    """Logs metrics to metrics.jsonl and (optionally) W&B, on the main process only.

    A W&B run keeps its id in `<run_dir>/wandb_run_id`, so a resumed training run appends to
    the same W&B run instead of starting a new one.
    """

    def __init__(
        self,
        cfg: LoggerConfig | None,
        run_dir: str | os.PathLike,
        *,
        is_main: bool | None = None,
    ) -> None:
        self.cfg = cfg or LoggerConfig()
        self.run_dir = Path(run_dir)
        self.is_main = env_rank() == 0 if is_main is None else is_main
        self.metrics_path = self.run_dir / METRICS_FILE
        self._wandb_run = None
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            _drop_torn_tail(self.metrics_path)
            if self.cfg.mode != "disabled":
                self._wandb_run = self._init_wandb()

    def _init_wandb(self):
        import wandb

        id_file = self.run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        wandb_dir = Path(self.cfg.dir) if self.cfg.dir else self.run_dir
        wandb_dir.mkdir(parents=True, exist_ok=True)
        return wandb.init(
            project=self.cfg.project,
            entity=self.cfg.entity,
            name=self.cfg.run_name,
            tags=self.cfg.tags or None,
            dir=str(wandb_dir),
            mode=self.cfg.mode,
            id=run_id,
            resume="allow",
        )

    @property
    def wandb_run(self):
        """The live `wandb.Run`, or None (disabled, or not the main process)."""
        return self._wandb_run

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Append `{"step": step, **metrics}` to metrics.jsonl and send it to W&B."""
        if not self.is_main:
            return
        values = {k: _to_number(v) for k, v in metrics.items()}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps({"step": int(step), **values}) + "\n")
        if self._wandb_run is not None:
            self._wandb_run.log(values, step=int(step))

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Record the run's resolved configuration (a plain nested dict) in W&B."""
        if self._wandb_run is not None:
            self._wandb_run.config.update(dict(config), allow_val_change=True)

    def log_artifact(
        self,
        path: str | os.PathLike,
        name: str,
        type: str = "model",
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        """Upload a folder (e.g. the final head) as a W&B artifact; no-op without W&B."""
        if self._wandb_run is None:
            return
        import wandb

        artifact = wandb.Artifact(name, type=type, metadata=dict(metadata or {}))
        artifact.add_dir(str(path))
        self._wandb_run.log_artifact(artifact)

    def log_files(self, files: Mapping[str, str | os.PathLike], step: int | None = None) -> None:
        """Log PNG plots as W&B images under their keys and save the other files (e.g. a
        report.md) with the W&B run; no-op without W&B."""
        if self._wandb_run is None:
            return
        import wandb

        images = {k: wandb.Image(str(v)) for k, v in files.items() if str(v).endswith(".png")}
        if images:
            self._wandb_run.log(images, step=step)
        for path in files.values():
            if not str(path).endswith(".png"):
                self._wandb_run.save(str(path), base_path=str(Path(path).parent), policy="now")

    def rewind(self, step: int) -> None:
        """Drop metrics.jsonl records after `step` (a resumed run logs those steps again)."""
        if not self.is_main or not self.metrics_path.is_file():
            return
        kept = [
            json.dumps(record)
            for record in _parse_lines(self.metrics_path)
            if record.get("step", 0) <= step
        ]
        tmp = self.metrics_path.with_name(self.metrics_path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.metrics_path)

    def finish(self) -> None:
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc) -> None:
        self.finish()


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of `<run_dir>/metrics.jsonl` (empty list when there is none)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return _parse_lines(path)


def _parse_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON records of a .jsonl file; lines that do not parse are skipped with a warning."""
    records, torn = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            torn += 1
            continue
        if isinstance(record, dict):
            records.append(record)
        else:
            torn += 1
    if torn:
        log.warning("%s: skipped %d damaged line(s)", path, torn)
    return records


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line left without its newline (the process died mid-write), so the next
    record starts on a line of its own."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    log.warning("%s: dropped a torn last line (%d bytes)", path, len(data) - keep)
    with open(path, "r+b") as f:
        f.truncate(keep)


def _to_number(value: Any) -> Any:
    """Tensors and numpy scalars become Python numbers (NaN stays NaN; json writes it)."""
    return value.item() if hasattr(value, "item") else value
