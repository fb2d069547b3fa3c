"""EAGLE-2 dynamic draft trees (Li et al., 2024, "EAGLE-2: Faster Inference of Language Models
with Dynamic Draft Trees"). Which tree a config chooses (static or dynamic) is
eval/engine/tree_spec.py.

A dynamic tree is grown from the draft's own confidence: the cumulative log-probability of a
node is the sum of the draft's log-probabilities along its path. Growing (`grow_dynamic_tree`):
depth 1 holds the root's top_k tokens; at each further depth the top_k nodes of the previous
depth (by cumulative log-prob) are expanded by their top_k children. Reranking
(`select_dynamic_tree`): of every node grown, the `total_tokens - 1` best by cumulative log-prob
are kept. A child's score is its parent's plus a log-probability <= 0, so a kept node's
ancestors are kept too (ties go to the node grown first, and a parent is grown before its
children). Both steps are pure functions of the draft's log-probabilities, so they are tested
against brute-force enumeration; the EAGLE proposer supplies the draft model as a callback.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class DynamicTreeConfig:
    """An EAGLE-2 tree, rebuilt every step.

    depth: deepest drafted token (tree depth; the root is depth 0). EAGLE-2's reference code
           counts expansions after the first level instead, so its `depth=5` is depth 6 here.
    top_k: children per expanded node, and nodes expanded per depth.
    total_tokens: nodes verified per step, the root included (EAGLE's `total_token`).
    """

    depth: int = 6
    top_k: int = 10
    total_tokens: int = 60

    def __post_init__(self) -> None:
        for name in ("depth", "top_k", "total_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"dynamic tree {name}={value!r}: need an integer >= 1.")


@dataclass(frozen=True)
class Candidates:
    """Every node grown, in growth order (by depth, then frontier order, then child rank).

    tokens: [C] long draft-vocabulary ids.   scores: [C] cumulative log-probabilities.
    parent: [C] long, the parent's candidate index (< own index); -1 = the root.
    depth:  [C] long, 1 for the root's children.
    """

    tokens: Tensor
    scores: Tensor
    parent: Tensor
    depth: Tensor


# expand(candidates so far, frontier [f] candidate indices) -> log-probs [f, D] of their children
Expand = Callable[[Candidates, Tensor], Tensor]


def _best(scores: Tensor, k: int) -> Tensor:
    """Indices of the k largest scores; ties go to the lower index (deterministic)."""
    return torch.sort(scores, descending=True, stable=True).indices[:k]


def grow_dynamic_tree(
    root_logprobs: Tensor, expand: Expand, config: DynamicTreeConfig
) -> Candidates:
    """EAGLE-2's expansion phase. root_logprobs [D]: the draft's log-probs for the root's children.

    At depth d >= 2 the frontier is the top_k depth d-1 nodes by cumulative log-prob; `expand`
    returns their children's log-probs and each contributes its top_k children.
    """
    device = root_logprobs.device
    top = root_logprobs.float().topk(min(config.top_k, root_logprobs.numel()))
    tokens, scores = [top.indices], [top.values]
    parent = [torch.full_like(top.indices, -1)]
    depth = [torch.ones_like(top.indices)]
    frontier = torch.arange(top.indices.numel(), device=device)
    count = top.indices.numel()
    for d in range(2, config.depth + 1):
        sofar = Candidates(
            torch.cat(tokens), torch.cat(scores), torch.cat(parent), torch.cat(depth)
        )
        logprobs = expand(sofar, frontier).float()  # [f, D]
        top = logprobs.topk(min(config.top_k, logprobs.shape[-1]), dim=-1)  # [f, k]
        level = (sofar.scores[frontier][:, None] + top.values).flatten()  # [f * k]
        tokens.append(top.indices.flatten())
        scores.append(level)
        parent.append(frontier.repeat_interleave(top.indices.shape[-1]))
        depth.append(torch.full_like(level, d, dtype=torch.long))
        frontier = count + _best(level, config.top_k)
        count += level.numel()
    return Candidates(torch.cat(tokens), torch.cat(scores), torch.cat(parent), torch.cat(depth))


def select_dynamic_tree(candidates: Candidates, total_tokens: int) -> tuple[Tensor, list[int]]:
    """EAGLE-2's reranking: keep the best `total_tokens - 1` candidates by cumulative log-prob.

    Returns (kept [M] candidate indices in tree order, parents [M + 1] for
    `build_tree_from_parents`: node 0 is the root, node i + 1 is candidate kept[i]). Tree order is
    growth order, so parents precede children and siblings come best first.
    """
    best = _best(candidates.scores, max(total_tokens - 1, 0))
    kept = best.sort().values
    node_of = {c: i + 1 for i, c in enumerate(kept.tolist())}
    parents = [-1]
    for c, p in zip(kept.tolist(), candidates.parent[kept].tolist()):
        if p >= 0 and p not in node_of:
            raise ValueError(
                f"candidate {c} was kept without its parent {p}: scores must not rise."
            )
        parents.append(node_of.get(p, 0))
    return kept, parents


__all__ = [
    "Candidates",
    "DynamicTreeConfig",
    "grow_dynamic_tree",
    "select_dynamic_tree",
]
