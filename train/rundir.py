"""The run directory: what train.py writes there, under which names, and how tools read it back.

    config.yaml        the resolved config the run trains with (written once resume agreed)
    data_stats.json    the training data's size, for model cards
    metrics.jsonl      one JSON record per logged step (train/tracking.py)
    wandb_run_id       the W&B run a resumed run appends to
    checkpoints/       step_<N>/ folders to resume from (train/checkpoint/folder.py)
    head/              the final head: a save_pretrained folder plus manifest.json
    best_head/         the head with the best `trainer.best_metric`, with its own best.json
    best.json          a copy of best_head/best.json: metric, value, step

Every folder the run keeps (checkpoints, head/, best_head/) ends with `manifest.json`, the size
and sha256 of each file in it, written last inside the folder's atomic rename; a reader checks a
folder against it before trusting it. eval/ and scripts/ read runs through this module only.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from data.errors import DraftsmithError
from heads.base import CONFIG_NAME, restore_interrupted_swap

CONFIG_FILE = "config.yaml"
DATA_STATS = "data_stats.json"
METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_run_id"
CHECKPOINTS = "checkpoints"
CHECKPOINT_HEADS = "checkpoint_heads"  # head folders made from checkpoints (train.checkpoint)
HEAD_DIR = "head"
BEST_DIR = "best_head"
BEST_FILE = "best.json"
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "draftsmith-manifest-1"


class RunDirError(DraftsmithError):
    """A file of a run directory is missing or damaged, and nothing intact can replace it."""


# ---- manifests ----------------------------------------------------------------------------


def file_sha256(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(folder: str | os.PathLike) -> None:
    """Record the size and sha256 of every file under `folder` in `folder/manifest.json`.
    Call it last, on the temporary folder, before the folder is renamed into place."""
    folder = Path(folder)
    files = {}
    for item in sorted(folder.rglob("*")):
        if item.is_file() and item.name != MANIFEST_FILE:
            name = item.relative_to(folder).as_posix()
            files[name] = {"bytes": item.stat().st_size, "sha256": file_sha256(item)}
    doc = {"format": MANIFEST_FORMAT, "files": files}
    (folder / MANIFEST_FILE).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def manifest_problems(folder: str | os.PathLike) -> list[str]:
    """What is wrong with `folder` against its manifest, as short phrases; [] when intact.
    A folder without a manifest yields ["no manifest.json"]."""
    folder = Path(folder)
    try:
        doc = json.loads((folder / MANIFEST_FILE).read_text())
        files = doc["files"]
    except FileNotFoundError:
        return [f"no {MANIFEST_FILE}"]
    except (ValueError, KeyError, TypeError):
        return [f"{MANIFEST_FILE} is unreadable"]
    problems = []
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != want["bytes"]:
            problems.append(f"{name} has {path.stat().st_size} bytes, not {want['bytes']}")
        elif file_sha256(path) != want["sha256"]:
            problems.append(f"{name} does not match its sha256")
    return problems


# ---- small durable writes -------------------------------------------------------------------


def write_json_atomic(path: str | os.PathLike, doc: Any) -> None:
    """Write JSON to a temporary file, fsync it, rename it over `path`, fsync the folder."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(doc) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json(path: str | os.PathLike) -> Any | None:
    """The JSON document at `path`, or None when it is missing, empty or torn."""
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, ValueError):
        return None


# ---- the run's config and heads ----------------------------------------------------------


def write_run_config(run_dir: str | os.PathLike, config: Mapping[str, Any]) -> None:
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(dict(config), sort_keys=False, allow_unicode=True)
    (Path(run_dir) / CONFIG_FILE).write_text(text)


def read_run_config(run_dir: str | os.PathLike) -> dict:
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: give the run dir train.py wrote (outputs/<date>/<time>)."
        )
    return yaml.safe_load(path.read_text()) or {}


def kept_head(run_dir: str | os.PathLike) -> Path | None:
    """The head a run keeps: best_head when an evaluator chose one, else the final head; None
    when the run saved neither."""
    for name in (BEST_DIR, HEAD_DIR):
        folder = Path(run_dir) / name
        restore_interrupted_swap(folder)
        if (folder / CONFIG_NAME).is_file():
            return folder
    return None


def check_kept_head(run_dir: str | os.PathLike) -> Path | None:
    """`kept_head`, after checking it against its manifest (folders without one pass)."""
    folder = kept_head(run_dir)
    if folder is None:
        return None
    problems = [p for p in manifest_problems(folder) if p != f"no {MANIFEST_FILE}"]
    if problems:
        raise RunDirError(
            f"{folder} is damaged ({'; '.join(problems[:3])}): do not use it; retrain, or resume "
            f"the run after deleting {folder.name}/ to save a new one."
        )
    return folder


# ---- the target a run trained on ---------------------------------------------------------


def target_config(model: Mapping[str, Any]):
    """The TargetConfig of a `model:` config section (conf/model/*.yaml or a run's config.yaml):
    its Hydra `_target_` key is dropped and the rest becomes the dataclass."""
    from heads.target import TargetConfig

    return TargetConfig(**{k: v for k, v in dict(model).items() if k != "_target_"})


def load_target_config(model: Mapping[str, Any]):
    """Load a target from a `model:` config section (see target_config)."""
    from heads.target import load_target

    return load_target(target_config(model))


def conf_target_config(name: str):
    """The TargetConfig of a conf/model option by name (e.g. "smollm2_135m"), its
    interpolations (`${oc.env:...}`) resolved."""
    from omegaconf import OmegaConf

    from data.paths import resolve_path

    path = resolve_path(f"conf/model/{name}.yaml")
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path} not found: give a conf/model option name (--model).")
    return target_config(OmegaConf.to_container(OmegaConf.load(path), resolve=True))


def load_conf_target(name: str):
    """Load the target of a conf/model option by name (see conf_target_config)."""
    from heads.target import load_target

    return load_target(conf_target_config(name))


def load_run_target(run_dir: str | os.PathLike):
    """The target a training run used, from its config.yaml."""
    model = read_run_config(run_dir).get("model")
    if not model:
        raise RunDirError(f"{Path(run_dir) / CONFIG_FILE} has no model section; give --model.")
    return load_target_config(model)


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat
