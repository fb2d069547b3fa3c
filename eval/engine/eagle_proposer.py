"""Draft trees from an EAGLE head: EAGLE-1 (Li et al., 2024a), EAGLE-2 dynamic trees (Li et al.,
2024b) and EAGLE-3 (Li et al., 2025).

The head is one decoder layer run autoregressively on (feature, token) pairs with its own
key/value cache (heads/draft_layer.py `DraftCache`). Row t of the draft holds the feature at
position t and the token x_{t+1}; it outputs the predicted feature at t + 1 and logits for
x_{t+2}. Each step:

1. absorb: crop the draft cache to the positions the target has committed before this step and
   feed the new committed pairs (the TARGET's features at the newly cached positions, with the
   tokens after them). The draft cache then holds exactly one entry per committed position, each
   computed from target features only: drafted nodes never stay in it.
2. draft: the last fed row's logits give the root's children (depth 1). A node at depth d >= 1
   is fed as a row at position `committed + d - 1` with its parent's output feature as input and
   a tree mask (the committed cache, its drafted ancestors, itself); its logits give its
   children. Static trees fill Medusa-style paths (rank r = the parent's r-th best token);
   dynamic trees grow and rerank by cumulative log-prob (eval/engine/dynamic_tree.py).
3. crop the draft cache back to the committed length.
"""

from __future__ import annotations

import torch
from torch import Tensor

from eval.engine.dynamic_tree import DynamicTreeConfig, grow_dynamic_tree, select_dynamic_tree
from eval.engine.proposers import DecodeState, resume_cache
from eval.engine.tree import Draft, TreeBuffers, build_tree_from_parents
from heads.base import FeatureDrafter
from heads.draft_layer import DraftCache


def draft_tree_mask(ancestors: list[list[int]], committed: int, drafted: int) -> Tensor:
    """Attention mask [q, committed + drafted + q] bool for q new tree rows.

    Row i sees every committed entry, the drafted entries (slots counted after the committed
    ones) listed in `ancestors[i]`, and itself (slot drafted + i).
    """
    q = len(ancestors)
    allowed = torch.zeros(q, committed + drafted + q, dtype=torch.bool)
    allowed[:, :committed] = True
    for i, slots in enumerate(ancestors):
        allowed[i, [committed + s for s in slots] + [committed + drafted + i]] = True
    return allowed


