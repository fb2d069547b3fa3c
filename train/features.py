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


class ExampleTargets(torch.utils.data.Dataset):
    """`base`'s examples plus the per-token training targets `head.example_targets(example)`
    derives from their cached features (EAGLE-3: the target's greedy token over its whole
    vocabulary), computed on an example's first read and kept in memory, so later epochs skip
    that work (a 49k-column projection per token for SmolLM2). They run in float32 outside any
    autocast, so they are exact whatever precision the training step uses."""

    def __init__(self, base: torch.utils.data.Dataset, head: Any) -> None:
        self.base, self.head = base, head
        self._memo: dict[int, dict[str, Tensor]] = {}

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        example = self.base[index]
        derived = self._memo.get(index)
        if derived is None:
            if not self._can_derive_here():
                return example  # the loss derives them per batch, on the head's device
            device = next(self.head.buffers(), torch.empty(0)).device
            with torch.no_grad(), torch.autocast(device.type, enabled=False):
                derived = self._memo[index] = self.head.example_targets(example)
        return {**example, **derived}

    def _can_derive_here(self) -> bool:
        """Not in a DataLoader worker when the head lives on an accelerator: a forked worker
        must not touch CUDA (`trainer.num_workers` > 0 with a GPU head)."""
        if torch.utils.data.get_worker_info() is None:
            return True
        return all(b.device.type == "cpu" for b in self.head.buffers())


def with_example_targets(dataset: Any, head: Any) -> Any:
    """`dataset` wrapped in ExampleTargets when the head derives per-example targets."""
    if dataset is None or not callable(getattr(head, "example_targets", None)):
        return dataset
    return ExampleTargets(dataset, head)
