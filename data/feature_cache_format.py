"""The on-disk ("offline") target-feature cache's folder: its files, their metadata and checks.

The frozen target runs once over the examples; later runs and epochs read its features from disk
instead. A cache folder holds

    shard-00000.safetensors  examples [0, E), shard-00001 examples [E, 2E), ...
    index.json               written last, only once every shard exists

Each shard carries its own JSON metadata (target fingerprint, layers, dtype, example range and a
sha1 of those examples' input_ids + loss_mask), so a killed build resumes: shards already on disk
are kept, the rest computed. Files are written to a per-process tmp name and renamed into place,
so a reader never sees half a shard and concurrent writers of the same shard are harmless.

Inside a shard, examples are concatenated along tokens (``offsets`` ``[E + 1]`` marks their
bounds). Features are stored as ``"hidden"`` ``[N, H]`` / ``"aux"`` ``[N, k*H]`` in float16,
bfloat16 or float32 (a value past float16's 65504 is refused, not stored as inf: see
``data.features.to_feature_dtype``), or as int8 with one symmetric scale per token
(``"hidden.q"`` ``[N, H]`` int8 and ``"hidden.scale"`` ``[N]`` float32).
``FeatureCacheDataset`` dequantises on read: the rest of the code only ever sees float
``"hidden"`` / ``"aux"``.

Built by data/feature_cache_build.py, read by data/feature_cache.py.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from data.dataset import Example
from data.features import META_KEY, FeatureCacheMismatch
from data.paths import cache_root

CACHE_FORMAT = "draftsmith-feature-cache"
CACHE_FORMAT_VERSION = 1
INDEX_FILE = "index.json"
DTYPES = ("float16", "bfloat16", "float32", "int8")
# What makes a shard reusable; "target" (the name) is informational, the fingerprint decides.
SHARD_KEYS = (
    "format_version",
    "fingerprint",
    "layers",
    "dtype",
    "autocast",
    "first",
    "last",
    "examples_sha1",
)


def shard_file(shard: int) -> str:
    return f"shard-{shard:05d}.safetensors"


def example_digests(examples: Sequence[Example]) -> list[bytes]:
    """One sha1 per example over its length, input_ids and loss_mask (as int64)."""
    digests = []
    for example in examples:
        ids = example["input_ids"].to("cpu", torch.int64)
        mask = example["loss_mask"].to("cpu", torch.int64)
        h = hashlib.sha1(len(ids).to_bytes(8, "little"))
        h.update(ids.numpy().tobytes())
        h.update(mask.numpy().tobytes())
        digests.append(h.digest())
    return digests


def join_sha1(digests: Sequence[bytes]) -> str:
    return hashlib.sha1(b"".join(digests)).hexdigest()


def examples_sha1(examples: Sequence[Example]) -> str:
    """A sha1 of a list of examples (tokens, loss masks and order)."""
    return join_sha1(example_digests(examples))


def default_cache_dir(
    fingerprint: str,
    layers: Sequence[int] | None,
    dtype: str,
    data_sha1: str,
    autocast: str | None = None,
) -> Path:
    """``${DRAFTSMITH_CACHE:-~/.cache/draftsmith}/features/<fp>-<layers or last>-<dtype>-<sha1>``
    (``<dtype>`` gets ``+<autocast>`` when the target ran under autocast): a folder per target,
    layer set, dtype, autocast and data, so a change never reuses stale features."""
    root = cache_root()
    tag = "_".join(str(i) for i in layers) if layers else "last"
    dtype = f"{dtype}+{autocast}" if autocast else dtype
    return root / "features" / f"{fingerprint[:12]}-{tag}-{dtype}-{data_sha1[:12]}"


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``x ~ q * scale[:, None]`` with ``|error| <= scale / 2``.

    x: ``[N, D]``; returns q ``[N, D]`` int8 in [-127, 127] and scale ``[N]`` float32
    (``max |row| / 127``; 0 for an all-zero row, whose q is 0)."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / 127  # (N,)
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x / divisor[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[:, None].float()).to(dtype)  # (N, D)


def read_shard_meta(path: str) -> dict | None:
    """A shard's JSON metadata, or None when the file does not exist."""
    if not os.path.exists(path):
        return None
    with safe_open(path, framework="pt") as f:
        raw = (f.metadata() or {}).get(META_KEY)
    if raw is None:
        raise FeatureCacheMismatch(f"{path} is not a draftsmith feature-cache shard; delete it")
    return json.loads(raw)


def check_meta(have: dict, want: dict, keys: Sequence[str], where: str, folder: str) -> None:
    """Raise FeatureCacheMismatch naming the first of ``keys`` on which ``have`` and ``want``
    disagree (keys missing from ``want`` are not checked)."""
    fix = f"delete {folder} or point data.feature_cache elsewhere to build a new cache"
    for key in keys:
        if key not in want or have.get(key) == want[key]:
            continue
        if key == "examples_sha1":
            raise FeatureCacheMismatch(
                f"{where} was built from other examples (sha1 {have.get(key)}, these hash to "
                f"{want[key]}): the data, its split, max_length or chat template changed; {fix}"
            )
        raise FeatureCacheMismatch(
            f"{where} was built with {key}={have.get(key)!r} but this run expects "
            f"{key}={want[key]!r} (cache target {have.get('target')!r}, fingerprint "
            f"{have.get('fingerprint')!r}); {fix}"
        )


def read_index(cache_dir: str | os.PathLike) -> dict:
    path = Path(cache_dir, INDEX_FILE)
    if not path.exists():
        raise FileNotFoundError(
            f"{path} not found: the feature cache in {cache_dir} was never built or its build "
            "did not finish; build it with open_or_build_feature_cache (a killed build resumes)"
        )
    return json.loads(path.read_text())


__all__ = [
    "CACHE_FORMAT",
    "CACHE_FORMAT_VERSION",
    "DTYPES",
    "INDEX_FILE",
    "SHARD_KEYS",
    "check_meta",
    "default_cache_dir",
    "dequantize_int8",
    "example_digests",
    "examples_sha1",
    "join_sha1",
    "quantize_int8",
    "read_index",
    "read_shard_meta",
    "shard_file",
]
