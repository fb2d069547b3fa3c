"""Building the on-disk feature cache (data/feature_cache_format.py has the folder's layout):
every missing shard of this rank computed by the frozen target and written atomically, then the
index once every shard exists. A killed build resumes, keeping the shards already on disk."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from data.dataset import FEATURE_KEYS, Example
from data.errors import FeatureRangeError
from data.feature_cache_format import (
    CACHE_FORMAT,
    CACHE_FORMAT_VERSION,
    DTYPES,
    INDEX_FILE,
    SHARD_KEYS,
    check_meta,
    example_digests,
    join_sha1,
    quantize_int8,
    read_index,
    read_shard_meta,
    shard_file,
)
from data.features import META_KEY, compute_features, feature_meta
from data.paths import atomic_write, tmp_marker

log = logging.getLogger(__name__)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _remove_stale_tmp_files(cache_dir: str) -> None:
    """Delete tmp files left by killed builds on this host. Tmp files of live processes or of
    other hosts are left alone; nothing ever reads a tmp file, so they are harmless anyway."""
    marker = tmp_marker()
    for name in os.listdir(cache_dir):
        _, found, pid = name.rpartition(marker)
        if found and pid.isdigit() and not _pid_alive(int(pid)):
            log.info("removing %s, left by a killed feature-cache build", name)
            Path(cache_dir, name).unlink(missing_ok=True)


def _shard_tensors(features: Sequence[Example], dtype: str) -> dict[str, torch.Tensor]:
    lengths = torch.tensor([len(e["input_ids"]) for e in features], dtype=torch.long)
    tensors = {"offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])}
    for key in FEATURE_KEYS:
        if key not in features[0]:
            continue
        x = torch.cat([e[key] for e in features])  # (N, D)
        if dtype == "int8":
            tensors[f"{key}.q"], tensors[f"{key}.scale"] = quantize_int8(x)
        else:
            tensors[key] = x.contiguous()
    return tensors


def _check_build_args(dtype: str, examples_per_shard: int, rank: int, world_size: int) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"feature cache dtype={dtype!r}; use one of {list(DTYPES)}")
    if examples_per_shard < 1:
        raise ValueError(f"examples_per_shard={examples_per_shard}; use a positive int")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} with world_size={world_size}: need 0 <= rank < world_size")


def build_feature_cache(
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
    autocast: str | None = None,
) -> dict | None:
    """Compute and write every missing shard of this rank, then the index; returns the index.

    Shard s holds examples ``[s * examples_per_shard, (s + 1) * examples_per_shard)`` and is
    computed by rank ``s % world_size``; shards already on disk with matching metadata are
    kept, ones built for another target, layer set, dtype or data raise FeatureCacheMismatch.

    barrier: accelerate's ``wait_for_everyone`` (or ``torch.distributed.barrier``) when several
    processes share the work; rank 0 then writes ``index.json`` between two barriers and every
    rank returns it. The shards must be on a filesystem all ranks see. Without a barrier, the
    call that finds every shard on disk writes the index; a call that does not (another rank's
    shards are still missing) returns None.

    autocast: run the target under ``torch.autocast`` in this dtype ("bfloat16"); recorded in
    the metadata (caches built without it record nothing and read as None).
    """
    _check_build_args(dtype, examples_per_shard, rank, world_size)
    cache_dir = str(cache_dir)
    os.makedirs(cache_dir, exist_ok=True)
    _remove_stale_tmp_files(cache_dir)
    digests = example_digests(examples)
    base = {
        "format": CACHE_FORMAT,
        "format_version": CACHE_FORMAT_VERSION,
        **feature_meta(target, layers),
        "dtype": dtype,
        **({"autocast": autocast} if autocast else {}),
    }
    metas = [
        _shard_meta(base, examples, digests, first, min(first + examples_per_shard, len(examples)))
        for first in range(0, len(examples), examples_per_shard)
    ]
    todo = []
    for s in range(rank, len(metas), world_size):
        path = os.path.join(cache_dir, shard_file(s))
        have = read_shard_meta(path)
        if have is None:
            todo.append(s)
        else:
            check_meta(have, {"autocast": None, **metas[s]}, SHARD_KEYS, path, cache_dir)
    mine = len(range(rank, len(metas), world_size))
    log.info("feature cache %s, rank %d: %d of %d shards to do", cache_dir, rank, len(todo), mine)
    _write_shards(examples, target, cache_dir, metas, todo, batch_tokens, progress)
    if barrier is not None:
        barrier()
        if rank == 0:
            _write_index(cache_dir, base, metas, join_sha1(digests), examples_per_shard)
        barrier()
        return read_index(cache_dir)
    if all(os.path.exists(os.path.join(cache_dir, shard_file(s))) for s in range(len(metas))):
        return _write_index(cache_dir, base, metas, join_sha1(digests), examples_per_shard)
    return None


def _shard_meta(base: dict, examples, digests, first: int, end: int) -> dict:
    return {
        **base,
        "first": first,
        "last": end - 1,
        "num_examples": end - first,
        "num_tokens": sum(len(e["input_ids"]) for e in examples[first:end]),
        "examples_sha1": join_sha1(digests[first:end]),
    }


def _write_shards(examples, target, cache_dir, metas, todo, batch_tokens, progress) -> None:
    bar = None
    if progress and todo:
        from tqdm.auto import tqdm

        total = sum(metas[s]["num_examples"] for s in todo)
        bar = tqdm(total=total, desc="feature cache", unit="ex")
    for s in todo:
        meta = metas[s]
        dtype = meta["dtype"]
        # int8 is quantised from float32; the float dtypes are cast once, like the memory cache.
        compute_dtype = torch.float32 if dtype == "int8" else getattr(torch, dtype)
        try:  # refuses features the dtype cannot hold, before any shard of them is written
            features = compute_features(
                examples[meta["first"] : meta["last"] + 1],
                target,
                meta["layers"],
                batch_tokens=batch_tokens,
                dtype=compute_dtype,
                progress=bar if bar is not None else False,  # advanced batch by batch
                autocast=meta.get("autocast"),
            )
        except FeatureRangeError as err:
            raise FeatureRangeError(f"feature cache {cache_dir}, shard {s}: {err}") from None
        tensors = _shard_tensors(features, dtype)
        path = os.path.join(cache_dir, shard_file(s))
        metadata = {META_KEY: json.dumps(meta)}
        atomic_write(path, lambda tmp, t=tensors, m=metadata: save_file(t, tmp, metadata=m))
    if bar is not None:
        bar.close()


def _write_index(cache_dir: str, base: dict, metas, data_sha1: str, per_shard: int) -> dict:
    """Check that every shard is on disk and matches, then write index.json atomically."""
    shards = []
    for s, want in enumerate(metas):
        path = os.path.join(cache_dir, shard_file(s))
        have = read_shard_meta(path)
        if have is None:
            raise FileNotFoundError(
                f"{path} is missing after every rank finished: its rank failed or the ranks do "
                "not share this folder; rerun the build (it resumes) on a shared filesystem"
            )
        check_meta(have, want, SHARD_KEYS, path, cache_dir)
        shards.append(
            {
                "file": shard_file(s),
                "first": want["first"],
                "last": want["last"],
                "tokens": want["num_tokens"],
                "bytes": os.path.getsize(path),
            }
        )
    tokens = sum(s["tokens"] for s in shards)
    index = {
        **base,
        "num_examples": sum(m["num_examples"] for m in metas),
        "num_tokens": tokens,
        "examples_sha1": data_sha1,
        "examples_per_shard": per_shard,
        "shards": shards,
        "bytes_per_token": sum(s["bytes"] for s in shards) / tokens if tokens else 0.0,
    }
    path = os.path.join(cache_dir, INDEX_FILE)
    text = json.dumps(index, indent=1)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))
    log.info(
        "feature cache %s: %d examples, %d tokens, %.0f bytes/token",
        cache_dir,
        index["num_examples"],
        tokens,
        index["bytes_per_token"],
    )
    return index


__all__ = ["build_feature_cache"]
