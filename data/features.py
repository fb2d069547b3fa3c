"""In-memory feature cache: run the frozen target once over the examples, reuse across epochs.

``compute_features`` adds ``"hidden"`` ``[T, H]`` (the target's last hidden state after the
final norm) and, when ``layers`` is given, ``"aux"`` ``[T, len(layers) * H]`` to each example.
``save_feature_file`` / ``load_feature_file`` keep them in one safetensors file tagged with the
target's fingerprint and the layer set, so a file built for another target is refused.

The target is duck-typed: anything with ``features(input_ids, attention_mask, layers) -> dict``
(``heads.target.Target`` is one); this module never imports ``heads/``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from data.dataset import FEATURE_KEYS, SEQUENCE_KEYS, Example, collate
from data.errors import FeatureRangeError
from data.paths import atomic_write

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
META_KEY = "draftsmith"


class FeatureCacheMismatch(ValueError):
    """A feature file built for another target, layer set or format."""


def to_feature_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, refusing values ``dtype`` cannot hold (float16 turns anything past
    65504 into inf, and every loss into NaN) and features that are inf/NaN already."""
    if x.numel() == 0:
        return x.to(dtype)
    if not bool(x.isfinite().all()):
        raise FeatureRangeError(
            "the target's hidden states hold inf/NaN (its own dtype overflowed): load the "
            "target in a wider dtype (model.dtype=float32 or bfloat16)."
        )
    peak = float(x.abs().max())
    if dtype.is_floating_point and peak > torch.finfo(dtype).max:
        name = str(dtype).removeprefix("torch.")
        raise FeatureRangeError(
            f"the target's hidden states reach {peak:.3g}, beyond {name}'s range "
            f"({torch.finfo(dtype).max:.5g}): set data.feature_dtype=bfloat16 (the same size, "
            "float32's range) or float32."
        )
    return x.to(dtype)


def length_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Group example indices, longest first, into batches of at most ``batch_tokens`` padded
    tokens (a single longer example gets a batch of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        # Sorted longest first, so the batch's first example sets its padded width.
        if batches and lengths[batches[-1][0]] * (len(batches[-1]) + 1) <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _target_device(target: Any) -> torch.device:
    device = getattr(target, "device", None)
    if device is not None:
        return torch.device(device)
    model = getattr(target, "model", None)
    if model is not None:
        return next(model.parameters()).device
    return torch.device("cpu")


@torch.no_grad()
def compute_features(
    examples: Sequence[Example],
    target: Any,
    layers: Sequence[int] | None = None,
    batch_tokens: int = 4096,
    dtype: torch.dtype = torch.float16,
    progress: bool = True,
) -> list[Example]:
    """Return copies of ``examples`` with ``"hidden"`` (and ``"aux"`` if ``layers``) added, on
    the CPU in ``dtype``. Runs the target on length-sorted, right-padded batches."""
    layers = list(layers) if layers else None
    device = _target_device(target)
    batches = length_batches([len(e["input_ids"]) for e in examples], batch_tokens)
    results: list[Example | None] = [None] * len(examples)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(examples), desc="target features", unit="ex")
    start, tokens = time.perf_counter(), 0
    for indices in batches:
        batch = collate([examples[i] for i in indices])
        input_ids = batch["input_ids"].to(device)  # (B, T)
        attention_mask = batch["attention_mask"].to(device)  # (B, T)
        out = target.features(input_ids, attention_mask, layers)
        for row, i in enumerate(indices):
            length = len(examples[i]["input_ids"])
            example = dict(examples[i])
            # clone() so each example owns its memory instead of a view of the whole batch.
            hidden = to_feature_dtype(out["hidden"][row, :length], dtype)
            example["hidden"] = hidden.to("cpu").clone()  # (T, H)
            if layers:
                aux = to_feature_dtype(out["aux"][row, :length], dtype)
                example["aux"] = aux.to("cpu").clone()  # (T, kH)
            results[i] = example
            tokens += length
        if bar is not None:
            bar.update(len(indices))
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - start
    log.info(
        "target features: %d examples, %d tokens in %.1fs (%.0f tokens/s)",
        len(examples),
        tokens,
        seconds,
        tokens / max(seconds, 1e-9),
    )
    return results  # type: ignore[return-value]


def feature_meta(target: Any, layers: Sequence[int] | None = None) -> dict:
    """The metadata that identifies features: the target's fingerprint and name, the layers."""
    return {
        "fingerprint": str(target.fingerprint),
        "target": str(getattr(target, "name_or_path", "")),
        "layers": list(layers) if layers else None,
    }


