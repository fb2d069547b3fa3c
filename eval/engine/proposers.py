"""Proposers: turn the decoding state into a draft tree of candidate tokens.

The seam between a draft method and the decoding loop is one verb, `propose(state) -> Draft`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
from torch import Tensor

from eval.engine.tree import Draft, TreeBuffers
from heads.base import ParallelDrafter


@dataclass(frozen=True)
class DecodeState:
    """What the target committed in the last forward (prefill or tree step).

    step_hidden: [k, H] target hidden states (after the final norm) at the k positions newly
                 written to the target's cache; the last one is at position t, the last cached.
    step_tokens: [k] long, the token that follows each of those positions. step_tokens[-1] is
                 x_{t+1}: the last accepted token, not yet cached, the root of the next tree.
    position:    t + 1, the position of the root (= the target's cache length).
    step_aux:    [k, len(layers) * H] the target's HF hidden_states[i] for i in the proposer's
                 `feature_layers`, concatenated, at the same k positions; None unless asked for.
    EAGLE-style proposers extend their own cache with the (step_hidden, step_tokens) pairs; Medusa
    needs only the last pair.
    """

    step_hidden: Tensor
    step_tokens: Tensor
    position: int
    step_aux: Tensor | None = None

    @property
    def hidden(self) -> Tensor:
        """[H] hidden state at the last cached position t."""
        return self.step_hidden[-1]

    @property
    def last_token(self) -> int:
        return int(self.step_tokens[-1])


def resume_cache(state: DecodeState, cache, new_cache):
    """The draft cache a proposer continues with, cropped to the positions committed before
    `state`'s step, and that step's first position: `cache` itself, or `new_cache()` when the
    state starts a generation (position 0, a prefill). A state that skips positions the cache
    never saw is refused."""
    start = state.position - state.step_tokens.numel()
    if cache is None or start > cache.length:
        if start != 0:
            have = 0 if cache is None else cache.length
            raise ValueError(
                f"the state continues from position {start} but the draft cache holds {have}:"
                " feed every committed position (start each generation with its prefill)."
            )
        cache = new_cache()
    cache.crop(start)
    return cache, start


class Proposer(Protocol):
    """`propose(state) -> Draft`. A proposer that needs more of the target than its last hidden
    state sets `feature_layers` (a list of HF hidden_states indices): the generator then fills
    `DecodeState.step_aux` with those layers (EAGLE-3).

    Class attributes say which heads it serves: `drafts`, the drafting Protocol of heads.base a
    head must declare as its `drafting`, and `dynamic_trees`, whether it takes an EAGLE-2
    DynamicTreeConfig as well as static TreeBuffers (eval/bench/methods.py reads both)."""

    drafts: ClassVar[type]
    dynamic_trees: ClassVar[bool]

    def propose(self, state: DecodeState) -> Draft: ...


class MedusaProposer:
    """Fill a static tree from Medusa heads (Cai et al., 2024).

    `heads(hidden [H]) -> logits [num_heads, V_draft]`; head k predicts x_{t+k+2} from h_t, the
    token at depth k+1 of a tree whose root is x_{t+1}. A node at depth d with rank r takes the
    r-th most likely token of head d-1 (mapped to target ids by `heads.draft_to_target`). The
    children are chosen deterministically, so the draft carries no draft_probs (see
    eval/engine/verify.py: lossless sampling then treats each child as a point mass).
    """

    drafts = ParallelDrafter
    dynamic_trees = False

    def __init__(self, heads, tree: TreeBuffers):
        self.heads = heads
        self.tree = tree
        self.width = int(tree.rank.max()) + 1  # top-k needed from each head

    def propose(self, state: DecodeState) -> Draft:
        hidden = state.hidden
        if self.tree.parent.device != hidden.device:
            self.tree = self.tree.to(hidden.device)  # once: keep the tree beside the model
        if self.tree.max_depth == 0:
            return Draft(self.tree, state.step_tokens[-1:].to(hidden.device))
        logits = self.heads(hidden)  # [num_heads, V_draft]
        if logits.shape[0] < self.tree.max_depth:
            raise ValueError(
                f"the tree is {self.tree.max_depth} deep but there are only {logits.shape[0]} "
                "Medusa heads; use a shallower tree (conf/tree) or more heads."
            )
        if logits.shape[-1] < self.width:
            raise ValueError(f"the tree needs top-{self.width} of a {logits.shape[-1]}-token head.")
        top = logits[: self.tree.max_depth].topk(self.width, dim=-1).indices  # [D, width]
        top = self.heads.draft_to_target(top)
        depth, rank = self.tree.depth[1:], self.tree.rank[1:]
        root = state.step_tokens[-1:].to(hidden.device)
        return Draft(self.tree, torch.cat([root, top[depth - 1, rank]]))


__all__ = ["DecodeState", "MedusaProposer", "Proposer", "resume_cache"]
