"""Fit a static tree to a trained Medusa head (the way Medusa derived its sparse trees).

Measure, on held-out data, how often head d's rank-r token is the right one (`rank_accuracy`);
then keep the paths with the highest product of those estimates (eval.engine.tree.
expected_acceptance_paths), so a 16/32/64-node tree spends its nodes where this head is right.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from heads.base import masked_shift


@torch.no_grad()
def rank_accuracy(
    head, target, examples: Sequence[dict], max_rank: int = 10, against: str = "target"
) -> list[list[float]]:
    """`acc[d][r]`: fraction of assistant positions where head d's r-th best token is the label.

    Head d (0-based) scores token t + d + 2 from the target's hidden state at t (heads/medusa.py).
    `against="target"`: the label is the target's own greedy choice for that token given the
    same prefix, argmax lm_head(h_{t+d+1}), which is what greedy verification accepts;
    `against="data"`: the data's token. Labels outside a reduced draft vocabulary count as
    misses at every rank.
    """
    if against not in ("target", "data"):
        raise ValueError(f"against={against!r}: use 'target' or 'data'.")
    K = head.config.num_heads
    hits = torch.zeros(K, max_rank, dtype=torch.float64)
    counts = torch.zeros(K, dtype=torch.float64)
    for ex in examples:
        ids = ex["input_ids"][None]  # (1, T)
        mask = ex["loss_mask"][None]
        hidden = ex.get("hidden")
        if hidden is None:
            hidden = target.features(ids, torch.ones_like(ids))["hidden"][0]
        hidden = hidden.float()  # (T, H)
        logits = head(hidden)  # (K, T, D)
        if against == "target":
            greedy = target.lm_head(hidden.to(target.lm_head.weight.dtype)).argmax(-1)  # (T,)
        for d in range(K):
            shift = d + 2
            valid = masked_shift(mask, shift)[0].bool()
            if not valid.any():
                continue
            if against == "target":
                labels = head.target_to_draft(greedy[d + 1 : ids.shape[1] - 1])  # (T - shift,)
            else:
                labels = head.target_to_draft(ids[0, shift:])  # (T - shift,)
            valid = valid[: ids.shape[1] - shift]
            top = logits[d, : ids.shape[1] - shift][valid].topk(max_rank, dim=-1).indices
            hit = top == labels[valid][:, None]  # (N, R)
            hits[d] += hit.sum(0).double()
            counts[d] += valid.sum()
    return (hits / counts.clamp(min=1)[:, None]).tolist()
