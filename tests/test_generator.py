"""The decoding loop on tiny random targets: speculative greedy output == HF generate, always.

Stub Medusa heads stand in for trained ones: an oracle that ranks the target's own future greedy
tokens first, a random one, and oracles that are right for the first L heads only (forcing an
accept length of exactly L + 1 on a chain).
"""

from __future__ import annotations

import pytest
import torch
from conftest import diverse, make_llama, make_qwen2

from eval.engine.generator import SpeculativeGenerator, plain_greedy
from eval.engine.proposers import MedusaProposer
from eval.engine.tree import build_tree, chain_tree
from eval.engine.verify import GreedyVerifier, SpeculativeSampler, TypicalVerifier

VOCAB, NUM_HEADS, NEW = 256, 4, 24
TREE16 = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0]]
TREE16 += [[1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0], [0, 1, 0, 0]]


class StubHeads:
    """heads(hidden [H]) -> logits [NUM_HEADS, VOCAB], knowing the target's greedy future.

    It finds the position t whose target hidden state equals `hidden` (so a wrong hidden from the
    generator fails loudly), then head k scores x_{t+k+2}: first if k < correct_heads, else never
    in its top ranks. Other tokens get seeded noise. random=True ignores the future entirely.
    """

    def __init__(self, model, sequence: torch.Tensor, correct_heads=NUM_HEADS, random=False):
        with torch.no_grad():
            out = model(input_ids=sequence[None], output_hidden_states=True)
        self.hiddens = out.hidden_states[-1][0]  # [S, H]
        self.sequence, self.correct_heads, self.random = sequence, correct_heads, random

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        dist = (self.hiddens - hidden).norm(dim=-1)
        t = int(dist.argmin())
        g = torch.Generator().manual_seed(1000 + t)
        logits = torch.randn(NUM_HEADS, VOCAB, generator=g)
        if self.random:
            return logits
        assert float(dist[t]) < 1e-3, "the proposer got a hidden state from no greedy position"
        for k in range(NUM_HEADS):
            if t + k + 2 < self.sequence.numel():
                token = self.sequence[t + k + 2]
                logits[k, token] = 10.0 if k < self.correct_heads else -10.0
        return logits

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    return diverse((make_llama if request.param == "llama" else make_qwen2)(hidden=32))


PROMPT = torch.tensor([[2, 40, 17, 99, 5, 63, 120, 8]])


def hf_greedy(model, n, eos=None):
    out = model.generate(
        PROMPT, max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0
    )
    return out[0, PROMPT.shape[1] :]


@pytest.fixture(scope="module")
def greedy_future(model):
    """Prompt + the target's greedy continuation, long enough for every head's lookahead."""
    return torch.cat([PROMPT[0], hf_greedy(model, NEW + NUM_HEADS + 2)])


def speculative(model, heads, tree, verifier=None, **kwargs):
    proposer = MedusaProposer(heads, tree)
    return SpeculativeGenerator(model, proposer, verifier or GreedyVerifier(), **kwargs)


