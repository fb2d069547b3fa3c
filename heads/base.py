"""What every draft head shares: the training protocol, the loss output, and checkpoint I/O.

A head folder is `config.json` (the head's config dataclass plus the method name and the target
it was trained on) and `model.safetensors`. Loading refuses a folder whose recorded target does not
match the target it is loaded onto, because a head silently attached to the wrong model proposes
garbage and looks like a bad head rather than a bad load.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass
class LossOutput:
    """A differentiable scalar loss plus statistics that add up across batches and ranks.

    `stats` maps a name (e.g. "head0/top1") to a float tensor `[sum, count]`; the training loop
    sums these and reports `sum / count`, so means stay exact under padding and sharding.
    """

    loss: Tensor
    stats: dict[str, Tensor] = field(default_factory=dict)


@runtime_checkable
class DraftHead(Protocol):
    """The seam between the training loop and any method (Medusa, EAGLE, EAGLE-3)."""

    method: str

    def feature_layers(self) -> list[int] | None:
        """HF `hidden_states` indices the head needs as "aux" features, or None."""

    def loss(self, batch: dict[str, Tensor], features: dict[str, Tensor]) -> LossOutput:
        """Loss and statistics for one batch (see data/ for the batch layout)."""

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write config.json and model.safetensors."""


@dataclass
class TargetInfo:
    """What a head records about the target it was trained on."""

    name_or_path: str = ""
    hidden_size: int = 0
    vocab_size: int = 0
    num_layers: int = 0
    fingerprint: str = ""

    @classmethod
    def of(cls, target: Any) -> TargetInfo:
        return cls(
            name_or_path=str(target.name_or_path),
            hidden_size=int(target.hidden_size),
            vocab_size=int(target.vocab_size),
            num_layers=int(target.num_layers),
            fingerprint=str(target.fingerprint),
        )


class HeadMismatchError(ValueError):
    """A head checkpoint does not fit the target it is being loaded onto."""


def check_target(saved: TargetInfo, target: Any, path: str | os.PathLike) -> None:
    """Refuse a head trained for a different target, naming what differs and what to do."""
    current = TargetInfo.of(target)
    for name in ("hidden_size", "vocab_size"):
        want, have = getattr(saved, name), getattr(current, name)
        if want != have:
            raise HeadMismatchError(
                f"head at {path} was trained for a target with {name}={want} "
                f"({saved.name_or_path!r}), but the target given has {name}={have} "
                f"({current.name_or_path!r}). Load the head onto the model it was trained on "
                "(model=... in the config), or train a new head for this target."
            )


def atomic_save_dir(path: str | os.PathLike, write: Any) -> Path:
    """Call `write(tmp_dir)` then move tmp_dir to `path` in one rename (old `path` replaced)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        write(tmp)
        _usual_permissions(tmp)
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _usual_permissions(folder: Path) -> None:
    """mkdtemp makes a 0700 folder (and some writers 0600 files): give the folder and its files
    the modes a plain mkdir/open would have under the umask, so other users (a serving engine's
    account) can read a head."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for item in folder.rglob("*"):
        item.chmod((0o777 if item.is_dir() else 0o666) & ~umask)


def save_head(
    path: str | os.PathLike, method: str, config: Any, target: TargetInfo, tensors: dict
) -> None:
    """Write a head folder atomically: config.json (method, config, target) + model.safetensors."""
    doc = {
        "method": method,
        "draftsmith_version": "0.1.0",
        "config": dataclasses.asdict(config),
        "target": dataclasses.asdict(target),
    }
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}

    def write(tmp: Path) -> None:
        (tmp / CONFIG_NAME).write_text(json.dumps(doc, indent=2) + "\n")
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt", "method": method})

    atomic_save_dir(path, write)


def is_foreign_head(path: str | os.PathLike) -> bool:
    """True for a folder whose config.json was not written by draftsmith (no "method" key): a
    serving engine's layout, for heads.interop to import."""
    cfg_file = Path(path) / CONFIG_NAME
    return cfg_file.is_file() and "method" not in json.loads(cfg_file.read_text())


def read_head_config(path: str | os.PathLike) -> dict:
    path = Path(path)
    cfg_file = path / CONFIG_NAME
    if not cfg_file.is_file():
        raise FileNotFoundError(
            f"{cfg_file} not found: a head folder holds config.json and model.safetensors "
            "(written by save_pretrained, e.g. <run dir>/head/)."
        )
    doc = json.loads(cfg_file.read_text())
    if "method" not in doc:
        raise ValueError(f"{cfg_file} has no 'method' key: it was not written by draftsmith.")
    return doc


def open_head(path: str | os.PathLike, target: Any, doc: dict | None = None):
    """A head folder's config.json (unless already read) and its TargetInfo, after refusing a
    target the head was not trained for."""
    doc = doc or read_head_config(path)
    info = TargetInfo(**doc["target"])
    check_target(info, target, path)
    return doc, info


def load_head_tensors(path: str | os.PathLike) -> dict[str, Tensor]:
    return load_file(str(Path(path) / WEIGHTS_NAME))


def warm_start(module: torch.nn.Module, tensors: dict[str, Tensor], source: str) -> list[str]:
    """Copy a saved head's tensors (read from `source`) into `module` (a freshly built head, or
    the part of one that has the saved head's layout) before training, e.g. Medusa-1 heads for
    Medusa-2's joint stage. Every saved tensor must exist in `module` with the same shape;
    returns the names `module` has that the file does not (they keep their initial values).
    """
    own = module.state_dict()
    unexpected = sorted(k for k in tensors if k not in own)
    wrong = sorted(k for k in tensors if k in own and own[k].shape != tensors[k].shape)
    if unexpected or wrong:
        shapes = [
            f"{k}: saved {tuple(tensors[k].shape)}, here {tuple(own[k].shape)}" for k in wrong
        ]
        raise HeadMismatchError(
            f"init_from={source}: its tensors do not fit this head (not in this head: "
            f"{unexpected[:4]}; other shapes: {shapes[:4]}). Start from a head of the same method "
            "family and sizes (num_heads, num_layers, draft_vocab_size), or drop init_from."
        )
    module.load_state_dict(tensors, strict=False)
    return sorted(set(own) - set(tensors))


def masked_shift(mask: Tensor, shift: int) -> Tensor:
    """`out[:, t] = mask[:, t + shift]`, 0 past the end: positions with a label `shift` ahead."""
    out = torch.zeros_like(mask)
    if shift < mask.shape[1]:
        out[:, : mask.shape[1] - shift] = mask[:, shift:]
    return out


def stat_pair(value, count, device) -> Tensor:
    """A `[sum, count]` statistic (see LossOutput)."""
    value = torch.as_tensor(value, dtype=torch.float32, device=device).reshape(())
    return torch.stack([value, torch.tensor(float(count), device=device)])
