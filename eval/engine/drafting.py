"""The proposer for a draft head: the one in `PROPOSERS` that drafts with the head class's
`drafting` Protocol (heads.base.DraftHead), so a new draft method that drafts like Medusa, EAGLE
or DFlash needs nothing here; one that drafts another way adds its proposer to `PROPOSERS`.
"""

from __future__ import annotations

from eval.engine.block_proposer import BlockProposer
from eval.engine.eagle_proposer import EagleProposer
from eval.engine.proposers import MedusaProposer, Proposer
from eval.engine.tree_spec import TreeSpec

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
    if tree.dynamic is None:
        return proposer(head, tree.buffers)
    if not proposer.dynamic_trees:
        raise ValueError(
            f"a {head.method!r} head drafts a static tree only; pick tree paths (tree=tree16, "
            "conf/tree/*.yaml) instead of a dynamic tree."
        )
    return proposer(head, tree.dynamic)
