"""On-disk ("offline") target-feature cache: sharded, resumable, checked against its target.

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
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from data.dataset import FEATURE_KEYS, Example
from data.errors import FeatureRangeError
from data.features import META_KEY, FeatureCacheMismatch, compute_features, feature_meta
from data.paths import atomic_write, cache_root, tmp_marker

log = logging.getLogger(__name__)

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


def _join_sha1(digests: Sequence[bytes]) -> str:
    return hashlib.sha1(b"".join(digests)).hexdigest()


def examples_sha1(examples: Sequence[Example]) -> str:
    """A sha1 of a list of examples (tokens, loss masks and order)."""
    return _join_sha1(example_digests(examples))


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


# ---- int8 ---------------------------------------------------------------------------------


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


# ---- writing ------------------------------------------------------------------------------


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


def read_shard_meta(path: str) -> dict | None:
    """A shard's JSON metadata, or None when the file does not exist."""
    if not os.path.exists(path):
        return None
    with safe_open(path, framework="pt") as f:
        raw = (f.metadata() or {}).get(META_KEY)
    if raw is None:
        raise FeatureCacheMismatch(f"{path} is not a draftsmith feature-cache shard; delete it")
    return json.loads(raw)


def _check_meta(have: dict, want: dict, keys: Sequence[str], where: str, folder: str) -> None:
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


def _check_build_args(dtype: str, examples_per_shard: int, rank: int, world_size: int) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"feature cache dtype={dtype!r}; use one of {list(DTYPES)}")
    if examples_per_shard < 1:
        raise ValueError(f"examples_per_shard={examples_per_shard}; use a positive int")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} with world_size={world_size}: need 0 <= rank < world_size")


# ---- building -----------------------------------------------------------------------------


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
            _check_meta(have, {"autocast": None, **metas[s]}, SHARD_KEYS, path, cache_dir)
    mine = len(range(rank, len(metas), world_size))
    log.info("feature cache %s, rank %d: %d of %d shards to do", cache_dir, rank, len(todo), mine)
    _write_shards(examples, target, cache_dir, metas, todo, batch_tokens, progress)
    if barrier is not None:
        barrier()
        if rank == 0:
            _write_index(cache_dir, base, metas, _join_sha1(digests), examples_per_shard)
        barrier()
        return read_index(cache_dir)
    if all(os.path.exists(os.path.join(cache_dir, shard_file(s))) for s in range(len(metas))):
        return _write_index(cache_dir, base, metas, _join_sha1(digests), examples_per_shard)
    return None


def _shard_meta(base: dict, examples, digests, first: int, end: int) -> dict:
    return {
        **base,
        "first": first,
        "last": end - 1,
        "num_examples": end - first,
        "num_tokens": sum(len(e["input_ids"]) for e in examples[first:end]),
        "examples_sha1": _join_sha1(digests[first:end]),
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
                progress=False,
                autocast=meta.get("autocast"),
            )
        except FeatureRangeError as err:
            raise FeatureRangeError(f"feature cache {cache_dir}, shard {s}: {err}") from None
        tensors = _shard_tensors(features, dtype)
        path = os.path.join(cache_dir, shard_file(s))
        metadata = {META_KEY: json.dumps(meta)}
        atomic_write(path, lambda tmp, t=tensors, m=metadata: save_file(t, tmp, metadata=m))
        if bar is not None:
            bar.update(meta["num_examples"])
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
        _check_meta(have, want, SHARD_KEYS, path, cache_dir)
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


def read_index(cache_dir: str | os.PathLike) -> dict:
    path = Path(cache_dir, INDEX_FILE)
    if not path.exists():
        raise FileNotFoundError(
            f"{path} not found: the feature cache in {cache_dir} was never built or its build "
            "did not finish; build it with open_or_build_feature_cache (a killed build resumes)"
        )
    return json.loads(path.read_text())


# ---- reading ------------------------------------------------------------------------------


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
        _check_meta(index, want, keys, where, self.cache_dir)
        data = {"num_examples": len(self.examples), "examples_sha1": examples_sha1(self.examples)}
        _check_meta(index, data, ["num_examples", "examples_sha1"], where, self.cache_dir)
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
