"""The one list of draft methods, `HEAD_TYPES`, and what is looked up in it: the head class of a
method name, the head a config dataclass builds, and loading a folder draftsmith saved.

Every table elsewhere (the method name in config.json, export formats, model-card wording, the
proposer eval drafts with) is read from the head classes' own attributes (heads.base.DraftHead).
"""

from __future__ import annotations

import os
from pathlib import Path

from heads.base import CONFIG_NAME, DraftHead
from heads.dflash import DFlashHead
from heads.dspark import DSparkHead
from heads.eagle import EagleHead
from heads.eagle3 import Eagle3Head
from heads.folder import HeadFolderError, read_head_config
from heads.medusa import MedusaHeads
from heads.medusa2 import Medusa2Head

HEAD_TYPES: tuple[type[DraftHead], ...] = (
    MedusaHeads,
    Medusa2Head,
    EagleHead,
    Eagle3Head,
    DFlashHead,
    DSparkHead,
)
HEAD_CLASSES: dict[str, type[DraftHead]] = {cls.method: cls for cls in HEAD_TYPES}


def head_class(method: str, where: str | os.PathLike = "") -> type[DraftHead]:
    """The head class whose `method` is `method` (`where`: the file that named it)."""
    if method not in HEAD_CLASSES:
        where = f"{where}: " if where else ""
        raise HeadFolderError(
            f"{where}unknown head method {method!r}; known: {', '.join(sorted(HEAD_CLASSES))}."
        )
    return HEAD_CLASSES[method]


def build_head(config, target, token_counts=None) -> DraftHead:
    """A new head for `target` from its config dataclass (the config's exact type picks the
    method: Medusa2Config subclasses MedusaConfig, and each still builds its own head)."""
    for cls in HEAD_TYPES:
        if type(config) is cls.config_class:
            return cls.for_target(config, target, token_counts=token_counts)
    known = ", ".join(cls.config_class.__name__ for cls in HEAD_TYPES)
    raise TypeError(f"no head class takes a {type(config).__name__}; known configs: {known}.")


def load_native(folder: str | os.PathLike, target, allow_other_target: bool = False) -> DraftHead:
    """A folder `save_pretrained` wrote, loaded onto `target` by the method its config.json
    records (heads.from_pretrained also reads Hub repos and other tools' layouts)."""
    doc = read_head_config(folder)
    cls = head_class(doc["method"], Path(folder) / CONFIG_NAME)
    return cls.from_pretrained(folder, target, doc=doc, allow_other_target=allow_other_target)


__all__ = ["HEAD_CLASSES", "HEAD_TYPES", "build_head", "head_class", "load_native"]
