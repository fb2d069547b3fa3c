"""Files a study shares between invocations: JSON merged under a lock, written atomically."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from data.paths import atomic_write, lock_file, locked  # locked: re-exported for the studies


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def load_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def update_json(path: Path, change: Callable[[dict], None]) -> dict:
    """Read `path`, apply `change` to it in place and write it back atomically, all under a lock
    file beside it: what other processes wrote meanwhile is kept."""
    with locked(lock_file(path)):
        doc = load_json(path)
        change(doc)
        write_text(path, json.dumps(doc, indent=2) + "\n")
    return doc
