"""Reading a head folder back: config.json, model.safetensors and the target they were made for.

Every way a folder can be wrong ends in one error that names the file and the fix: a damaged or
cut-short file, a config.json that lacks a record or labels the folder with the wrong method,
tensors that do not fit the head, and a head trained on another model. The last one matters most,
because a head loaded onto the wrong model proposes garbage and looks like a bad head rather than
a bad load: sizes must match, and so must the target's fingerprint unless `allow_other_target`
says the transfer is deliberate.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor, nn

from data.errors import DraftsmithError
from heads.base import CONFIG_NAME, WEIGHTS_NAME, HeadMismatchError, TargetInfo

log = logging.getLogger(__name__)

AGAIN = "save or download the head again"
# Keys only draftsmith writes into config.json: a folder with any of them is not a serving
# engine's export, even when "method" went missing.
OWN_KEYS = frozenset({"method", "draftsmith_version", "target"})


class HeadFolderError(DraftsmithError, ValueError):
    """A head folder that cannot be read as written: damaged, incomplete or mislabelled."""


def read_json(file: Path) -> dict:
    """A config.json as a mapping, or a HeadFolderError naming the file."""
    try:
        doc = json.loads(Path(file).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" at line {e.lineno}" if isinstance(e, json.JSONDecodeError) else ""
        raise HeadFolderError(
            f"{file}: not valid JSON ({type(e).__name__}{where}): the file is damaged or was cut "
            f"short while being written; {AGAIN}."
        ) from None
    if not isinstance(doc, dict):
        raise HeadFolderError(f"{file}: a JSON {type(doc).__name__}, not an object; {AGAIN}.")
    return doc


def is_foreign_head(path: str | os.PathLike) -> bool:
    """True for a folder whose config.json draftsmith did not write (none of OWN_KEYS): a serving
    engine's layout, for heads.interop. A draftsmith file that lost its "method" is not foreign:
    read_head_config refuses it."""
    cfg_file = Path(path) / CONFIG_NAME
    return cfg_file.is_file() and not (read_json(cfg_file).keys() & OWN_KEYS)


def read_head_config(path: str | os.PathLike) -> dict:
    """config.json of a head folder, checked: a method name, a config mapping, a target record."""
    cfg_file = Path(path) / CONFIG_NAME
    if not cfg_file.is_file():
        raise FileNotFoundError(
            f"{cfg_file} not found: a head folder holds config.json and model.safetensors "
            "(written by save_pretrained, e.g. <run dir>/head/)."
        )
    doc = read_json(cfg_file)
    method = doc.get("method")
    if method is None:
        raise HeadFolderError(
            f"{cfg_file}: no 'method' key, though draftsmith wrote the file (it has "
            f"{sorted(doc)}): it is incomplete; {AGAIN}."
        )
    if not isinstance(method, str) or not method:
        raise HeadFolderError(
            f"{cfg_file}: 'method' is {method!r}, not a method name; write the one string "
            f'save_pretrained recorded (e.g. "eagle3") or {AGAIN}.'
        )
    for key, what in (("config", "the head's settings"), ("target", "the model it was trained on")):
        if not isinstance(doc.get(key), dict):
            raise HeadFolderError(
                f"{cfg_file}: no '{key}' mapping ({what}): the file is incomplete; {AGAIN}."
            )
    return doc


def saved_target(doc: dict, cfg_file: Path) -> TargetInfo:
    """The TargetInfo a checked config.json records."""
    known = {f.name for f in dataclasses.fields(TargetInfo)}
    unknown = sorted(set(doc["target"]) - known)
    if unknown:
        raise HeadFolderError(f"{cfg_file}: 'target' has unknown keys {unknown}; {AGAIN}.")
    return TargetInfo(**doc["target"])


def head_config(cls: Any, doc: dict, cfg_file: Path) -> Any:
    """`cls.config_class` built from a checked config.json's 'config' mapping."""
    config_class = cls.config_class
    known = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(doc["config"]) - known)
    if unknown:
        raise HeadFolderError(
            f"{cfg_file}: 'config' has {unknown[:4]}, which {config_class.__name__} (method "
            f"{cls.method!r}) does not take: 'method' does not match the head; correct 'method' "
            f"or {AGAIN}."
        )
    try:
        return config_class(**doc["config"])
    except (TypeError, ValueError) as e:
        raise HeadFolderError(f"{cfg_file}: its 'config' is not valid ({e}); {AGAIN}.") from None


