"""Append-only JSONL files that several processes write and a killed run resumes.

Self-distillation (data/distill.py) and prompt synthesis (data/synthesize.py) both write rows
keyed by an `id`: one batch at a time, fsynced, so a killed run loses at most the batch in
flight; under `accelerate launch` rank r appends to its own part file `OUT.rank{r}.jsonl`, and
once every rank is done rank 0 moves the parts' rows into OUT (each id once). A half-written
last line, left by a kill mid-write, is cut off before a file is appended to again.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from data.formats import DataFormatError
from data.json_files import iter_jsonl

log = logging.getLogger(__name__)


def part_path(out: Path, rank: int) -> Path:
    """Rank `rank`'s part file beside `out`."""
    return out.with_name(f"{out.name}.rank{rank}.jsonl")


def part_files(out: Path) -> list[Path]:
    """Every rank's part file beside OUT (from runs of any process count)."""
    return sorted(out.parent.glob(f"{out.name}.rank*.jsonl"))


def repair_tail(path: Path) -> int:
    """Cut a half-written last line (a run killed mid-write); returns the bytes removed."""
    if not path.is_file():
        return 0
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end == len(data):
        return 0
    with open(path, "r+b") as f:
        f.truncate(end)
    log.warning("%s: removed a half-written last line (%d bytes)", path, len(data) - end)
    return len(data) - end


def read_rows(path: Path) -> Iterator[dict]:
    """The rows of an output, part or skipped file, read as data files are (data/json_files.py)."""
    try:
        for _, row in iter_jsonl(str(path)):
            yield row
    except DataFormatError as err:
        raise DataFormatError(
            f"{err} (self-distillation wrote this file: remove that line and run again to "
            "regenerate it)"
        ) from None


def append_rows(path: Path, rows: Sequence[dict]) -> None:
    """Append `rows` as JSON lines in one write, and fsync (nothing for no rows)."""
    if not rows:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
        f.flush()
        os.fsync(f.fileno())


def merge_parts(out: Path) -> int:
    """Move the per-rank part files' rows into OUT (each key once); returns rows moved."""
    repair_tail(out)
    have = {row["id"] for row in read_rows(out)} if out.is_file() else set()
    moved = 0
    for part in part_files(out):
        repair_tail(part)
        rows = [row for row in read_rows(part) if row["id"] not in have]
        append_rows(out, rows)
        have.update(row["id"] for row in rows)
        moved += len(rows)
        part.unlink()
    return moved


__all__ = ["append_rows", "merge_parts", "part_files", "part_path", "read_rows", "repair_tail"]
