"""In-memory feature cache: run the frozen target once over the examples, reuse across epochs.

``compute_features`` adds ``"hidden"`` ``[T, H]`` (the target's last hidden state after the
final norm) and, when ``layers`` is given, ``"aux"`` ``[T, len(layers) * H]`` to each example;
``LazyFeatureDataset`` computes them per example on first read. The on-disk cache is
data/feature_cache.py (``feature_meta`` and ``META_KEY`` tag its shards).

``autocast="bfloat16"`` runs the target's matrix products in bfloat16 under ``torch.autocast``
(weights stay float32; 1.7x faster on an AVX-512-BF16 CPU, features within about 1% of float32's,
docs/reports/2026-12-01-throughput/throughput.md). It changes the features, so the disk cache
records it.

The target is duck-typed: anything with ``features(input_ids, attention_mask, layers) -> dict``
(``heads.target.Target`` is one); this module never imports ``heads/``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from data.dataset import FEATURE_KEYS, Example, collate
from data.errors import FeatureRangeError

log = logging.getLogger(__name__)

META_KEY = "draftsmith"
AUTOCAST_DTYPES = ("bfloat16", "float16")


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


def target_autocast(device: torch.device, autocast: str | None):
    """A context that runs the target's forward under ``torch.autocast`` in ``autocast``'s
    dtype on ``device``'s type, or does nothing when ``autocast`` is None."""
    if autocast is None:
        return contextlib.nullcontext()
    if autocast not in AUTOCAST_DTYPES:
        raise ValueError(f"autocast={autocast!r}; use one of {list(AUTOCAST_DTYPES)} or None")
    return torch.autocast(device.type, dtype=getattr(torch, autocast))


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
    progress: bool | Any = True,
    autocast: str | None = None,
) -> list[Example]:
    """Return copies of ``examples`` with ``"hidden"`` (and ``"aux"`` if ``layers``) added, on
    the CPU in ``dtype``. Runs the target on length-sorted, right-padded batches (under
    ``torch.autocast`` in the ``autocast`` dtype when it is set). ``progress``: True for a bar
    of its own, or a caller's bar (anything with ``update(n)``) to advance batch by batch."""
    layers = list(layers) if layers else None
    device = _target_device(target)
    batches = length_batches([len(e["input_ids"]) for e in examples], batch_tokens)
    results: list[Example | None] = [None] * len(examples)
    bar, own_bar = (progress, False) if hasattr(progress, "update") else (None, bool(progress))
    if own_bar:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(examples), desc="target features", unit="ex")
    start, tokens = time.perf_counter(), 0
    for indices in batches:
        batch = collate([examples[i] for i in indices])
        input_ids = batch["input_ids"].to(device)  # (B, T)
        attention_mask = batch["attention_mask"].to(device)  # (B, T)
        with target_autocast(device, autocast):
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
    if own_bar:
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
        autocast: str | None = None,
    ) -> None:
        self.examples = list(examples)
        self.target, self.layers, self.dtype = target, list(layers) if layers else None, dtype
        self.autocast = autocast
        target_autocast(torch.device("cpu"), autocast)  # refuses an unknown dtype now
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
            with target_autocast(device, self.autocast):
                out = self.target.features(ids, torch.ones_like(ids), self.layers)
            cached = dict(example)
            for key in FEATURE_KEYS:
                if key in out and (key == "hidden" or self.layers):
                    cached[key] = to_feature_dtype(out[key][0], self.dtype).to("cpu").clone()
            self._cache[index] = cached
        return self._cache[index]
