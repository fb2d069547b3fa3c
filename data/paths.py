"""Where relative paths in configs point: the working directory first, then the repository."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def resolve_path(path: str | Path) -> Path:
    """`path` as given if it exists (or is absolute), else relative to the repository root."""
    given = Path(path).expanduser()
    if given.exists() or given.is_absolute():
        return given
    in_repo = REPO_ROOT / given
    return in_repo if in_repo.exists() else given
