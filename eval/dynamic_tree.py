"""EAGLE-2 dynamic draft trees (Li et al., 2024, "EAGLE-2: Faster Inference of Language Models
with Dynamic Draft Trees"), and the tree choice a config makes (static paths or dynamic).

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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

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


# ---- the tree a config chooses -------------------------------------------------------------

TreeSpec = list[list[int]] | DynamicTreeConfig


def tree_spec(doc: Mapping | Sequence | DynamicTreeConfig) -> TreeSpec:
    """A conf/tree choice: `{paths: [...]}` (static; or the list itself) or
    `{depth, top_k, total_tokens}` (dynamic, EAGLE heads only)."""
    if isinstance(doc, DynamicTreeConfig):
        return doc
    if isinstance(doc, Sequence) and not isinstance(doc, str):
        return [list(p) for p in doc]
    doc = dict(doc)
    if "paths" in doc:
        return [list(p) for p in doc["paths"]]
    keys = {"depth", "top_k", "total_tokens"}
    if not doc.keys() <= keys:
        raise ValueError(
            f"tree config {sorted(doc)}: give `paths` (a static tree) or any of {sorted(keys)} "
            "(an EAGLE-2 dynamic tree)."
        )
    return DynamicTreeConfig(**{k: int(v) for k, v in doc.items()})


def load_tree_spec(path: str | Path) -> TreeSpec:
    """Read a conf/tree/*.yaml file: static paths or a dynamic tree."""
    import yaml

    doc = yaml.safe_load(Path(path).read_text())
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a mapping (`paths`, or depth/top_k/total_tokens).")
    return tree_spec(doc)


def resolve_tree(tree: int | str | Path | Mapping | Sequence | DynamicTreeConfig) -> TreeSpec:
    """Any way a config names a tree: an int d (a chain of d top-1 tokens), a conf/tree option
    name (`tree16`, `dynamic`), a *.yaml path, a `{paths: ...}` / `{depth, top_k, total_tokens}`
    mapping, a list of paths, or a DynamicTreeConfig."""
    from data.paths import resolve_path
    from eval.tree import chain_paths

    if isinstance(tree, bool):
        raise ValueError(f"tree={tree!r}: give a conf/tree name, a yaml path, paths or an int.")
    if isinstance(tree, int):
        return tree_spec(chain_paths(tree))
    if isinstance(tree, (str, Path)):
        name = str(tree)
        if "/" not in name and not name.endswith((".yaml", ".yml")):
            path = resolve_path(f"conf/tree/{name}.yaml")
            if not path.is_file():
                known = sorted(p.stem for p in path.parent.glob("*.yaml"))
                raise ValueError(f"tree={name!r}: no conf/tree/{name}.yaml; known: {known}.")
            return load_tree_spec(path)
        path = resolve_path(name)
        if not path.is_file():
            raise FileNotFoundError(f"tree={name!r}: no such tree file.")
        return load_tree_spec(path)
    return tree_spec(tree)


def spec_depth(spec: TreeSpec) -> int:
    """Deepest draft token the tree can hold."""
    if isinstance(spec, DynamicTreeConfig):
        return spec.depth
    return max(map(len, spec), default=0)


def spec_nodes(spec: TreeSpec) -> int:
    """Nodes verified per step (at most, for a dynamic tree), the root included."""
    if isinstance(spec, DynamicTreeConfig):
        return spec.total_tokens
    return len(spec) + 1


__all__ = [
    "Candidates",
    "DynamicTreeConfig",
    "TreeSpec",
    "grow_dynamic_tree",
    "load_tree_spec",
    "resolve_tree",
    "select_dynamic_tree",
    "spec_depth",
    "spec_nodes",
    "tree_spec",
]