@pytest.mark.parametrize("tree_name", ["chain", "tree16"])
@pytest.mark.parametrize("stub", ["oracle", "random"])
def test_greedy_speculation_equals_hf_generate(model, greedy_future, tree_name, stub):
    tree = chain_tree(4) if tree_name == "chain" else build_tree(TREE16)
    heads = StubHeads(model, greedy_future, random=stub == "random")
    result = speculative(model, heads, tree).generate(PROMPT, NEW)
    assert result.new_tokens.tolist() == greedy_future[PROMPT.shape[1] :][:NEW].tolist()
    assert result.tokens[0, : PROMPT.shape[1]].equal(PROMPT[0])
    assert result.stop_reason == "max_new_tokens"
    assert result.num_target_forwards == 1 + len(result.accept_lengths)
    if stub == "oracle":  # every step accepts the whole depth plus the bonus
        assert set(result.accept_lengths) == {5}
        assert result.num_target_forwards == 1 + -(-(NEW - 1) // 5)


@pytest.mark.parametrize("accept", [0, 1, 2, 3, 4])
def test_stub_heads_force_each_accept_length(model, greedy_future, accept):
    heads = StubHeads(model, greedy_future, correct_heads=accept)
    for tree in (chain_tree(4), build_tree(TREE16)):
        result = speculative(model, heads, tree).generate(PROMPT, NEW)
        assert result.new_tokens.tolist() == greedy_future[PROMPT.shape[1] :][:NEW].tolist()
        assert set(result.accept_lengths) == {accept + 1}


def test_eos_inside_an_accepted_path_truncates_there(model, greedy_future):
    new = greedy_future[PROMPT.shape[1] :].tolist()
    # the first token is from the prefill; steps of 5 then cover new[1:6], new[6:11], ...
    j = next(j for j in range(2, NEW) if j % 5 not in (0, 1) and new[j] not in new[:j])
    eos = new[j]
    heads = StubHeads(model, greedy_future)
    result = speculative(model, heads, chain_tree(4), eos_token_id=[eos, 255]).generate(PROMPT, NEW)
    assert result.new_tokens.tolist() == new[: j + 1] == hf_greedy(model, NEW, eos).tolist()
    assert result.stop_reason == "eos"
    assert sum(result.accept_lengths) + 1 > j + 1  # the last step was cut inside its path


def test_context_limit_shrinks_the_tree_and_stops(model, greedy_future):
    limit = PROMPT.shape[1] + 9  # the second tree step has room for depth 3 only
    heads = StubHeads(model, greedy_future)
    gen = speculative(model, heads, build_tree(TREE16), max_context=limit)
    result = gen.generate(PROMPT, 100)
    assert result.tokens.shape[1] == limit and result.stop_reason == "context"
    assert result.new_tokens.tolist() == greedy_future[PROMPT.shape[1] : limit].tolist()
    assert result.accept_lengths[-1] < 5  # the last tree was cut to fit
    with pytest.raises(ValueError, match="no room"):
        speculative(model, heads, chain_tree(2), max_context=8).generate(PROMPT, 4)


def test_plain_greedy_baseline(model, greedy_future):
    result = plain_greedy(model, PROMPT, NEW)
    assert result.new_tokens.tolist() == greedy_future[PROMPT.shape[1] :][:NEW].tolist()
    assert result.num_target_forwards == NEW and set(result.accept_lengths) == {1}
    assert result.tau == 1.0 and result.seconds > 0


def test_top_k_1_sampling_is_greedy_and_sampling_is_reproducible(model, greedy_future):
    heads = StubHeads(model, greedy_future, random=True)
    greedy = greedy_future[PROMPT.shape[1] :][:NEW].tolist()
    for tree in (chain_tree(3), build_tree(TREE16)):
        sampler = SpeculativeSampler(0.9, top_k=1, generator=torch.Generator().manual_seed(0))
        assert (
            speculative(model, heads, tree, sampler).generate(PROMPT, NEW).new_tokens.tolist()
            == greedy
        )

    def sample(seed):
        sampler = SpeculativeSampler(1.0, top_p=0.9, generator=torch.Generator().manual_seed(seed))
        return speculative(model, heads, build_tree(TREE16), sampler)

    first = sample(5).generate(PROMPT, NEW).new_tokens
    assert first.equal(sample(5).generate(PROMPT, NEW).new_tokens)
    assert first.numel() == NEW and int(first.max()) < VOCAB


def test_typical_acceptance_runs(model, greedy_future):
    verifier = TypicalVerifier(0.7, generator=torch.Generator().manual_seed(0))
    heads = StubHeads(model, greedy_future, random=True)
    result = speculative(model, heads, build_tree(TREE16), verifier)
    out = result.generate(PROMPT, NEW)
    assert out.new_tokens.numel() == NEW and out.num_target_forwards < NEW


def test_real_medusa_heads_are_lossless(tiny_target):
    from heads.medusa import MedusaConfig, MedusaHeads

    model = tiny_target.model
    want = plain_greedy(model, PROMPT, 16).new_tokens
    counts = torch.arange(tiny_target.vocab_size)  # any counts: picks a reduced draft vocab
    for config in (MedusaConfig(num_heads=3), MedusaConfig(num_heads=3, draft_vocab_size=64)):
        heads = MedusaHeads.for_target(config, tiny_target, token_counts=counts).eval()
        proposer = MedusaProposer(heads, build_tree(TREE16[:10]))  # depth 3
        gen = SpeculativeGenerator(model, proposer, GreedyVerifier(), eos_token_id=None)
        assert gen.generate(PROMPT, 16).new_tokens.equal(want)


def test_misconfigurations_are_refused(model, greedy_future):
    heads = StubHeads(model, greedy_future)
    tree5 = chain_tree(5)
    with pytest.raises(ValueError, match="Medusa heads"):
        speculative(model, heads, tree5).generate(PROMPT, 4)
    with pytest.raises(ValueError, match="batch size 1"):
        speculative(model, heads, chain_tree(2)).generate(PROMPT.repeat(2, 1), 4)
