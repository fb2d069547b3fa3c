"""Draft heads and the frozen target they sit on.

`HEAD_TYPES` (heads/registry.py) is the one list of draft methods: every table elsewhere (the
method name in config.json, the config type `build_head` dispatches on, export formats, model-card
wording, the proposer eval drafts with) is read from the head classes' own attributes
(heads.base.DraftHead).
"""

from __future__ import annotations

import os
from pathlib import Path

from heads.base import (
    BlockDrafter,
    DraftHead,
    FeatureDrafter,
    HeadMismatchError,
    LossOutput,
    ParallelDrafter,
)
from heads.dflash import DFlashConfig, DFlashHead
from heads.dspark import DSparkConfig, DSparkHead
from heads.eagle import EagleConfig, EagleHead
from heads.eagle3 import Eagle3Config, Eagle3Head
from heads.folder import HeadFolderError, is_foreign_head
from heads.medusa import MedusaConfig, MedusaHeads
from heads.medusa2 import Medusa2Config, Medusa2Head
from heads.registry import HEAD_CLASSES, HEAD_TYPES, build_head, head_class, load_native

HUB_PREFIX = "hf://"  # heads.from_pretrained("hf://owner/name") downloads a Hub repo


def from_pretrained(
    path: str | os.PathLike, target, *, allow_other_target: bool = False
) -> DraftHead:
    """Load a head folder onto `target`, by the method its config.json records.

    path: a local folder, or `hf://owner/name` for a Hub repo (downloaded first). A folder in a
        serving engine's layout (no draftsmith records) goes through heads.interop.
    allow_other_target: load a head trained on another model of the same sizes (a deliberate
        transfer); without it such a head is refused (heads.folder.check_target).
    """
    folder = head_folder(path)
    if is_foreign_head(folder):
        from heads.interop import import_draft  # only another tool's layout needs the readers

        return import_draft(folder, target, allow_other_target=allow_other_target)
    return load_native(folder, target, allow_other_target=allow_other_target)


def head_folder(path: str | os.PathLike) -> Path:
    """The local folder `path` names: itself, or for `hf://owner/name` the downloaded snapshot.
    A path that is not here is never guessed to be a Hub repo (a typo would download one)."""
    text = os.fspath(path)
    if text.startswith(HUB_PREFIX):
        return Path(hub_snapshot(text[len(HUB_PREFIX) :]))
    folder = Path(text).expanduser()
    if folder.is_dir():
        return folder
    hint = f"; for a Hub repo write {HUB_PREFIX}{text}" if _looks_like_repo_id(text) else ""
    raise FileNotFoundError(f"no folder {text} here ({Path.cwd()}){hint}.")


def _looks_like_repo_id(text: str) -> bool:
    return text.count("/") == 1 and not text.startswith((".", "/", "~")) and "\\" not in text


def hub_snapshot(repo_id: str) -> str:
    """The local folder of a Hub repo's files (downloaded, or from the Hub cache)."""
    from huggingface_hub import snapshot_download

    if not repo_id or repo_id.count("/") > 1:
        raise ValueError(f"{HUB_PREFIX}{repo_id}: write a Hub repo as {HUB_PREFIX}owner/name.")
    patterns = ["*.json", "*.safetensors", "*.bin", "*.pt", "*.md"]
    try:
        return snapshot_download(repo_id, allow_patterns=patterns)
    except Exception as e:  # offline, unknown repo, no access: say which and what to do
        raise FileNotFoundError(
            f"{HUB_PREFIX}{repo_id}: downloading it from the Hub failed ({type(e).__name__}); "
            "check the repo id and network access (HF_HUB_OFFLINE=1 allows only repos already "
            "in the Hub cache; HF_TOKEN for private repos), or download it and pass the folder."
        ) from None


__all__ = [
    "HEAD_CLASSES",
    "BlockDrafter",
    "DFlashConfig",
    "DFlashHead",
    "DSparkConfig",
    "DSparkHead",
    "HEAD_TYPES",
    "HUB_PREFIX",
    "DraftHead",
    "Eagle3Config",
    "Eagle3Head",
    "EagleConfig",
    "EagleHead",
    "FeatureDrafter",
    "HeadFolderError",
    "HeadMismatchError",
    "LossOutput",
    "Medusa2Config",
    "Medusa2Head",
    "MedusaConfig",
    "MedusaHeads",
    "ParallelDrafter",
    "build_head",
    "from_pretrained",
    "head_class",
    "head_folder",
]
