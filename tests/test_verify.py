"""Verifiers: greedy paths, typical acceptance thresholds, and losslessness of tree sampling.

The sampling tests run a synthetic "target" (seeded logits as a function of the context) over a
tiny vocabulary, verify thousands of draft trees, and chi-square-test the first two emitted tokens
against the target's own (temperature / top-k / top-p processed) distribution.
"""

from __future__ import annotations

import math

import pytest
import torch

from eval.engine.tree import Draft, build_tree, chain_tree, root_only_draft
from eval.engine.verify import (
    GreedyVerifier,
    SpeculativeSampler,
    TypicalVerifier,
    make_verifier,
    process_logits,
)

BRANCHED = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]
# nodes: 0 root, 1 [0], 2 [1], 3 [2], 4 [0,0], 5 [0,1], 6 [1,0], 7 [0,0,0], 8 [0,1,0]


def one_hot_logits(best: list[int], vocab: int = 16) -> torch.Tensor:
    logits = torch.zeros(len(best), vocab)
    logits[torch.arange(len(best)), torch.tensor(best)] = 5.0
    return logits


def test_greedy_accepts_longest_matching_path():
    tree = build_tree(BRANCHED)
    tokens = torch.tensor([9, 1, 2, 3, 4, 5, 6, 7, 8])
    # target argmax after each node: root -> 1 (node 1), node 1 -> 5 (node 5), node 5 -> 8 (node 8)
    best = [1, 5, 0, 0, 0, 8, 0, 0, 11]
    verdict = GreedyVerifier().verify(one_hot_logits(best), Draft(tree, tokens))
    assert verdict.nodes == [0, 1, 5, 8]
    assert verdict.tokens == [1, 5, 8, 11]  # accepted tokens, then the bonus after node 8


def test_greedy_rejects_everything_and_root_only():
    tree = build_tree(BRANCHED)
    tokens = torch.tensor([9, 1, 2, 3, 4, 5, 6, 7, 8])
    verdict = GreedyVerifier().verify(one_hot_logits([12] * 9), Draft(tree, tokens))
    assert verdict.nodes == [0] and verdict.tokens == [12]
    verdict = GreedyVerifier().verify(one_hot_logits([3]), root_only_draft(9))
    assert verdict.nodes == [0] and verdict.tokens == [3]


def probs_logits(rows: list[list[float]]) -> torch.Tensor:
    return torch.log(torch.tensor(rows))


ROOT = [0.7, 0.2, 0.06, 0.04]  # entropy 0.869 nats: delta * exp(-H) = 0.126 for delta = 0.3


@pytest.mark.parametrize(
    "epsilon, delta, accepted",
    [(0.09, 0.3, True), (0.3, 0.3, True), (0.3, 0.6, False), (0.25, 0.6, False)],
)
def test_typical_threshold(epsilon, delta, accepted):
    # candidate token 1 (p = 0.2) vs threshold min(epsilon, delta * exp(-H))
    tree = chain_tree(1)
    logits = probs_logits([ROOT, [0.25] * 4])
    verifier = TypicalVerifier(1.0, epsilon, delta, torch.Generator().manual_seed(0))
    verdict = verifier.verify(logits, Draft(tree, torch.tensor([0, 1])))
    assert (verdict.nodes == [0, 1]) == accepted
    entropy = -sum(p * math.log(p) for p in ROOT)
    threshold = min(epsilon, delta * math.exp(-entropy))
    assert (0.2 > threshold) == accepted


def test_typical_prefers_longest_then_most_likely_path():
    tree = build_tree([[0], [1], [0, 0], [1, 0]])  # nodes 0, [0], [1], [0,0], [1,0]
    flat = [0.25] * 4
    rows = [[0.5, 0.4, 0.05, 0.05], flat, flat, flat, flat]
    tokens = torch.tensor([3, 0, 1, 2, 2])  # both depth-2 paths accepted (0.25 > 0.09)
    verifier = TypicalVerifier(1.0, generator=torch.Generator().manual_seed(0))
    verdict = verifier.verify(probs_logits(rows), Draft(tree, tokens))
    assert verdict.nodes == [0, 1, 3]  # same length: token 0 (p 0.5) beats token 1 (p 0.4)
    rows[1] = [0.97, 0.01, 0.01, 0.01]  # now node 3's token (2) fails under its parent
    verdict = verifier.verify(probs_logits(rows), Draft(tree, tokens))
    assert verdict.nodes == [0, 2, 4]


def test_typical_bonus_only_from_typical_tokens():
    verifier = TypicalVerifier(1.0, generator=torch.Generator().manual_seed(0))
    logits = probs_logits([ROOT])
    seen = {verifier.verify(logits, root_only_draft(0)).tokens[0] for _ in range(300)}
    assert seen == {0, 1}  # 0.06 and 0.04 are below the 0.09 threshold
    with pytest.raises(ValueError, match="temperature"):
        TypicalVerifier(0.0)


def test_process_logits_top_k_top_p():
    logits = probs_logits([[0.5, 0.3, 0.15, 0.05]])
    assert torch.allclose(
        process_logits(logits, 1.0, top_p=0.8), torch.tensor([[0.625, 0.375, 0, 0]])
    )
    assert (process_logits(logits, 1.0, top_p=0.81)[0] > 0).sum() == 3
    assert process_logits(logits, 1.0, top_k=1).tolist() == [[1.0, 0, 0, 0]]
    assert process_logits(logits, 1.0, top_p=0.01).tolist() == [[1.0, 0, 0, 0]]
    hot = process_logits(logits, 0.5)
    assert torch.allclose(hot, torch.softmax(logits * 2, -1))


def test_make_verifier():
    assert isinstance(make_verifier("sample", temperature=0.0), GreedyVerifier)
    assert isinstance(make_verifier("sample", temperature=0.7, seed=1), SpeculativeSampler)
    assert isinstance(make_verifier("typical", temperature=0.7), TypicalVerifier)
    with pytest.raises(ValueError, match="verifier"):
        make_verifier("beam")


# ---- losslessness of tree speculative sampling (chi-square) ----

VOCAB = 6


class SyntheticLM:
    """Seeded logits for any context: stands in for the target (another seed: the draft)."""

    def __init__(self, seed: int, scale: float = 1.5):
        self.seed, self.scale, self.memo = seed, scale, {}

    def __call__(self, context: tuple[int, ...]) -> torch.Tensor:
        if context not in self.memo:
            key = self.seed
            for t in context:
                key = (key * 1_000_003 + t + 1) % (2**31 - 1)
            g = torch.Generator().manual_seed(key)
            self.memo[context] = torch.randn(VOCAB, generator=g) * self.scale
        return self.memo[context]

    def probs(self, context: tuple[int, ...], temperature: float) -> torch.Tensor:
        key = (context, temperature)
        if key not in self.memo:
            self.memo[key] = torch.softmax(self(context) / temperature, -1)
        return self.memo[key]


def make_step(target, draft, context, tree, sampled, rng, temperature):
    """Draft tokens for `tree` after `context` (root = context[-1]) and the target's logits."""
    n = tree.num_nodes
    tokens = torch.zeros(n, dtype=torch.long)
    tokens[0] = context[-1]
    contexts = [context] + [None] * (n - 1)
    q = torch.zeros(n, VOCAB)
    for i in range(n):
        kids = tree.children(i)
        if i > 0:
            contexts[i] = contexts[int(tree.parent[i])] + (int(tokens[i]),)
        q[i] = draft.probs(contexts[i], temperature)
        if not kids:
            continue
        if sampled:  # children drawn from q without replacement, in sibling order
            picks = torch.multinomial(q[i], len(kids), replacement=False, generator=rng)
        else:  # the draft's top-k, deterministic
            picks = q[i].topk(len(kids)).indices
        tokens[torch.tensor(kids)] = picks
    logits = torch.stack([target(c) for c in contexts])
    return Draft(tree, tokens, q if sampled else None), logits, q


