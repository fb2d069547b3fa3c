"""Reduced draft vocabularies: predict over the D most frequent target tokens only.

The mapping follows the EAGLE-3 checkpoint convention that serving engines read:
`d2t[i]` is an int64 *offset*, so target id = draft id + d2t[draft id], over the used target ids
sorted ascending; `t2d` is a bool mask over the target vocabulary marking the used ids.
On SmolLM2 the full vocabulary projection is 28 M of the model's 135 M parameters; a draft that
scores 4-8 K tokens instead costs an order of magnitude less to train and to run.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

log = logging.getLogger(__name__)


def count_tokens(examples, vocab_size: int) -> Tensor:
    """How often each target id occurs as a training label (loss_mask == 1)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ex in examples:
        ids = ex["input_ids"][ex["loss_mask"].bool()]
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def select_draft_ids(counts: Tensor, size: int, always: tuple[int, ...] = ()) -> Tensor:
    """The `size` most frequent ids (ties broken by lower id), plus `always`, sorted ascending."""
    vocab = counts.numel()
    if not 0 < size <= vocab:
        raise ValueError(f"draft_vocab_size={size} must be in [1, {vocab}] (the target vocab).")
    score = counts.double().clone()
    forced = [i for i in always if 0 <= i < vocab]
    score[forced] = float("inf")
    # stable ordering: sort by (-count, id)
    order = torch.argsort(-score, stable=True)
    return torch.sort(order[:size]).values


def frequent_ids(target, size: int | None, token_counts: Tensor | None, option: str):
    """The sorted ids of a reduced vocabulary of `size` tokens for `target` (always keeping its
    EOS), or None when `size` is null or covers the whole vocabulary. `option` names the config
    field in the error raised when the training-label counts are missing."""
    if size is None or size >= target.vocab_size:
        return None
    if token_counts is None:
        raise ValueError(f"head.{option} needs token counts of the training labels.")
    tok = getattr(target, "tokenizer", None)
    eos = getattr(tok, "eos_token_id", None) if tok is not None else None
    ids = select_draft_ids(token_counts, size, () if eos is None else (int(eos),))
    double = min(2 * size, target.vocab_size)
    wider = coverage(token_counts, select_draft_ids(token_counts, double))
    log.info(
        "head.%s=%d of %d ids covers %.2f%% of the training answers' tokens (%d: %.2f%%)",
        option, size, target.vocab_size, 100 * coverage(token_counts, ids), double, 100 * wider,
    )  # fmt: skip
    return ids


def coverage(counts: Tensor, ids: Tensor) -> float:
    """The share of counted label tokens whose id is in `ids` (0 when nothing was counted)."""
    total = int(counts.sum())
    return float(counts[ids].sum()) / total if total else 0.0


def saved_draft_ids(d2t: Tensor) -> Tensor:
    """The sorted target ids of a saved draft vocabulary, from its `d2t` (what `d2t_t2d` took)."""
    return draft_to_target(torch.arange(d2t.numel()), d2t)


def d2t_t2d(draft_ids: Tensor, vocab_size: int) -> tuple[Tensor, Tensor]:
    """Offsets `d2t` (int64, [D]) and membership mask `t2d` (bool, [V]) for sorted `draft_ids`."""
    draft_ids = draft_ids.to(torch.int64)
    if draft_ids.numel() > 1 and not bool((draft_ids[1:] > draft_ids[:-1]).all()):
        raise ValueError("draft ids must be sorted ascending and unique")
    d2t = draft_ids - torch.arange(draft_ids.numel(), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d


def draft_to_target(draft_ids: Tensor, d2t: Tensor) -> Tensor:
    return draft_ids + d2t[draft_ids]


def target_to_draft(target_ids: Tensor, t2d: Tensor) -> Tensor:
    """Draft id of each target id, or -1 where the token is outside the draft vocabulary."""
    index = torch.cumsum(t2d.to(torch.int64), 0) - 1
    ids = index[target_ids]
    return torch.where(t2d[target_ids], ids, torch.full_like(ids, -1))
