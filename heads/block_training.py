"""Training a block drafter (DFlash, heads/dflash.py; DSpark): which anchors a row's blocks start
at, what each block row may attend to, which tokens its slots predict, how much each slot
weighs, and the per-slot statistics the loss reports.

All the blocks of a batch run in one forward: block j's queries see the context positions before
its anchor (in its own conversation, for packed rows) and its own block, so training input equals
inference input.
"""

from __future__ import annotations

import torch
from torch import Tensor

from heads.base import batch_positions, label_mask, stat_pair


def sample_anchors(batch: dict[str, Tensor], num_anchors: int) -> tuple[Tensor, Tensor]:
    """Up to `num_anchors` anchor positions per row, uniformly among the positions whose
    next token is a label of their own conversation and that have context before them.
    Returns (anchors (B, N) long, valid (B, N) bool); unused slots hold position 0."""
    ids = batch["input_ids"]
    B, T = ids.shape
    allowed = label_mask(batch, 1) & (batch_positions(batch, T) >= 1)
    n = min(num_anchors, T)
    score = torch.rand(B, T, device=ids.device).masked_fill(~allowed, -1.0)
    top, anchors = score.topk(n, dim=1)
    valid = top >= 0
    anchors = torch.where(valid, anchors, torch.zeros_like(anchors))
    order = anchors.masked_fill(~valid, T).argsort(dim=1)  # ascending, unused last
    return torch.gather(anchors, 1, order), torch.gather(valid, 1, order)


def every_anchor(batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Every position `sample_anchors` draws from, in order: (anchors (B, N), valid (B, N)), N
    the most any row has; unused slots hold position 0. Validation's chain walk needs a block at
    each of them, as decoding may query any."""
    ids = batch["input_ids"]
    B, T = ids.shape
    allowed = label_mask(batch, 1) & (batch_positions(batch, T) >= 1)
    n = max(int(allowed.sum(1).max()) if B else 0, 1)
    t = torch.arange(T, device=ids.device).expand(B, T)
    anchors = torch.where(allowed, t, t + T).sort(dim=1).values[:, :n]  # allowed ones first
    valid = anchors < T
    return torch.where(valid, anchors, torch.zeros_like(anchors)), valid


def block_attention_mask(
    anchors: Tensor, length: int, block_size: int, segments: Tensor | None = None
) -> Tensor:
    """Which keys each block row may see in training: (B, 1, N*B, T + N*B) bool.

    anchors (B, N): the anchor positions (row indices) of N blocks per row; keys are the T context
    positions then the N blocks. A row of block j sees context positions p < anchors[j] (of the
    anchor's own conversation where `segments` (B, T) marks packed rows) and every row of block j.
    """
    Bt, N = anchors.shape
    device = anchors.device
    p = torch.arange(length, device=device)
    ctx = p[None, None, :] < anchors[:, :, None]  # (Bt, N, T)
    if segments is not None:
        own = torch.gather(segments, 1, anchors)  # (Bt, N)
        ctx = ctx & (segments[:, None, :] == own[:, :, None])
    ctx = ctx[:, :, None, :].expand(Bt, N, block_size, length).reshape(Bt, N * block_size, length)
    block = torch.arange(N, device=device).repeat_interleave(block_size)
    same = (block[:, None] == block[None, :])[None].expand(Bt, -1, -1)
    return torch.cat([ctx, same], dim=-1)[:, None]


def block_labels(
    batch: dict[str, Tensor], anchors: Tensor, valid: Tensor, offsets: list[int], t2d: Tensor
) -> tuple[Tensor, Tensor]:
    """Labels of the scored slots: slot i of the block at anchor a predicts x_{a+offsets[i]}.

    Returns (labels (B, N, K) target ids, ok (B, N, K) bool): ok where that token is a label
    of the anchor's own conversation and inside the draft vocabulary (`t2d` (V,) bool: which
    target ids it holds)."""
    ids = batch["input_ids"]
    T = ids.shape[1]
    labels, ok = [], []
    for offset in offsets:
        has = torch.gather(label_mask(batch, offset), 1, anchors) & valid  # (B, N)
        token = torch.gather(ids, 1, (anchors + offset).clamp(max=T - 1))
        has = has & t2d[token]  # a label outside the draft vocabulary cannot be drafted
        labels.append(token)
        ok.append(has)
    return torch.stack(labels, -1), torch.stack(ok, -1)


def position_weights(per_slot: Tensor, ok: Tensor, first: int, config) -> Tensor:
    """Loss weights (B, N, K) of the scored slots, without gradient. "decay": slot i (the
    token first + i places after the anchor's first draft) weighs exp(-(first + i)/gamma).
    "dpace": with q = exp(-loss) the draft's chance on the label and s = (1 - alpha) q +
    alpha, slot i weighs the sum over j >= i of prod_{l <= j} s_l (over ok slots): what a
    slot's error costs the rest of the chain."""
    K = ok.shape[-1]
    if config.weighting == "dpace":
        alpha = config.dpace_alpha
        smooth = ((1 - alpha) * torch.exp(-per_slot.detach()) + alpha) * ok
        smooth = torch.where(ok, smooth, torch.ones_like(smooth))
        prefix = torch.cumprod(smooth, dim=-1) * ok
        return prefix.flip(-1).cumsum(-1).flip(-1) * ok
    steps = torch.arange(K, device=ok.device, dtype=torch.float32) + first
    return torch.exp(-steps / config.decay).expand(ok.shape) * ok


def slot_stats(
    per_slot: Tensor, logits: Tensor, want: Tensor, ok: Tensor, topk: int, first_slot: int
) -> dict[str, Tensor]:
    """Per-slot loss, top-1 and top-k accuracy (`slot{i}/...`, i counted from `first_slot`), and
    the first drafted token's as `head0/...` (the same quantity as Medusa's head 0). logits (n,
    D) and want (n,) are the `ok` slots in order."""
    device = per_slot.device
    k = min(topk, logits.shape[-1])
    hit1 = torch.zeros(ok.shape, device=device)
    hitk = torch.zeros(ok.shape, device=device)
    if logits.shape[0]:
        top = logits.detach().topk(k, dim=-1).indices == want[:, None]
        hit1[ok] = top[:, 0].float()
        hitk[ok] = top.any(-1).float()
    stats: dict[str, Tensor] = {}
    for i in range(ok.shape[-1]):
        n = int(ok[..., i].sum())
        name = f"slot{i + first_slot}"
        stats[f"{name}/loss"] = stat_pair(per_slot[..., i].detach().sum(), n, device)
        stats[f"{name}/top1"] = stat_pair(hit1[..., i].sum(), n, device)
        stats[f"{name}/top{k}"] = stat_pair(hitk[..., i].sum(), n, device)
    stats["head0/top1"] = stats[f"slot{first_slot}/top1"]
    stats[f"head0/top{k}"] = stats[f"slot{first_slot}/top{k}"]
    return stats


__all__ = [
    "block_attention_mask",
    "block_labels",
    "every_anchor",
    "position_weights",
    "sample_anchors",
    "slot_stats",
]
