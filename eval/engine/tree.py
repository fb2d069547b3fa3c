"""Draft trees as plain data.

A tree has N nodes. Node 0 is the root: the last accepted token, whose key/value is not yet in the
cache. Every other node is a candidate for the token that follows its parent. The target verifies
all N nodes in one forward, with each node at position `prefix_len + depth` and attending to the
cached prefix plus its own ancestors (`attn_mask`).

Static trees come from Medusa-style "choices": a path `[r1, r2, ..., rd]` names the node reached
by taking the r1-th best candidate at depth 1, then the r2-th best at depth 2, and so on (Cai et
al., 2024). Dynamic trees (EAGLE-2) give arbitrary parent indices per step; both end up as the same
`TreeBuffers` through `build_tree_from_parents`. Reading a tree from a config or a yaml file is
eval/engine/tree_spec.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor


@dataclass(frozen=True, eq=False)
class TreeBuffers:
    """The shape of a draft tree (N nodes, L root-to-leaf paths, depth D). Tokens live elsewhere.

    parent:           [N] long, parent node index; -1 for the root. parent[i] < i.
    depth:            [N] long, root 0; the position offset of each node after the prefix.
    rank:             [N] long, order among siblings (0 = first tried / best candidate); root 0.
    attn_mask:        [N, N] bool, attn_mask[i, j] <=> j is i or an ancestor of i.
    retrieve_indices: [L, D + 1] long, node indices of each root-to-leaf path, padded with -1.
    """

    parent: Tensor
    depth: Tensor
    rank: Tensor
    attn_mask: Tensor
    retrieve_indices: Tensor

    @property
    def num_nodes(self) -> int:
        return int(self.parent.numel())

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    def children(self, node: int) -> tuple[int, ...]:
        """Children of `node` in sibling order (the order a verifier tries them)."""
        return self._children[node]

    @cached_property
    def _children(self) -> tuple[tuple[int, ...], ...]:
        parent, rank = self.parent.tolist(), self.rank.tolist()
        kids: list[list[int]] = [[] for _ in parent]
        for i, p in enumerate(parent):
            if p >= 0:
                kids[p].append(i)
        return tuple(tuple(sorted(k, key=lambda i: rank[i])) for k in kids)

    def to(self, device: torch.device | str) -> TreeBuffers:
        return TreeBuffers(*(getattr(self, f).to(device) for f in _FIELDS))


_FIELDS = ("parent", "depth", "rank", "attn_mask", "retrieve_indices")


@dataclass(frozen=True, eq=False)
class Draft:
    """One step's proposal: a tree and a token per node.

    tokens:      [N] long, target-vocabulary ids; tokens[0] is the root (last accepted token).
    draft_probs: None when the children of each node were chosen deterministically (top-k);
                 else [N, V] with row i the distribution the children of node i were sampled from,
                 in sibling order and without replacement (see eval/engine/verify.py).
    """

    tree: TreeBuffers
    tokens: Tensor
    draft_probs: Tensor | None = None

    def __post_init__(self) -> None:
        if self.tokens.shape != (self.tree.num_nodes,):
            raise ValueError(
                f"draft has {tuple(self.tokens.shape)} tokens for a {self.tree.num_nodes}-node tree"
            )

    def truncated(self, max_depth: int) -> Draft:
        """The same draft without the nodes deeper than `max_depth` (e.g. at the context limit)."""
        if max_depth >= self.tree.max_depth:
            return self
        keep = (self.tree.depth <= max_depth).nonzero().flatten()
        remap = torch.full((self.tree.num_nodes,), -1, dtype=torch.long)
        remap[keep] = torch.arange(keep.numel())
        old_parent = self.tree.parent[keep]
        parents = torch.where(old_parent < 0, old_parent, remap[old_parent.clamp(min=0)])
        tree = build_tree_from_parents(parents.tolist())
        probs = None if self.draft_probs is None else self.draft_probs[keep.to(self.tokens.device)]
        return Draft(tree.to(self.tokens.device), self.tokens[keep.to(self.tokens.device)], probs)


def build_tree_from_parents(parents: list[int]) -> TreeBuffers:
    """Tree buffers for an arbitrary tree given each node's parent index.

    `parents[0]` must be -1 (the root) and `0 <= parents[i] < i` for every other node, so a node
    always comes after its parent. Siblings keep their index order as their rank.
    """
    n = len(parents)
    if n == 0 or parents[0] != -1:
        raise ValueError("parents[0] must be -1: node 0 is the root (the last accepted token).")
    for i, p in enumerate(parents[1:], start=1):
        if not 0 <= p < i:
            raise ValueError(f"node {i} has parent {p}; need 0 <= parent < node index ({i}).")
    parent = torch.tensor(parents, dtype=torch.long)
    depth = torch.zeros(n, dtype=torch.long)
    rank = torch.zeros(n, dtype=torch.long)
    attn_mask = torch.eye(n, dtype=torch.bool)
    num_children = [0] * n
    for i in range(1, n):
        p = parents[i]
        depth[i] = depth[p] + 1
        rank[i] = num_children[p]
        num_children[p] += 1
        attn_mask[i] |= attn_mask[p]  # ancestors of my parent, plus my parent itself
    leaves = [i for i in range(n) if num_children[i] == 0]
    max_depth = int(depth.max())
    retrieve = torch.full((len(leaves), max_depth + 1), -1, dtype=torch.long)
    for row, leaf in enumerate(leaves):
        path = attn_mask[leaf].nonzero().flatten()  # ancestors are sorted by index = by depth
        retrieve[row, : path.numel()] = path
    return TreeBuffers(parent, depth, rank, attn_mask, retrieve)


def build_tree(paths: list[list[int]]) -> TreeBuffers:
    """Tree buffers from Medusa-style choices: each path lists the top-k rank taken at each depth.

    Nodes are ordered by depth, then lexicographically by path, so siblings appear in rank order
    and `rank[i]` equals the last entry of node i's path. Every proper prefix of a path must be a
    path too (a node needs its parent). An empty list gives the root-only tree (plain decoding).
    """
    seen: set[tuple[int, ...]] = set()
    for path in paths:
        if not isinstance(path, (list, tuple)) or len(path) == 0:
            raise ValueError(f"tree path {path!r}: need a non-empty list of top-k ranks.")
        if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path):
            raise ValueError(f"tree path {path!r}: ranks must be non-negative integers.")
        key = tuple(path)
        if key in seen:
            raise ValueError(f"tree path {list(key)} is listed twice.")
        seen.add(key)
    for key in seen:
        if len(key) > 1 and key[:-1] not in seen:
            raise ValueError(f"tree path {list(key)} has no parent: add {list(key[:-1])}.")
    ordered = sorted(seen, key=lambda k: (len(k), k))
    index = {(): 0} | {key: i + 1 for i, key in enumerate(ordered)}
    tree = build_tree_from_parents([-1] + [index[key[:-1]] for key in ordered])
    # Ranks as given in the paths (they may skip numbers, e.g. [0] and [2] with no [1]).
    rank = torch.tensor([0] + [key[-1] for key in ordered], dtype=torch.long)
    return TreeBuffers(tree.parent, tree.depth, rank, tree.attn_mask, tree.retrieve_indices)


def chain_paths(depth: int) -> list[list[int]]:
    """[[0], [0, 0], ...]: a single path of `depth` top-1 candidates."""
    if depth < 0:
        raise ValueError(f"chain depth {depth} must be >= 0.")
    return [[0] * d for d in range(1, depth + 1)]


def chain_tree(depth: int) -> TreeBuffers:
    return build_tree(chain_paths(depth))


def root_only_draft(token: int, device: torch.device | str = "cpu") -> Draft:
    """A tree with just the root: verifying it samples one next token (prefill, plain decoding)."""
    tree = build_tree([]).to(device)
    return Draft(tree, torch.tensor([token], dtype=torch.long, device=device))


def expected_acceptance_paths(accuracy: list[list[float]], num_nodes: int) -> list[list[int]]:
    """The `num_nodes - 1` paths with the highest estimated acceptance probability.

    `accuracy[d][r]` estimates how often head d's rank-r token is the right one; a path's score is
    the product along it (heads treated as independent, as in Medusa's tree search). The score of
    a path is below its parent's, so the best paths always include their parents.
    """
    scored: list[tuple[float, tuple[int, ...]]] = []
    frontier: list[tuple[float, tuple[int, ...]]] = [(1.0, ())]
    while frontier:
        score, key = frontier.pop()
        if key:
            scored.append((score, key))
        if len(key) < len(accuracy):
            frontier += [(score * a, key + (r,)) for r, a in enumerate(accuracy[len(key)])]
    scored.sort(key=lambda s: (-s[0], len(s[1]), s[1]))
    chosen = sorted((key for _, key in scored[: num_nodes - 1]), key=lambda k: (len(k), k))
    return [list(k) for k in chosen]
