"""What a drafted chain is worth at decoding time, estimated from teacher-forced hits.

Per-depth top-1 accuracy over every labelled position overstates a chain's acceptance length tau in
three ways (docs/reports/2026-12-02-acceptance-gap/README.md measures each): a token outside the
draft vocabulary is never accepted; depth d counts only when depths 1..d-1 were right (chain
acceptance is conditional); and greedy decoding does not query the draft at every position but once
per verification, at the position after the accepted tokens and the bonus token, so easy stretches
are crossed in few queries and hard ones are queried at every token.

`chain_walk` replays that: given, for each row t, how many leading drafted tokens the target
would accept if decoding queried the draft there (`accepted_lengths`), it walks every assistant
turn as greedy chain decoding would and counts the tokens and the verification rounds. Their
ratio is the tau a chain of that depth reaches on these turns, provided the turns are the
target's own greedy continuations (on other text it is an estimate).

A head reports these estimates from `validate` (the `Validates` Protocol), never from `loss`:
training does not need them and should not pay for them.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from heads.base import LossOutput


@runtime_checkable
class Validates(Protocol):
    """A head whose validation measures more than training needs (EAGLE-3, DFlash, DSpark).

    validate(batch, features) -> LossOutput: `loss`'s output for the batch plus estimates only
    validation reports (`chain_stats` below); called in eval mode, without gradients.
    train/validation.py calls it instead of `loss` for such a head.
    """

    def validate(self, batch: dict[str, Tensor], features: dict[str, Tensor]) -> LossOutput: ...


def accepted_lengths(hits: Tensor) -> Tensor:
    """hits (S, B, T) bool: the draft's depth-(i+1) token from row t is the target's greedy
    token there (and that position is a label). Returns (B, T) long, the leading run of hits:
    how many drafted tokens a chain of depth S started at row t gets accepted."""
    return hits.long().cumprod(0).sum(0)


def label_runs(loss_mask: list[int], segments: list[int] | None = None) -> list[tuple[int, int]]:
    """(first, last) indices of each maximal run of labels (assistant turns) in one row; a
    packed row's runs also end where the conversation (`segments`) changes."""
    runs, start = [], None
    for t, label in enumerate(loss_mask):
        same = start is not None and (segments is None or segments[t] == segments[start])
        if label and same:
            continue
        if start is not None:
            runs.append((start, t - 1))
        start = t if label else None
    if start is not None:
        runs.append((start, len(loss_mask) - 1))
    return runs


def walk_rows(accepted: list[int], first: int, last: int) -> list[int]:
    """The rows at which greedy chain decoding queries the draft on one assistant turn whose
    labels are the tokens first..last: the first token comes from the prompt's forward (not a
    round), then each round queries row t (the root x_{t+1} is the last emitted token),
    accepts `accepted[t]` tokens and adds the bonus token."""
    t, rows = first - 1, []
    while t + 1 < last:
        rows.append(t)
        t += accepted[t] + 1
    return rows


def walk_turn(accepted: list[int], first: int, last: int) -> int:
    """How many verification rounds `walk_rows` takes."""
    return len(walk_rows(accepted, first, last))


def chain_walk(
    accepted: Tensor, loss_mask: Tensor, segments: Tensor | None = None,
    horizon: int | None = None,
) -> tuple[int, int]:  # fmt: skip
    """(tokens, rounds) of greedy chain decoding over every assistant turn of a batch.

    accepted (B, T): `accepted_lengths` of each row; loss_mask (B, T): the labels; segments
    (B, T): packed rows' conversation ids, or None; horizon: only each turn's first `horizon`
    tokens, as a benchmark that stops at max_new_tokens=horizon decodes them (None: whole
    turns). tokens counts each turn's labels but its first (the prefill's token, as the
    benchmark's tau leaves it out), so tokens / rounds is that benchmark's tau."""
    tokens = rounds = 0
    masks, lengths = loss_mask.tolist(), accepted.tolist()
    segs = segments.tolist() if segments is not None else [None] * len(masks)
    for row, mask, seg in zip(lengths, masks, segs, strict=True):
        for first, last in label_runs(mask, seg):
            if horizon is not None:
                last = min(last, first + horizon - 1)
            if first == 0 or (seg is not None and seg[first - 1] != seg[first]):
                first += 1  # a turn that opens its conversation: its first token is the prompt
            tokens += max(last - first, 0)
            rounds += walk_turn(row, first, last)
    return tokens, rounds


def check_horizon(horizon: int | None) -> None:
    """A head config's `estimate_horizon`: a token count >= 1, or None."""
    if horizon is not None and horizon < 1:
        raise ValueError(
            f"head.estimate_horizon={horizon}: use a token count >= 1 (the benchmark's "
            "max_new_tokens), or null to not log chain_tau_est_horizon."
        )


def chain_tau(conditional: list[float]) -> float:
    """1 + p1 + p1 p2|1 + ...: a chain's expected tau from its conditional acceptance rates."""
    tau, reach = 1.0, 1.0
    for p in conditional:
        reach *= p
        tau += reach
    return tau


def chain_stats(
    hits: Tensor, labels: Tensor, loss_mask: Tensor, segments: Tensor | None = None,
    horizon: int | None = None,
) -> dict[str, tuple[float, float]]:  # fmt: skip
    """[sum, count] pairs of a batch from hits (S, B, T) and labels (S, B, T) (the depth's
    position is a label; hits outside labels are ignored):

    - `step{i}/top1_all`: top-1 over every labelled position (a target token outside the draft
      vocabulary is a miss, as decoding rejects it);
    - `step{i}/accept`: the conditional chain acceptance P(depth i+1 right | depths 1..i right);
    - `chain_tau_est`: tokens over rounds of `chain_walk` (a chain of depth S);
    - `chain_tau_est_horizon` (with a horizon): the same over each turn's first `horizon` tokens,
      what a benchmark with max_new_tokens=horizon measures. Answers start harder than they go
      on (less of the answer to lean on), so this is lower and, for a head trained long on its
      own corpus, the one that predicts a short benchmark
      (docs/reports/2026-12-02-acceptance-gap/README.md).
    """
    hits = hits & labels
    out: dict[str, tuple[float, float]] = {}
    reach = torch.ones_like(labels[0])
    for i in range(hits.shape[0]):
        out[f"step{i}/top1_all"] = (float(hits[i].sum()), float(labels[i].sum()))
        out[f"step{i}/accept"] = (float((reach & hits[i]).sum()), float((reach & labels[i]).sum()))
        reach = reach & hits[i]
    accepted = accepted_lengths(hits)
    tokens, rounds = chain_walk(accepted, loss_mask, segments)
    out["chain_tau_est"] = (float(tokens), float(rounds))
    if horizon:
        tokens, rounds = chain_walk(accepted, loss_mask, segments, horizon)
        out["chain_tau_est_horizon"] = (float(tokens), float(rounds))
    return out


__all__ = [
    "accepted_lengths",
    "chain_stats",
    "chain_tau",
    "chain_walk",
    "check_horizon",
    "label_runs",
    "walk_rows",
    "walk_turn",
]
