"""Where relative paths in configs point, and how files are written: atomically, under a lock."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

from data.errors import ConfigError

# The repository root in a checkout. An installed wheel lays out site-packages the same way
# (conf/ beside the packages, the corpora inside data/: pyproject.toml's package data), so there
# it is site-packages and every repo-relative path in a config still resolves.
REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "conf"  # the Hydra configs the entry points compose (eval/cli/)


def resolve_path(path: str | Path) -> Path:
    """`path` as given if it exists (or is absolute), else relative to REPO_ROOT."""
    given = Path(path).expanduser()
    if given.exists() or given.is_absolute():
        return given
    in_repo = REPO_ROOT / given
    return in_repo if in_repo.exists() else given


def cache_root() -> Path:
    """Where draftsmith keeps what it builds once: `$DRAFTSMITH_CACHE`, else ~/.cache/draftsmith."""
    return Path(os.environ.get("DRAFTSMITH_CACHE") or "~/.cache/draftsmith").expanduser()


def tmp_marker() -> str:
    """The part of a temporary file's name that says which host and process write it."""
    return f".tmp-{socket.gethostname()}-"


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """`write(tmp)` to a temporary file beside `path`, then rename it over `path` in one step:
    readers see the old file or the new one, never half of one. The temporary file is removed
    if `write` fails."""
    path = os.fspath(path)
    tmp = f"{path}{tmp_marker()}{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def lock_file(path: Path) -> Path:
    """The lock file that guards `path`: `.NAME.lock` beside it (gitignored as `.*.lock`)."""
    return path.with_name(f".{path.name}.lock")


@contextlib.contextmanager
def locked(path: Path, wait: bool = True) -> Iterator[bool]:
    """An exclusive lock on `path` (created); yields False at once when `wait` is off and
    another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def sole_writer(path: Path) -> Iterator[None]:
    """Hold `locked` on `lock_file(path)`, without waiting, for as long as the block
    runs; a second process that wants to append to the same file meanwhile gets a one-line error
    instead of interleaving its rows with the first one's. The lock goes with the process
    (a kill frees it); the file is removed when the block ends."""
    lock = lock_file(path)
    with locked(lock, wait=False) as mine:
        if not mine:
            raise ConfigError(
                f"another process is writing {path} (it holds {lock}): wait for it or stop it, "
                "then run again; the run resumes from what is written."
            )
        try:
            yield
        finally:  # removed while still held, so no finished run leaves lock files behind
            lock.unlink(missing_ok=True)
