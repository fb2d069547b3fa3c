"""The on-disk ("offline") target-feature cache: open it, building whatever it lacks
(data/feature_cache_build.py), and read examples with their features from it, checked against
the target, layers, dtype and examples they were computed for. The folder's layout and metadata:
data/feature_cache_format.py.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from data.dataset import FEATURE_KEYS, Example
from data.feature_cache_build import build_feature_cache
from data.feature_cache_format import (
    CACHE_FORMAT,
    CACHE_FORMAT_VERSION,
    INDEX_FILE,
    check_meta,
    dequantize_int8,
    examples_sha1,
    read_index,
)
from data.features import FeatureCacheMismatch, feature_meta


class FeatureCacheDataset(torch.utils.data.Dataset):
    """Examples with their target features read from an on-disk feature cache.

    Same interface as ``LazyFeatureDataset``: ``dataset[i]`` is ``examples[i]`` plus
    ``"hidden"`` ``[T, H]`` (and ``"aux"`` ``[T, k*H]``). The index is checked against
    ``expected_meta`` (e.g. ``feature_meta(target, layers)`` plus ``"dtype"``: every key but the
    informational ``"target"`` name) and against a sha1 of ``examples``. Only the requested rows
    are read, through at most ``max_open_shards`` memory-mapped shards, so a cache larger than
    RAM still trains. int8 features are dequantised to ``dequantize_to``.
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike,
        examples: Sequence[Example],
        expected_meta: dict | None = None,
        dequantize_to: torch.dtype = torch.float16,
        max_open_shards: int = 4,
    ) -> None:
        self.cache_dir = str(cache_dir)
        self.examples = list(examples)
        self.dequantize_to, self.max_open_shards = dequantize_to, max_open_shards
        self.index = read_index(self.cache_dir)
        self._check(expected_meta or {})
        self._firsts = [shard["first"] for shard in self.index["shards"]]
        self._offsets: dict[int, list[int]] = {}
        self._handles: OrderedDict[int, Any] = OrderedDict()
        self._pid = os.getpid()

    def _check(self, expected: dict) -> None:
        where = os.path.join(self.cache_dir, INDEX_FILE)
        index = self.index
        version = index.get("format_version")
        if index.get("format") != CACHE_FORMAT or version != CACHE_FORMAT_VERSION:
            raise FeatureCacheMismatch(
                f"{where} has format {index.get('format')!r} version {version!r}, this code "
                f"reads {CACHE_FORMAT!r} version {CACHE_FORMAT_VERSION}; delete "
                f"{self.cache_dir} to rebuild it"
            )
        keys = [k for k in expected if k != "target"]
        want = {**expected, "layers": list(expected["layers"]) if expected.get("layers") else None}
        check_meta(index, want, keys, where, self.cache_dir)
        data = {"num_examples": len(self.examples), "examples_sha1": examples_sha1(self.examples)}
        check_meta(index, data, ["num_examples", "examples_sha1"], where, self.cache_dir)
        for shard in index["shards"]:
            if not os.path.exists(os.path.join(self.cache_dir, shard["file"])):
                raise FileNotFoundError(
                    f"{shard['file']} is listed in {where} but missing; rebuild the cache "
                    "(open_or_build_feature_cache recomputes only missing shards)"
                )

    def __len__(self) -> int:
        return len(self.examples)

    def lengths(self) -> list[int]:
        return [len(e["input_ids"]) for e in self.examples]

    @property
    def bytes_per_token(self) -> float:
        return float(self.index["bytes_per_token"])

    def __getstate__(self) -> dict:
        # DataLoader workers (spawned) reopen the shards themselves.
        return {**self.__dict__, "_handles": OrderedDict()}

    def _shard(self, s: int) -> Any:
        """The open safe_open handle of shard s (least recently used ones get closed)."""
        if self._pid != os.getpid():  # a forked worker: do not share the parent's handles
            self._handles, self._pid = OrderedDict(), os.getpid()
        if s in self._handles:
            self._handles.move_to_end(s)
            return self._handles[s]
        path = os.path.join(self.cache_dir, self.index["shards"][s]["file"])
        handle = safe_open(path, framework="pt")
        if s not in self._offsets:
            self._offsets[s] = handle.get_tensor("offsets").tolist()
        self._handles[s] = handle
        while len(self._handles) > self.max_open_shards:
            self._handles.popitem(last=False)
        return handle

    def __getitem__(self, index: int) -> Example:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} examples")
        s = bisect_right(self._firsts, index) - 1
        handle = self._shard(s)
        local = index - self._firsts[s]
        start, end = self._offsets[s][local], self._offsets[s][local + 1]
        example = dict(self.examples[index])
        if end - start != len(example["input_ids"]):
            raise FeatureCacheMismatch(
                f"{self.index['shards'][s]['file']} in {self.cache_dir} holds {end - start} "
                f"tokens for example {index}, which has {len(example['input_ids'])}; the shard "
                "is corrupt: delete it and rebuild"
            )
        names = set(handle.keys())
        for key in FEATURE_KEYS:
            if key in names:
                example[key] = handle.get_slice(key)[start:end]  # (T, D)
            elif f"{key}.q" in names:
                q = handle.get_slice(f"{key}.q")[start:end]
                scale = handle.get_slice(f"{key}.scale")[start:end]
                example[key] = dequantize_int8(q, scale, self.dequantize_to)  # (T, D)
        return example


def _is_complete(cache_dir: str | os.PathLike) -> bool:
    """index.json exists and so does every shard it lists."""
    if not Path(cache_dir, INDEX_FILE).exists():
        return False
    return all(Path(cache_dir, s["file"]).exists() for s in read_index(cache_dir)["shards"])


def open_or_build_feature_cache(
    examples: Sequence[Example],
    target: Any,
    cache_dir: str | os.PathLike,
    layers: Sequence[int] | None = None,
    dtype: str = "float16",
    examples_per_shard: int = 256,
    rank: int = 0,
    world_size: int = 1,
    barrier: Callable[[], None] | None = None,
    progress: bool = True,
    batch_tokens: int = 4096,
    dequantize_to: torch.dtype = torch.float16,
    autocast: str | None = None,
) -> FeatureCacheDataset:
    """Build whatever the cache in ``cache_dir`` lacks, then open it (see build_feature_cache).

    With one process and a finished cache this only checks and opens it. Several processes
    (``world_size > 1``) need a ``barrier`` and always go through the build, so that every rank
    calls the barrier equally often."""
    if world_size > 1 and barrier is None:
        raise ValueError(
            "open_or_build_feature_cache: world_size > 1 needs a barrier (accelerate's "
            "wait_for_everyone); or build with world_size=1 on every process"
        )
    if barrier is not None or not _is_complete(cache_dir):
        build_feature_cache(
            examples,
            target,
            cache_dir,
            layers,
            dtype,
            examples_per_shard,
            rank,
            world_size,
            barrier,
            progress,
            batch_tokens,
            autocast,
        )
    expected = {**feature_meta(target, layers), "dtype": dtype, "autocast": autocast}
    return FeatureCacheDataset(cache_dir, examples, expected, dequantize_to)


__all__ = ["FeatureCacheDataset", "open_or_build_feature_cache"]