def first_two_tokens(verifier, target, draft, tree, sampled, rng, temperature):
    context, out = (0,), []
    while len(out) < 2:
        d, logits, _ = make_step(target, draft, context, tree, sampled, rng, temperature)
        tokens = verifier.verify(logits, d).tokens
        out += tokens
        context += tuple(tokens)
    return out[0] * VOCAB + out[1]


def chisquare_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value; cells expecting < 5 are pooled; zero-probability cells must be
    empty."""
    total = observed.sum()
    assert observed[probs == 0].sum() == 0, "a token the target cannot produce was emitted"
    expected = probs * total
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum()[None]]).double()
    exp = torch.cat([expected[~small], expected[small].sum()[None]]).double()
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = obs.numel() - 1
    try:
        from scipy.stats import chi2

        return float(chi2.sf(stat, dof))
    except ImportError:
        return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


def joint_two(target, temperature, top_k, top_p) -> torch.Tensor:
    p1 = process_logits(target((0,)), temperature, top_k, top_p)
    rows = [p1[a] * process_logits(target((0, a)), temperature, top_k, top_p) for a in range(VOCAB)]
    return torch.cat(rows)


@pytest.mark.parametrize(
    "shape, sampled, temperature, top_k, top_p",
    [
        ("chain", False, 1.0, 0, 1.0),
        ("branched", False, 0.7, 0, 0.9),
        ("branched", True, 1.0, 0, 1.0),
        ("branched", True, 0.8, 4, 0.85),
    ],
)
def test_tree_sampling_is_lossless(shape, sampled, temperature, top_k, top_p):
    tree = chain_tree(3) if shape == "chain" else build_tree(BRANCHED)
    target, draft = SyntheticLM(1), SyntheticLM(2, scale=1.0)
    verifier = SpeculativeSampler(temperature, top_k, top_p, torch.Generator().manual_seed(3))
    rng = torch.Generator().manual_seed(4)
    n = 3000
    samples = [
        first_two_tokens(verifier, target, draft, tree, sampled, rng, temperature) for _ in range(n)
    ]
    observed = torch.bincount(torch.tensor(samples), minlength=VOCAB * VOCAB).double()
    expected = joint_two(target, temperature, top_k, top_p)
    assert chisquare_pvalue(observed, expected) > 1e-3
    if temperature != 1.0:  # the test has power: the unprocessed distribution is rejected
        assert chisquare_pvalue(observed, joint_two(target, 1.0, 0, 1.0)) < 1e-6


def test_using_draft_probs_for_top_k_children_is_biased():
    """The guard in SpeculativeSampler's docstring: top-k children are not samples from q."""
    tree = build_tree(BRANCHED)
    target, draft = SyntheticLM(1), SyntheticLM(2, scale=1.0)
    verifier = SpeculativeSampler(1.0, generator=torch.Generator().manual_seed(3))
    rng = torch.Generator().manual_seed(4)
    counts = torch.zeros(VOCAB)
    for _ in range(3000):
        d, logits, q = make_step(target, draft, (0,), tree, False, rng, 1.0)
        wrong = Draft(d.tree, d.tokens, q)  # as if the top-k children had been sampled from q
        counts[verifier.verify(logits, wrong).tokens[0]] += 1
    assert chisquare_pvalue(counts, process_logits(target((0,)), 1.0)) < 1e-6


def test_sampler_rejects_bad_settings():
    with pytest.raises(ValueError, match="temperature"):
        SpeculativeSampler(0.0)
    with pytest.raises(ValueError, match="top_p"):
        SpeculativeSampler(1.0, top_p=0.0)
