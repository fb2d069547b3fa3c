"""Where a batch's target features come from: the batch itself (cached) or the target (online)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from heads.base import segment_causal_mask

FEATURE_KEYS = ("hidden", "aux")


def batch_features(
    batch: Mapping[str, Any], target: Any, layers: Sequence[int] | None, head: Any = None
) -> dict[str, Tensor]:
    """The target features a head trains on: cached in the batch, or computed now.

    Returns {"hidden": (B, T, H)} and, when `layers` is set, {"aux": (B, T, len(layers) * H)}.
    Online features are computed under no_grad: the target is frozen and never trained here.
    A head with `uses_target_features = False` (Medusa-2 runs its adapted target itself) gets {}.
    """
    if head is not None and not getattr(head, "uses_target_features", True):
        return {}
    cached = {k: batch[k] for k in FEATURE_KEYS if k in batch}
    if cached:
        if layers and "aux" not in cached:
            raise ValueError(
                f"the head needs 'aux' features from layers {list(layers)}, but the cached "
                "batch has only 'hidden': rebuild the feature cache with those layers."
            )
        return cached
    if target is None:
        raise ValueError(
            "the batch has no cached 'hidden'/'aux' features and no target was given: pass "
            "target=... (online features) or train on a feature cache (offline)."
        )
    packed = segment_causal_mask(batch.get("segment_ids"))  # packed rows: block-diagonal
    with torch.no_grad():
        if packed is None:
            return target.features(batch["input_ids"], batch["attention_mask"], layers=layers)
        return target.features(
            batch["input_ids"], packed, layers=layers, position_ids=batch["position_ids"]
        )