class EagleProposer:
    """`propose(state) -> Draft` from an EAGLE / EAGLE-3 head.

    head: `feature_layers()`, `target_hidden(features)`, `draft_hidden(tokens, hidden,
          position_ids, cache, attn_mask)` (features only), `step(...)` (features and logits),
          `draft_to_target(ids)` (see heads/eagle.py, heads/eagle3.py).
    tree: TreeBuffers (static: the node at depth d with rank r is the r-th best child of its
          parent under the draft's logits at that parent) or a DynamicTreeConfig (EAGLE-2).
    draft_temperature: None (default): children are the draft's top-k, deterministic, and the
          draft carries no draft_probs (lossless sampling treats them as point masses). A float
          T (static trees only): each node's children are sampled without replacement from
          softmax(logits / T), in sibling order, and the draft carries those distributions
          over the target vocabulary for SpeculativeSampler (`vocab_size` ids; default: the
          head's `target_info.vocab_size`).
    generator: CPU torch.Generator for the sampled children.
    The draft cache lives across steps; a state that starts at position 0 (a prefill) starts a
    new one, so one proposer serves any number of generations, one at a time.
    """

    drafts = FeatureDrafter
    dynamic_trees = True

    def __init__(
        self,
        head,
        tree: TreeBuffers | DynamicTreeConfig,
        draft_temperature: float | None = None,
        vocab_size: int | None = None,
        generator: torch.Generator | None = None,
    ):
        if draft_temperature is not None:
            if isinstance(tree, DynamicTreeConfig):
                raise ValueError(
                    "sampled draft children need a static tree: a dynamic tree keeps only some "
                    "of the sampled siblings, which breaks lossless verification. Use top-k "
                    "children (draft_temperature=None) with tree=dynamic."
                )
            if draft_temperature <= 0:
                raise ValueError(f"draft_temperature={draft_temperature}: use > 0, or None.")
            info = getattr(head, "target_info", None)
            vocab_size = vocab_size or (info.vocab_size if info is not None else None)
            if not vocab_size:
                raise ValueError("sampled children need the target's vocab_size (draft_probs).")
        self.head, self.tree = head, tree
        layers = head.feature_layers()
        self.feature_layers = list(layers) if layers else None  # read by the generator
        self.draft_temperature, self.vocab_size = draft_temperature, vocab_size
        self.generator = generator
        if isinstance(tree, TreeBuffers):  # plain lists: no device syncs while drafting
            self._levels = _expanded_by_depth(tree)
            self._parent, self._rank = tree.parent.tolist(), tree.rank.tolist()
        self.cache: DraftCache | None = None
        self._root: tuple[Tensor, Tensor] | None = None  # (out_hidden [H], logits [D]) of row t

    @property
    def max_depth(self) -> int:
        if isinstance(self.tree, DynamicTreeConfig):
            return self.tree.depth
        return self.tree.max_depth

    def propose(self, state: DecodeState) -> Draft:
        self.absorb(state)
        committed = self.cache.length
        try:
            if isinstance(self.tree, DynamicTreeConfig):
                return self._draft_dynamic(state, committed)
            return self._draft_static(state, committed)
        finally:
            self.cache.crop(committed)

    def absorb(self, state: DecodeState) -> None:
        """Bring the draft cache to the target's committed positions (see the module docstring)."""
        k = state.step_tokens.numel()
        self.cache, start = resume_cache(state, self.cache, DraftCache)
        features = {"hidden": state.step_hidden[None]}
        if self.feature_layers:
            if state.step_aux is None:
                raise ValueError(f"the head needs target layers {self.feature_layers} (step_aux).")
            features["aux"] = state.step_aux[None]
        hidden = self.head.target_hidden(features)  # [1, k, H]
        device = hidden.device
        positions = torch.arange(start, state.position, device=device)[None]
        tokens = state.step_tokens.to(device)[None]
        # Only the last row's scores are needed (they give the root's children): projecting every
        # absorbed row (a whole prompt at prefill) onto the vocabulary would dominate the step.
        if k > 1:
            self.head.draft_hidden(
                tokens[:, :-1], hidden[:, :-1], positions[:, :-1], self.cache, None
            )
        out_hidden, logits = self.head.step(
            tokens[:, -1:], hidden[:, -1:], positions[:, -1:], self.cache, None
        )
        self._root = (out_hidden[0, -1], logits[0, -1])

    def _feed(
        self, tokens: Tensor, hidden: Tensor, depth: int, ancestors: list[list[int]], committed: int
    ) -> tuple[Tensor, Tensor, list[int]]:
        """Run the draft on q tree nodes of one depth: tokens [q] target ids, hidden [q, H] (each
        parent's output feature), ancestors[i] the drafted slots node i may see besides itself.

        Returns (out_hidden [q, H], logits [q, D], the slots the q rows took)."""
        drafted = self.cache.length - committed
        mask = draft_tree_mask(ancestors, committed, drafted).to(hidden.device)[None, None]
        positions = torch.full((1, tokens.numel()), committed + depth - 1, device=hidden.device)
        out_hidden, logits = self.head.step(tokens[None], hidden[None], positions, self.cache, mask)
        return out_hidden[0], logits[0], list(range(drafted, drafted + tokens.numel()))

    def _draft_static(self, state: DecodeState, committed: int) -> Draft:
        tree = self.tree
        out_hidden, logits = self._root
        device = logits.device
        if tree.parent.device != device:
            self.tree = tree = tree.to(device)  # once: keep the tree beside the model
        n, parent = tree.num_nodes, self._parent
        tokens = torch.zeros(n, dtype=torch.long, device=device)
        tokens[0] = state.last_token
        probs = None if self.draft_temperature is None else torch.zeros(n, self.vocab_size)
        hiddens: dict[int, Tensor] = {0: out_hidden}
        slots: dict[int, list[int]] = {0: []}
        for depth, nodes in enumerate(self._levels):
            if depth > 0:
                node_index = torch.tensor(nodes, device=device)
                inputs = torch.stack([hiddens[parent[i]] for i in nodes])
                ancestors = [slots[parent[i]] for i in nodes]
                out, logits, taken = self._feed(
                    tokens[node_index], inputs, depth, ancestors, committed
                )
                for j, i in enumerate(nodes):
                    hiddens[i], slots[i] = out[j], ancestors[j] + [taken[j]]
            self._fill_children(logits.reshape(len(nodes), -1), nodes, tokens, probs)
        probs = None if probs is None else _complete(probs, tree).to(device)
        return Draft(tree, tokens, probs)

    def _fill_children(
        self, logits: Tensor, nodes: list[int], tokens: Tensor, probs: Tensor | None
    ) -> None:
        """Write the children tokens of `nodes` (logits [q, D], row j = node j) into `tokens`."""
        kids = [self.tree.children(i) for i in nodes]
        if probs is None:  # the r-th best token for the child of rank r
            child = [c for ks in kids for c in ks]
            rows = [j for j, ks in enumerate(kids) for _ in ks]
            ranks = [self._rank[c] for c in child]
            if max(ranks) >= logits.shape[-1]:
                raise ValueError(
                    f"the tree needs top-{max(ranks) + 1} of {logits.shape[-1]} tokens."
                )
            top = logits.topk(max(ranks) + 1, dim=-1).indices  # [q, width]
            tokens[child] = self.head.draft_to_target(top[rows, ranks])
            return
        q = torch.softmax(logits.float() / self.draft_temperature, dim=-1).cpu()
        ids = self.head.draft_to_target(torch.arange(q.shape[-1], device=logits.device)).cpu()
        for j, (node, ks) in enumerate(zip(nodes, kids)):
            picks = torch.multinomial(q[j], len(ks), replacement=False, generator=self.generator)
            tokens[list(ks)] = ids[picks].to(tokens.device)
            probs[node, ids] = q[j]

    def _draft_dynamic(self, state: DecodeState, committed: int) -> Draft:
        root_hidden, root_logits = self._root
        fed: dict[int, tuple[Tensor, list[int]]] = {}  # candidate -> (out_hidden, drafted slots)

        def expand(candidates, frontier: Tensor) -> Tensor:
            nodes, parents = frontier.tolist(), candidates.parent[frontier].tolist()
            depth = int(candidates.depth[nodes[0]])
            inputs = torch.stack([root_hidden if p < 0 else fed[p][0] for p in parents])
            ancestors = [[] if p < 0 else fed[p][1] for p in parents]
            tokens = self.head.draft_to_target(candidates.tokens[frontier])
            out, logits, taken = self._feed(tokens, inputs, depth, ancestors, committed)
            for j, c in enumerate(nodes):
                fed[c] = (out[j], ancestors[j] + [taken[j]])
            return torch.log_softmax(logits.float(), dim=-1)

        root_logprobs = torch.log_softmax(root_logits.float(), dim=-1)
        candidates = grow_dynamic_tree(root_logprobs, expand, self.tree)
        kept, parents = select_dynamic_tree(candidates, self.tree.total_tokens)
        device = root_logits.device
        root = torch.tensor([state.last_token], dtype=torch.long, device=device)
        tokens = torch.cat([root, self.head.draft_to_target(candidates.tokens[kept]).to(device)])
        return Draft(build_tree_from_parents(parents).to(device), tokens)


def _expanded_by_depth(tree: TreeBuffers) -> list[list[int]]:
    """levels[d] = the depth-d nodes that have children (the ones the draft must run on)."""
    levels: list[list[int]] = [[] for _ in range(tree.max_depth)]
    for i in range(tree.num_nodes):
        if tree.children(i):
            levels[int(tree.depth[i])].append(i)
    return levels


def _complete(probs: Tensor, tree: TreeBuffers) -> Tensor:
    """Leaves sample nothing: give their rows a uniform distribution so every row is one."""
    leaves = [i for i in range(tree.num_nodes) if not tree.children(i)]
    probs[leaves] = 1.0 / probs.shape[-1]
    return probs


__all__ = ["EagleProposer", "draft_tree_mask"]