def check_target(
    saved: TargetInfo,
    target: Any,
    path: str | os.PathLike,
    dims: tuple[str, ...] = ("hidden_size", "vocab_size"),
    allow_other_target: bool = False,
) -> TargetInfo:
    """The TargetInfo a head from `path` keeps on `target`, after refusing a target it was not
    trained on: another size (`dims`) always; another model of the same size unless
    `allow_other_target` (the head then records the target it now sits on)."""
    current = TargetInfo.of(target)
    for name in dims:
        want, have = getattr(saved, name), getattr(current, name)
        if want != have:
            raise HeadMismatchError(
                f"head at {path} was trained for a target with {name}={want} "
                f"({saved.name_or_path!r}), but the target given has {name}={have} "
                f"({current.name_or_path!r}). Load the head onto the model it was trained on "
                "(model=... in the config), or train a new head for this target."
            )
    if not saved.fingerprint or saved.fingerprint == current.fingerprint:
        return saved
    if _older_fingerprint(target) == saved.fingerprint:  # the same model, an earlier id scheme
        return current
    if not allow_other_target:
        raise HeadMismatchError(
            f"head at {path} was trained on {saved.name_or_path!r} (fingerprint "
            f"{saved.fingerprint}), not on the target given, {current.name_or_path!r} "
            f"(fingerprint {current.fingerprint}), a different model of the same size. Load it "
            "onto the model it was trained on, or pass allow_other_target=True "
            "(allow_other_target=true in the config) to use it on this one on purpose."
        )
    log.warning(
        "head at %s was trained on %r; using it on %r as allowed (allow_other_target)",
        path, saved.name_or_path, current.name_or_path,
    )  # fmt: skip
    return current


def _older_fingerprint(target: Any) -> str | None:
    from heads.target import legacy_fingerprint  # heads.target imports heads.base

    model = getattr(target, "model", None)
    return None if model is None else legacy_fingerprint(model)


def open_head(
    cls: Any,
    path: str | os.PathLike,
    target: Any,
    doc: dict | None = None,
    allow_other_target: bool = False,
) -> tuple[Any, TargetInfo]:
    """(config, TargetInfo to keep) for loading the folder `path` as a `cls` head onto `target`,
    after every check on its config.json and on the target (see check_target)."""
    cfg_file = Path(path) / CONFIG_NAME
    doc = read_head_config(path) if doc is None else doc
    if doc["method"] != cls.method:
        raise HeadFolderError(
            f"{cfg_file}: method {doc['method']!r}, but it is being loaded as a {cls.method!r} "
            "head; load it with heads.from_pretrained, which picks the class."
        )
    config = head_config(cls, doc, cfg_file)
    info = check_target(
        saved_target(doc, cfg_file), target, path, cls.target_dims, allow_other_target
    )
    return config, info


def read_safetensors(file: str | os.PathLike) -> dict[str, Tensor]:
    """The tensors of a .safetensors file, or a HeadFolderError naming it."""
    try:
        return load_file(str(file))
    except SafetensorError as e:
        raise HeadFolderError(
            f"{file}: unreadable safetensors ({e}): the file is damaged or was cut short while "
            f"being written; {AGAIN}."
        ) from None


def load_head_tensors(path: str | os.PathLike) -> dict[str, Tensor]:
    file = Path(path) / WEIGHTS_NAME
    if not file.is_file():
        raise HeadFolderError(f"{file} not found: the head folder is incomplete; {AGAIN}.")
    return read_safetensors(file)


def saved_tensor(tensors: dict[str, Tensor], name: str, path: str | os.PathLike) -> Tensor:
    """One tensor a head needs before it can be built (e.g. its d2t vocabulary map)."""
    if name not in tensors:
        raise HeadFolderError(
            f"{Path(path) / WEIGHTS_NAME}: no {name!r} tensor, which the method in config.json "
            f"needs: 'method' does not match the weights, or the file is incomplete; {AGAIN}."
        )
    return tensors[name]


def load_weights(module: nn.Module, tensors: dict[str, Tensor], path: str | os.PathLike) -> None:
    """Copy a folder's tensors into a head built from its config.json: exactly its names and
    shapes, or a HeadFolderError that lists what differs."""
    own = module.state_dict()
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    shapes = sorted(k for k in own if k in tensors and tensors[k].shape != own[k].shape)
    if missing or unexpected or shapes:
        raise HeadFolderError(
            f"{Path(path) / WEIGHTS_NAME}: its tensors do not fit the {type(module).__name__} "
            f"that config.json describes (missing {missing[:3]}, unexpected {unexpected[:3]}, "
            f"other shapes {shapes[:3]}): the two files do not belong together; {AGAIN}."
        )
    module.load_state_dict(tensors, strict=True)
