"""Draft trees: structure, masks, validation, the shipped conf/tree files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eval.engine.tree import (
    Draft,
    build_tree,
    build_tree_from_parents,
    chain_paths,
    chain_tree,
    expected_acceptance_paths,
)
from eval.engine.tree_spec import TreeSpec, load_tree_spec

CONF = Path(__file__).resolve().parents[1] / "conf" / "tree"
BRANCHED = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]


def ancestors(parent: list[int], i: int) -> set[int]:
    out = {i}
    while parent[i] >= 0:
        i = parent[i]
        out.add(i)
    return out


def check_invariants(tree) -> None:
    parent = tree.parent.tolist()
    n = tree.num_nodes
    for i in range(n):
        assert set(tree.attn_mask[i].nonzero().flatten().tolist()) == ancestors(parent, i)
        assert tree.depth[i] == len(ancestors(parent, i)) - 1
    # every leaf appears once in retrieve_indices, as a full root-to-leaf path
    leaves = [i for i in range(n) if i not in parent]
    assert tree.retrieve_indices.shape == (len(leaves), tree.max_depth + 1)
    for row in tree.retrieve_indices.tolist():
        path = [j for j in row if j >= 0]
        assert path[0] == 0 and path[-1] in leaves
        assert all(parent[b] == a for a, b in zip(path, path[1:]))
        assert all(j == -1 for j in row[len(path) :])


def test_branched_tree_masks_positions_and_ranks():
    tree = build_tree(BRANCHED)
    check_invariants(tree)
    assert tree.num_nodes == len(BRANCHED) + 1
    # nodes sorted by depth then path: root, [0], [1], [2], [0,0], [0,1], [1,0], [0,0,0], [0,1,0]
    assert tree.depth.tolist() == [0, 1, 1, 1, 2, 2, 2, 3, 3]
    assert tree.rank.tolist() == [0, 0, 1, 2, 0, 1, 0, 0, 0]
    assert tree.parent.tolist() == [-1, 0, 0, 0, 1, 1, 2, 4, 5]
    assert tree.children(0) == (1, 2, 3) and tree.children(1) == (4, 5)


def test_chain_and_root_only():
    tree = chain_tree(4)
    check_invariants(tree)
    assert tree.depth.tolist() == [0, 1, 2, 3, 4]
    assert tree.attn_mask.equal(torch.ones(5, 5, dtype=torch.bool).tril())
    assert tree.retrieve_indices.tolist() == [[0, 1, 2, 3, 4]]
    root = build_tree([])
    assert root.num_nodes == 1 and root.max_depth == 0 and root.retrieve_indices.tolist() == [[0]]


def test_ranks_may_skip_and_order_is_canonical():
    tree = build_tree([[2], [0], [0, 3]])  # given out of order, rank 1 missing
    assert tree.rank.tolist() == [0, 0, 2, 3]
    assert tree.children(0) == (1, 2)


def test_dynamic_tree_from_parents():
    parents = [-1, 0, 0, 1, 1, 2, 3]
    tree = build_tree_from_parents(parents)
    check_invariants(tree)
    assert tree.rank.tolist() == [0, 0, 1, 0, 1, 0, 0]
    # the static builder is the dynamic one on canonical parents
    static = build_tree(BRANCHED)
    again = build_tree_from_parents(static.parent.tolist())
    assert again.attn_mask.equal(static.attn_mask) and again.depth.equal(static.depth)
    assert again.retrieve_indices.equal(static.retrieve_indices)


@pytest.mark.parametrize(
    "paths, message",
    [
        ([[0, 0]], "no parent"),
        ([[0], [0]], "twice"),
        ([[0], []], "non-empty"),
        ([[0], [-1]], "non-negative"),
        ([[0], [1.0]], "non-negative"),
    ],
)
def test_build_tree_validates(paths, message):
    with pytest.raises(ValueError, match=message):
        build_tree(paths)


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, 0, 3, 0], []])
def test_parents_validated(parents):
    with pytest.raises(ValueError):
        build_tree_from_parents(parents)


def test_draft_truncation_keeps_shallow_nodes():
    tree = build_tree(BRANCHED)
    tokens = torch.arange(10, 10 + tree.num_nodes)
    cut = Draft(tree, tokens).truncated(1)
    assert cut.tokens.tolist() == [10, 11, 12, 13]
    check_invariants(cut.tree)
    assert Draft(tree, tokens).truncated(0).tokens.tolist() == [10]
    with pytest.raises(ValueError, match="tokens"):
        Draft(tree, tokens[:3])


def test_expected_acceptance_paths_closed_and_sized():
    acc = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1]]
    paths = expected_acceptance_paths(acc, 10)
    assert len(paths) == 9 and paths[0] == [0]
    check_invariants(build_tree(paths))  # would raise if a parent were missing


@pytest.mark.parametrize(
    "name, nodes", [("chain", 5), ("tree16", 16), ("tree32", 32), ("tree64", 64)]
)
def test_shipped_trees_load(name, nodes):
    spec = load_tree_spec(CONF / f"{name}.yaml")
    check_invariants(spec.buffers)
    assert spec.buffers.num_nodes == spec.num_nodes == nodes
    assert load_tree_spec(CONF / "chain.yaml") == TreeSpec.static(chain_paths(4))


# ---- tree specs: one front door (eval/engine/tree_spec.py) --------------------------------------


def test_a_tree_spec_is_checked_once_where_it_enters(tiny_llama):
    from eval.engine import dynamic_tree, tree
    from eval.engine.drafting import make_proposer
    from eval.engine.tree_spec import resolve_tree
    from heads.medusa import MedusaConfig, MedusaHeads

    spec = resolve_tree("chain")
    assert resolve_tree(spec) is spec and spec.depth == 4 and spec.num_nodes == 5
    head = MedusaHeads.for_target(MedusaConfig(num_heads=4), tiny_llama)
    assert make_proposer(head, spec).tree is spec.buffers  # built once, not parsed again
    with pytest.raises(TypeError, match="resolve the tree where it enters"):
        make_proposer(head, "chain")  # past the edge only a TreeSpec is taken
    with pytest.raises(ValueError, match=r"tree path \[0, 0, 0\] has no parent"):
        resolve_tree([[0], [0, 0, 0]])  # refused at the edge, not when decoding starts
    with pytest.raises(ValueError, match="keys \\['depth', 'paths'\\]"):
        resolve_tree({"paths": [[0]], "depth": 3})  # not silently static
    with pytest.raises(ValueError, match="no fixed buffers"):
        _ = resolve_tree("dynamic").buffers
    leftovers = {"tree_spec", "load_tree_spec", "resolve_tree", "spec_depth", "spec_nodes"}
    assert not leftovers & set(vars(dynamic_tree)) and not hasattr(tree, "load_tree_paths")
