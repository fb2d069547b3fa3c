"""The proposer for a draft head: the one in `PROPOSERS` that drafts with the head class's
`drafting` Protocol (heads.base.DraftHead), so a new draft method that drafts like Medusa, EAGLE
or DFlash needs nothing here; one that drafts another way adds its proposer to `PROPOSERS`.
"""

from __future__ import annotations

from data.errors import ConfigError
from eval.engine.block_proposer import BlockProposer
from eval.engine.eagle_proposer import EagleProposer
from eval.engine.proposers import MedusaProposer, Proposer
from eval.engine.tree_spec import TreeSpec, resolve_tree

# Every proposer; a head drafts with the one whose `drafts` is its class's `drafting`.
PROPOSERS: tuple[type, ...] = (MedusaProposer, EagleProposer, BlockProposer)


def proposer_class(head) -> type:
    """The proposer that drafts with `head`'s drafting Protocol (heads.base.DraftHead)."""
    drafting = getattr(type(head), "drafting", None)
    for proposer in PROPOSERS:
        if proposer.drafts is drafting:
            return proposer
    raise ValueError(
        f"no proposer drafts with a {type(head).__name__} (drafting={drafting!r}); give the head "
        "class a `drafting` Protocol that a proposer in eval.engine.drafting.PROPOSERS serves."
    )


def make_proposer(head, tree: TreeSpec) -> Proposer:
    """The proposer for a draft head over `tree`: static trees for every head, EAGLE-2 dynamic
    trees where the proposer grows them. A tree is resolved once where it enters
    (eval.engine.tree_spec.resolve_tree) and passed on as its TreeSpec."""
    if not isinstance(tree, TreeSpec):
        raise TypeError(
            f"make_proposer takes a TreeSpec, not {type(tree).__name__}: resolve the tree where "
            "it enters (eval.engine.tree_spec.resolve_tree) and pass the spec on."
        )
    proposer = proposer_class(head)
    check_tree(head, tree, proposer)
    return proposer(head, tree.buffers if tree.dynamic is None else tree.dynamic)


def check_tree(head, tree: TreeSpec, proposer: type) -> None:
    """Refuse a tree `head` cannot draft: a dynamic tree for a proposer that only fills static
    ones, or a tree deeper than the head drafts in one step (heads.base.DraftHead)."""
    limit = head.max_draft_depth
    if tree.dynamic is not None and not proposer.dynamic_trees:
        raise ConfigError(
            f"a {head.method!r} head drafts a static tree only, not an EAGLE-2 dynamic tree; use "
            f"{_static_trees(limit)}."
        )
    if limit is not None and tree.depth > limit:
        raise ConfigError(
            f"the tree is {tree.depth} deep but a {head.method!r} head drafts at most {limit} "
            f"tokens a step; use {_static_trees(limit)}."
        )


def _static_trees(limit: int | None) -> str:
    """The static trees a head drafting at most `limit` tokens a step takes, for a message."""
    usual = resolve_tree("tree16")  # conf/tree/tree16.yaml, evaluate.yaml's default
    if limit is None or limit >= usual.depth:
        return "tree=tree16 (or another conf/tree paths file, or tree=N for a chain of N)"
    return f"a tree at most {limit} deep (tree={limit}: a chain of {limit})"
