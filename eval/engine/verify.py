"""Verifiers: given the target's logits at every tree node, accept a root-to-node path.

Every verifier takes `logits` [N, V] (row i = the target's prediction for the token after node i)
and the `Draft` (tree + tokens), and returns a `Verdict`: the accepted node indices (starting with
the root, node 0) and the tokens the step emits (the accepted candidates' tokens, then one bonus
token drawn from the target after the last accepted node). A step therefore always emits
len(nodes) tokens.

- `GreedyVerifier`: lossless for greedy decoding (output == target argmax decoding).
- `TypicalVerifier`: Medusa-2's typical acceptance. Fast with sampling, NOT lossless.
- `SpeculativeSampler`: lossless speculative sampling over a tree (see its docstring).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from eval.engine.tree import Draft


@dataclass(frozen=True)
class Verdict:
    nodes: list[int]  # accepted node indices, root (0) first
    tokens: list[int]  # emitted tokens: accepted candidates' tokens then the bonus token


class Verifier(Protocol):
    def verify(self, logits: Tensor, draft: Draft) -> Verdict: ...


def _longest_path(draft: Draft, accept: Tensor, score: Tensor | None = None) -> list[int]:
    """Longest root-to-node path along which every node is accepted.

    accept: [N] bool, whether node i passes its test (the root's entry is ignored).
    score:  [N] optional per-node log-likelihood; breaks ties between equally long paths.
    """
    ri = draft.tree.retrieve_indices.to(accept.device)  # [L, D + 1]
    safe = ri.clamp(min=0)
    ok = accept[safe[:, 1:]] & (ri[:, 1:] >= 0)  # [L, D]
    length = ok.long().cumprod(-1).sum(-1)  # [L] accepted candidates per path
    key = length.double()
    if score is not None:
        steps = torch.arange(ri.shape[1] - 1, device=ri.device)[None] < length[:, None]
        total = (score[safe[:, 1:]] * steps).sum(-1).double()
        key = key + torch.sigmoid(total) * 0.5  # in (0, 0.25]: orders equally long paths only
    row = int(key.argmax())
    return ri[row, : int(length[row]) + 1].tolist()


class GreedyVerifier:
    """Accept the longest path whose tokens equal the target's argmax at their parents."""

    def verify(self, logits: Tensor, draft: Draft) -> Verdict:
        best = logits.argmax(-1)  # [N] the target's greedy next token after each node
        tokens = draft.tokens.to(best.device)
        parent = draft.tree.parent.to(best.device).clamp(min=0)
        nodes = _longest_path(draft, tokens == best[parent])
        emitted = tokens[nodes[1:]].tolist() + [int(best[nodes[-1]])]
        return Verdict(nodes, emitted)


def _sample(probs: Tensor, generator: torch.Generator | None) -> int:
    """Draw an index from (unnormalised) probs [V] with a CPU uniform (inverse CDF)."""
    u = float(torch.rand((), generator=generator))
    cdf = probs.double().cumsum(0)
    # right=True: the first index whose cdf exceeds u * total, never a zero-probability token.
    threshold = torch.tensor([u], dtype=cdf.dtype, device=cdf.device) * cdf[-1]
    index = torch.searchsorted(cdf, threshold, right=True)
    return int(index.clamp(max=probs.numel() - 1))


class TypicalVerifier:
    """Typical acceptance (Cai et al., 2024, Medusa-2, section 2.3.1). NOT lossless.

    A candidate x after node i is accepted if p_i(x) > min(epsilon, delta * exp(-H(p_i))) where
    p_i = softmax(logits_i / temperature), epsilon = posterior_threshold and delta =
    posterior_alpha. The longest accepted path wins (ties: the most likely one). The bonus token
    is sampled from p at the last accepted node restricted to tokens passing the same test (the
    argmax always passes). The output distribution differs from the target's: it favours typical
    tokens, trading exactness for longer acceptance.
    """

    def __init__(
        self,
        temperature: float = 0.7,
        posterior_threshold: float = 0.09,
        posterior_alpha: float = 0.3,
        generator: torch.Generator | None = None,
    ):
        if temperature <= 0:
            raise ValueError("typical acceptance needs temperature > 0; use GreedyVerifier for 0.")
        self.temperature = temperature
        self.posterior_threshold = posterior_threshold
        self.posterior_alpha = posterior_alpha
        self.generator = generator

    def thresholds(self, probs: Tensor) -> Tensor:
        """min(epsilon, delta * exp(-entropy)) per row of probs [N, V] -> [N]."""
        entropy = -(probs * torch.log(probs.clamp(min=1e-30))).sum(-1)
        return torch.clamp(self.posterior_alpha * torch.exp(-entropy), max=self.posterior_threshold)

    def verify(self, logits: Tensor, draft: Draft) -> Verdict:
        probs = torch.softmax(logits / self.temperature, dim=-1)  # [N, V]
        tokens = draft.tokens.to(probs.device)
        parent = draft.tree.parent.to(probs.device).clamp(min=0)
        p_token = probs[parent, tokens]  # [N] prob of each node's token under its parent
        accept = p_token > self.thresholds(probs)[parent]
        nodes = _longest_path(draft, accept, score=torch.log(p_token.clamp(min=1e-30)))
        last = probs[nodes[-1]]
        keep = last > self.thresholds(last[None])[0]
        keep[last.argmax()] = True
        bonus = _sample(last * keep, self.generator)
        return Verdict(nodes, tokens[nodes[1:]].tolist() + [bonus])


def process_logits(
    logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> Tensor:
    """The target's sampling distribution: softmax(logits / T), then top-k and top-p filtering.

    top-p keeps the smallest set of most likely tokens whose mass reaches top_p (at least one).
    logits [..., V] -> probs [..., V] (float32, rows sum to 1).
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if 0 < top_k < probs.shape[-1]:
        kth = probs.topk(top_k, dim=-1).values[..., -1:]
        probs = probs * (probs >= kth)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the more likely tokens
        drop_sorted = before >= top_p * sorted_p.sum(-1, keepdim=True)
        drop_sorted[..., 0] = False
        probs = probs.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), 0.0)
    return probs / probs.sum(-1, keepdim=True)


class SpeculativeSampler:
    """Lossless speculative sampling over a tree: recursive rejection sampling over siblings.

    At a node with target distribution p (temperature, top-k, top-p applied to the TARGET's
    logits), try the children x_1, x_2, ... in sibling order. Child x_j was drawn from some
    distribution q_j (given the earlier siblings). Accept x_j with probability min(1, p(x_j) /
    q_j(x_j)) and move to it; if rejected, set p <- norm(max(p - q_j, 0)) and try the next child.
    If every child is rejected (or the node is a leaf), the bonus token is drawn from the current p.

    Why it is lossless: one trial is ordinary speculative sampling (Leviathan et al., 2023; Chen
    et al., 2023): its output is distributed as p whenever, on rejection, the output is drawn from
    norm(max(p - q_j, 0)). The remaining trials produce exactly that residual, by induction, for
    any q_{j+1} from which x_{j+1} is then really drawn -- the residual depends on q_j only, not on
    which x_j was rejected. So the emitted token follows p at every depth, and the accepted child
    then continues with the target's distribution given that token (Miao et al., 2023, SpecInfer;
    Jeon et al., 2024, Recursive Speculative Decoding).
    `generator` is a CPU torch.Generator (uniforms are drawn on the CPU, probabilities stay on
    the logits' device); the same seed reproduces the same output.

    The two kinds of draft:
    - deterministic children (Medusa / EAGLE top-k; `draft.draft_probs is None`): q_j is a point
      mass on x_j, so the test is "accept with probability p(x_j)" and the residual is p with x_j
      zeroed and renormalised. (Using the head's softmax as q here would NOT be lossless: the
      top-k children were not drawn from it.)
    - sampled children (`draft_probs` row i = q at node i, children drawn in order WITHOUT
      replacement): q_1 = q, and q_{j+1} = q with x_1..x_j removed, renormalised.
    """

    def __init__(
        self,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
    ):
        if temperature <= 0:
            raise ValueError("sampling needs temperature > 0; use GreedyVerifier for 0.")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p={top_p} must be in (0, 1].")
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.generator = generator

    def verify(self, logits: Tensor, draft: Draft) -> Verdict:
        probs = process_logits(logits, self.temperature, self.top_k, self.top_p)  # [N, V]
        nodes, emitted, node = [0], [], 0
        while True:
            p, child = self._try_children(probs[node], draft, node)
            if child is None:
                emitted.append(_sample(p, self.generator))
                return Verdict(nodes, emitted)
            nodes.append(child)
            emitted.append(int(draft.tokens[child]))
            node = child

    def _try_children(self, p: Tensor, draft: Draft, node: int) -> tuple[Tensor, int | None]:
        """Rejection-sample the children of `node`: (residual p, accepted child or None)."""
        q = None
        if draft.draft_probs is not None:
            q = draft.draft_probs[node].to(p.device, torch.float32)
            q = q / q.sum()
        for child in draft.tree.children(node):
            x = int(draft.tokens[child])
            q_x = 1.0 if q is None else float(q[x])
            if q_x <= 0:
                raise ValueError(f"node {child}: token {x} has zero draft probability.")
            u = float(torch.rand((), generator=self.generator))
            if u * q_x < float(p[x]):  # u < p(x) / q(x)
                return p, child
            residual = p.clone()
            if q is None:
                residual[x] = 0.0
            else:
                residual = (residual - q).clamp(min=0)
                q = q.clone()
                q[x] = 0.0
                q = q / q.sum() if float(q.sum()) > 0 else q
            mass = float(residual.sum())
            if mass <= 0:  # rejecting had probability zero up to rounding
                return p, child
            p = residual / mass
        return p, None


def make_verifier(
    kind: str = "greedy",
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    seed: int | None = None,
) -> Verifier:
    """Build a verifier by name ("greedy" | "typical" | "sample"); temperature 0 means greedy."""
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    if kind == "greedy" or (kind in ("typical", "sample") and temperature == 0):
        return GreedyVerifier()
    if kind == "typical":
        return TypicalVerifier(temperature, posterior_threshold, posterior_alpha, generator)
    if kind == "sample":
        return SpeculativeSampler(temperature, top_k, top_p, generator)
    raise ValueError(f"verifier {kind!r}: use 'greedy', 'typical' or 'sample'.")


__all__ = [
    "GreedyVerifier",
    "SpeculativeSampler",
    "TypicalVerifier",
    "Verdict",
    "Verifier",
    "make_verifier",
    "process_logits",
]
