"""Drafts from a block drafter (DFlash, DSpark): one draft forward proposes every depth.

Each step:
1. absorb: crop the draft's context cache to the positions the target had committed before this
   step, and append the positions it committed in its last forward (their fused target features,
   `DecodeState.step_aux`). The cache then holds exactly the committed context, one entry per
   position, computed from target features only.
2. draft: one forward over [root, MASK x (B-1)] at positions root, root + 1, ...; slot d scores
   the token at depth d. A chain takes each slot's best token; a static tree takes, for a node at
   depth d with rank r, slot d's r-th best token (Medusa-style: a slot does not see which token
   its parent took). Block keys are never stored, so nothing drafted survives the step.

Sampling (`draft_temperature`): the children of a node at depth d-1 are drawn without replacement
from softmax(slot d / T), and the draft carries that distribution for lossless verification.
Heads that condition a slot on the previous drafted token (DSpark's Markov head) draft a chain
through `draft_chain` instead, and report the distribution each token was drawn from.
"""

from __future__ import annotations

import torch
from torch import Tensor

from data.errors import ConfigError
from eval.engine.proposers import DecodeState, resume_cache
from eval.engine.tree import Draft, TreeBuffers, build_tree_from_parents
from heads.base import BlockDrafter


class BlockProposer:
    """`propose(state) -> Draft` from a block drafter (heads.base.BlockDrafter).

    tree: TreeBuffers no deeper than the head's block_size - 1 (a chain is the usual choice).
    draft_temperature: None: each child is its slot's r-th best token (no draft_probs). A float
        T: children sampled from softmax(logits / T); the draft carries the distributions over
        the target vocabulary (`vocab_size`, default the head's).
    generator: CPU torch.Generator for sampled children.
    The context cache lives across steps; a state at position 0 starts a new one.
    """

    drafts = BlockDrafter
    dynamic_trees = False

    def __init__(
        self,
        head,
        tree: TreeBuffers,
        draft_temperature: float | None = None,
        vocab_size: int | None = None,
        generator: torch.Generator | None = None,
    ):
        if not isinstance(tree, TreeBuffers):
            raise ConfigError(
                f"a {head.method!r} head drafts static trees only (a chain, or tree paths); "
                "pick tree=chain or a conf/tree file."
            )
        limit = head.max_draft_depth
        if tree.max_depth > limit:
            raise ConfigError(
                f"the tree is {tree.max_depth} deep but a block of {head.block_size} drafts at "
                f"most {limit} tokens; use a tree at most {limit} deep (tree={limit}: a chain)."
            )
        if draft_temperature is not None and draft_temperature <= 0:
            raise ValueError(f"draft_temperature={draft_temperature}: use > 0, or None.")
        self.head, self.tree = head, tree
        self.feature_layers = list(head.feature_layers())  # read by the generator
        self.draft_temperature = draft_temperature
        self.vocab_size = vocab_size or head.target_info.vocab_size
        self.generator = generator
        self._rank = tree.rank.tolist()
        self._depth = tree.depth.tolist()
        self._kids = [tree.children(i) for i in range(tree.num_nodes)]
        if getattr(head, "draft_chain", None) is not None and any(len(k) > 1 for k in self._kids):
            raise ConfigError(
                f"a {head.method!r} head drafts a chain (each token conditions the next), not a "
                f"tree with branches; use tree={limit} (a chain of {limit}) or a shorter chain."
            )
        self.width = int(tree.rank.max()) + 1
        self.cache = None
        self.last_logits: Tensor | None = None  # (B-1, D) of the last step, for inspection

    @property
    def max_depth(self) -> int:
        return self.tree.max_depth

    def absorb(self, state: DecodeState) -> None:
        """Bring the context cache to the target's committed positions."""
        self.cache, start = resume_cache(state, self.cache, self.head.new_cache)
        if state.step_aux is None:
            raise ValueError(f"the head needs target layers {self.feature_layers} (step_aux).")
        context = self.head.context({"aux": state.step_aux[None]})  # (1, k, H)
        positions = torch.arange(start, state.position, device=context.device)[None]
        self.head.extend_cache(self.cache, context, positions)

    def propose(self, state: DecodeState) -> Draft:
        self.absorb(state)
        tree = self.tree
        device = self.head.fc.weight.device
        root = state.step_tokens[-1:].to(device)
        if tree.max_depth == 0:
            return Draft(tree.to(device), root)
        position = torch.tensor([state.position], device=device)
        chain = getattr(self.head, "draft_chain", None)
        if chain is not None:  # a slot depends on the token drafted before it (DSpark)
            return self._chain(chain, root, position)
        logits = self.head.draft_block(root, position, self.cache)[0]  # (B-1, D)
        self.last_logits = logits
        if tree.parent.device != logits.device:
            self.tree = tree = tree.to(logits.device)
        tokens = torch.zeros(tree.num_nodes, dtype=torch.long, device=logits.device)
        tokens[0] = root[0]
        if self.draft_temperature is None:
            if self.width > logits.shape[-1]:
                raise ValueError(f"the tree needs top-{self.width} of {logits.shape[-1]} tokens.")
            top = logits[: tree.max_depth].topk(self.width, dim=-1).indices  # (depth, width)
            top = self.head.draft_to_target(top)
            tokens[1:] = top[tree.depth[1:] - 1, tree.rank[1:]]
            return Draft(tree, tokens)
        return self._sampled(logits, tokens)

    def _sampled(self, logits: Tensor, tokens: Tensor) -> Draft:
        q = torch.softmax(logits.float() / self.draft_temperature, dim=-1).cpu()  # (B-1, D)
        ids = self.head.draft_to_target(torch.arange(q.shape[-1], device=logits.device)).cpu()
        n = self.tree.num_nodes
        probs = torch.full((n, self.vocab_size), 1.0 / self.vocab_size)  # leaves: any row
        for node in range(n):
            kids = self._kids[node]
            if not kids:
                continue
            slot = q[self._depth[node]]  # children sit at depth(node) + 1 -> slot row depth(node)
            picks = torch.multinomial(slot, len(kids), replacement=False, generator=self.generator)
            tokens[list(kids)] = ids[picks].to(tokens.device)
            probs[node] = 0.0
            probs[node, ids] = slot
        return Draft(self.tree, tokens, probs.to(tokens.device))

    def _chain(self, chain, root: Tensor, position: Tensor) -> Draft:
        """A chain drafted token by token from one block forward (`head.draft_chain`; the
        constructor refused trees with branches)."""
        tokens, probs = chain(
            root, position, self.cache, self.tree.max_depth, self.draft_temperature, self.generator
        )  # tokens (L,) target ids, probs (L, V) or None; L <= depth (a confidence cut)
        tokens = torch.cat([root, tokens.to(root.device)])
        tree = build_tree_from_parents(list(range(-1, tokens.numel() - 1))).to(root.device)
        if probs is None:
            return Draft(tree, tokens)
        rows = torch.full((tokens.numel(), self.vocab_size), 1.0 / self.vocab_size)
        rows[: probs.shape[0]] = probs.cpu()
        return Draft(tree, tokens, rows.to(root.device))


__all__ = ["BlockProposer"]
