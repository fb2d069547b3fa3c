"""Draft heads and the frozen target they sit on."""

from __future__ import annotations

import os
from pathlib import Path

from heads.base import (
    DraftHead,
    HeadMismatchError,
    LossOutput,
    is_foreign_head,
    read_head_config,
)
from heads.eagle import EagleConfig, EagleHead
from heads.eagle3 import Eagle3Config, Eagle3Head
from heads.medusa import MedusaConfig, MedusaHeads
from heads.medusa2 import Medusa2Config, Medusa2Head

# method name recorded in config.json -> class. Medusa-2 first: its config subclasses Medusa's,
# and build_head picks the first class whose config type matches.
HEAD_CLASSES: dict[str, type] = {
    "medusa2": Medusa2Head,
    "medusa": MedusaHeads,
    "eagle": EagleHead,
    "eagle3": Eagle3Head,
}


def build_head(config, target, token_counts=None) -> DraftHead:
    """A new head for `target` from its config dataclass (the config's type picks the method)."""
    for cls in HEAD_CLASSES.values():
        if isinstance(config, cls.config_class):
            return cls.for_target(config, target, token_counts=token_counts)
    raise TypeError(f"no head class takes a {type(config).__name__}; known: {sorted(HEAD_CLASSES)}")


def from_pretrained(path: str | os.PathLike, target) -> DraftHead:
    """Load any draftsmith head folder onto `target`, by the method its config.json records.
    A folder in a serving engine's layout (no "method" key) goes through heads.interop; a Hub
    repo id ("owner/name", not a local path) is downloaded first."""
    path = hub_snapshot(path)
    if is_foreign_head(path):
        from heads.interop import import_draft  # imported here: interop imports this package

        return import_draft(path, target)
    doc = read_head_config(path)
    method = doc["method"]
    if method not in HEAD_CLASSES:
        raise ValueError(f"{path}: unknown head method {method!r}; known: {sorted(HEAD_CLASSES)}.")
    return HEAD_CLASSES[method].from_pretrained(path, target, doc=doc)


def hub_snapshot(path: str | os.PathLike) -> str | os.PathLike:
    """`path` when it exists locally; for a Hub repo id, the downloaded snapshot's folder."""
    text = str(path)
    if Path(path).exists() or text.count("/") != 1 or text.startswith((".", "/", "~")):
        return path
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.bin", "*.pt", "*.md"]
    try:
        return snapshot_download(text, allow_patterns=patterns)
    except Exception as e:  # offline, unknown repo, no access: say which and what to do
        raise FileNotFoundError(
            f"{text}: not a local folder, and downloading it from the Hub failed "
            f"({type(e).__name__}: {e}). Check the repo id and network access (HF_HUB_OFFLINE, "
            "HF_TOKEN for private repos), or download it and pass the folder."
        ) from None


__all__ = [
    "DraftHead",
    "Eagle3Config",
    "Eagle3Head",
    "EagleConfig",
    "EagleHead",
    "HeadMismatchError",
    "LossOutput",
    "Medusa2Config",
    "Medusa2Head",
    "MedusaConfig",
    "MedusaHeads",
    "build_head",
    "from_pretrained",
]