def save_feature_file(examples: Sequence[Example], path: str, meta: dict) -> None:
    """Write examples with their features to one safetensors file, atomically.

    Examples are concatenated along tokens (``offsets`` ``[N + 1]`` marks their bounds). The JSON
    metadata holds ``meta`` (at least ``fingerprint`` and ``layers``) plus dtype, counts and
    the format version."""
    if not examples:
        raise ValueError("save_feature_file: no examples to save")
    if "fingerprint" not in meta:
        raise ValueError("save_feature_file: meta needs the target's 'fingerprint'")
    keys = [k for k in (*SEQUENCE_KEYS, *FEATURE_KEYS) if k in examples[0]]
    lengths = torch.tensor([len(e["input_ids"]) for e in examples], dtype=torch.long)
    tensors = {k: torch.cat([e[k] for e in examples]).contiguous() for k in keys}
    tensors["offsets"] = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    full_meta = {
        **meta,
        "layers": list(meta["layers"]) if meta.get("layers") else None,
        "format_version": FORMAT_VERSION,
        "dtype": str(tensors["hidden"].dtype) if "hidden" in tensors else None,
        "num_examples": len(examples),
        "num_tokens": int(lengths.sum()),
    }
    full_meta_json = json.dumps(full_meta)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={META_KEY: full_meta_json}))


def read_feature_meta(path: str) -> dict:
    """The JSON metadata of a feature file."""
    with safe_open(path, framework="pt") as f:
        raw = (f.metadata() or {}).get(META_KEY)
    if raw is None:
        raise FeatureCacheMismatch(f"{path} is not a draftsmith feature file; delete it")
    return json.loads(raw)


def load_feature_file(path: str, expected_meta: dict | None = None) -> list[Example]:
    """Load a feature file; refuse it when its metadata disagrees with ``expected_meta`` (e.g.
    ``feature_meta(target, layers)``) on any key given there."""
    meta = read_feature_meta(path)
    for key, want in (expected_meta or {}).items():
        have = meta.get(key)
        if key == "layers":
            want = list(want) if want else None
        if have != want:
            raise FeatureCacheMismatch(
                f"{path} was built with {key}={have!r} but this run expects {key}={want!r} "
                f"(file fingerprint {meta.get('fingerprint')!r}, target "
                f"{meta.get('target')!r}); delete the file or point the cache elsewhere to "
                "recompute features for this target and layer set"
            )
    if meta.get("format_version") != FORMAT_VERSION:
        raise FeatureCacheMismatch(
            f"{path} has feature format {meta.get('format_version')}, this code reads "
            f"{FORMAT_VERSION}; delete the file to recompute it"
        )
    with safe_open(path, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    bounds = tensors.pop("offsets").tolist()
    # Examples are views into the loaded tensors: no copy, the file's size in memory once.
    return [
        {k: v[bounds[n] : bounds[n + 1]] for k, v in tensors.items()}
        for n in range(len(bounds) - 1)
    ]


class LazyFeatureDataset(torch.utils.data.Dataset):
    """Examples whose target features are computed the first time each one is read, then kept.

    The first epoch pays one target forward per example (unpadded, on the target's device) and
    every later epoch reuses the stored features, so a short run (`trainer.max_steps=3`) only
    computes what it reads. Use it with `num_workers=0`: the target lives in this process.
    """

    def __init__(
        self,
        examples: Sequence[Example],
        target: Any,
        layers: Sequence[int] | None = None,
        dtype: torch.dtype = torch.float16,
    ) -> None:
        self.examples = list(examples)
        self.target, self.layers, self.dtype = target, list(layers) if layers else None, dtype
        self._cache: dict[int, Example] = {}

    def __len__(self) -> int:
        return len(self.examples)

    def lengths(self) -> list[int]:
        return [len(e["input_ids"]) for e in self.examples]

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    @torch.no_grad()
    def __getitem__(self, index: int) -> Example:
        if index not in self._cache:
            example = self.examples[index]
            device = _target_device(self.target)
            ids = example["input_ids"][None].to(device)  # (1, T)
            out = self.target.features(ids, torch.ones_like(ids), self.layers)
            cached = dict(example)
            for key in FEATURE_KEYS:
                if key in out and (key == "hidden" or self.layers):
                    cached[key] = to_feature_dtype(out[key][0], self.dtype).to("cpu").clone()
            self._cache[index] = cached
        return self._cache[index]
