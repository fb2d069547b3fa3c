"""What a block drafter's validation says about greedy chain decoding (heads/dflash.py
`walk_stats`, inherited by heads/dspark.py; the walk is heads/acceptance.py's).

DSpark's `tau_estimate` (1 + sum of prefix products of 1 - TV over uniformly drawn anchors) promised
1.83 where decoding measured 1.31 (docs/reports/2026-12-01-block-drafters/README.md). On tiny heads
fitted to a tiny target's greedy answers, so that chains are accepted for 0 to the whole block: the
validation walk `chain_tau_est` is the tau greedy chain decoding measures on those answers, token
for token and round for round, in padded and packed rows; DSpark's `tau_estimate` is not.
"""

from __future__ import annotations

import pytest
import torch
from conftest import diverse, make_llama, make_tokenizer

from data.dataset import collate, pack_examples
from eval.engine.block_proposer import BlockProposer
from eval.engine.generator import SpeculativeGenerator
from eval.engine.tree import chain_tree
from eval.engine.verify import GreedyVerifier
from heads.block_training import every_anchor, sample_anchors
from heads.dflash import DFlashConfig, DFlashHead
from heads.dspark import DSparkConfig, DSparkHead
from heads.target import Target
from heads.vocab import count_tokens
from lab.analysis.acceptance_gap import (
    analyse,
    causes,
    decode_stats,
    decode_turns,
    hf_greedy,
    queried_rows,
    summarize,
    teacher_forced,
    walked_rows,
)

PROMPTS = [[2, 40, 17, 99, 5, 63, 120, 8], [2, 41, 18, 9, 50, 6, 12], [2, 77, 30, 4, 91]]
NEW = 40


@pytest.fixture(scope="module")
def answered():
    """(target, examples): the tiny target's greedy answers to PROMPTS, labels on the answers."""
    model = diverse(make_llama(hidden=32), std=0.3, seed=1)
    target = Target.from_model(model, make_tokenizer(), name_or_path="tiny")
    examples = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0]
        mask = torch.zeros_like(out)
        mask[ids.shape[1] :] = 1
        examples.append({"input_ids": out, "loss_mask": mask})
    return target, examples


def fitted(target, examples, method: str, vocab: int, steps: int = 60):
    """A head of `method` over the `vocab` most frequent answer tokens, fitted to `examples`."""
    counts = count_tokens(examples, target.vocab_size)
    torch.manual_seed(0)
    if method == "dspark":
        config = DSparkConfig(block_size=4, num_anchors=16, markov_rank=8, draft_vocab_size=vocab)
        head = DSparkHead.for_target(config, target, token_counts=counts)
    else:
        config = DFlashConfig(block_size=5, num_anchors=16, draft_vocab_size=vocab)
        head = DFlashHead.for_target(config, target, token_counts=counts)
    batch = collate(examples)
    feats = target.features(batch["input_ids"], batch["attention_mask"], head.feature_layers())
    optimizer = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        loss = head.loss(batch, feats).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval()


def decoded(target, head, examples) -> tuple[int, int, set[int]]:
    """(tokens, rounds, accept lengths) of greedy chain decoding (a chain of the whole block)
    on PROMPTS, counted as the benchmark's tau counts them (the prefill's token left out)."""
    tokens = rounds = 0
    lengths: set[int] = set()
    for prompt, example in zip(PROMPTS, examples, strict=True):
        proposer = BlockProposer(head, chain_tree(head.max_draft_depth))
        gen = SpeculativeGenerator(target.model, proposer, GreedyVerifier())
        result = gen.generate(torch.tensor([prompt]), NEW)
        assert result.new_tokens.tolist() == example["input_ids"][len(prompt) :].tolist()
        tokens += result.new_tokens.numel() - 1
        rounds += len(result.accept_lengths)
        lengths |= set(result.accept_lengths)
    return tokens, rounds, lengths


def validation(head, target, batch) -> dict[str, tuple[float, float]]:
    feats = {}
    if "segment_ids" in batch:  # a packed row: each conversation's features on its own
        for seg in batch["segment_ids"][0].unique().tolist():
            part = batch["input_ids"][:, batch["segment_ids"][0] == seg]
            one = target.features(part, torch.ones_like(part), head.feature_layers())
            feats = {k: torch.cat([feats[k], v], 1) if feats else v for k, v in one.items()}
    else:
        feats = target.features(batch["input_ids"], batch["attention_mask"], head.feature_layers())
    with torch.no_grad():
        stats = head.validate(batch, feats).stats
    return {k: (float(s), float(c)) for k, (s, c) in stats.items()}


@pytest.mark.parametrize(
    "method, vocab", [("dspark", 24), ("dspark", 64), ("dspark", 256), ("dflash", 24)]
)
def test_validation_walk_is_the_tau_decoding_measures(answered, method, vocab):
    target, examples = answered
    head = fitted(target, examples, method, vocab)
    tokens, rounds, lengths = decoded(target, head, examples)
    assert len(lengths) >= 3  # rounds accept different numbers of drafted tokens
    padded = validation(head, target, collate(examples))
    assert padded["chain_tau_est"] == (tokens, rounds)
    packed = pack_examples(examples, sum(e["input_ids"].numel() for e in examples))
    assert len(packed) == 1
    batch = collate(packed)
    assert "segment_ids" in batch
    same = validation(head, target, batch)
    assert same["chain_tau_est"] == (tokens, rounds)
    for i in range(1, head.max_draft_depth + 1):
        for name in ("top1_all", "accept"):
            assert same[f"slot{i}/{name}"] == padded[f"slot{i}/{name}"]
    if method == "dspark":
        s, c = padded["tau_estimate"]
        assert abs(s / c - tokens / rounds) > 0.1  # the sampling estimate is not decoding's tau


def test_the_walk_follows_a_confidence_cut(answered):
    """With a confidence threshold (an evaluation setting) drafting stops before the first
    slot below it; the walk stops there too, and is still decoding's tau."""
    target, examples = answered
    head = fitted(target, examples, "dspark", 64)
    batch = collate(examples)
    uncut = validation(head, target, batch)["chain_tau_est"]
    feats = target.features(batch["input_ids"], batch["attention_mask"], head.feature_layers())
    anchors, valid = every_anchor(batch)
    with torch.no_grad():
        ok, _, _, conf = head.teacher_forced(batch, feats, anchors, valid)
    chance = torch.sigmoid(conf).sort().values
    head.config.confidence_threshold = float(chance[len(chance) // 3 :].mean())
    tokens, rounds, _ = decoded(target, head, examples)
    cut = validation(head, target, batch)["chain_tau_est"]
    assert cut == (tokens, rounds)
    assert cut[1] > uncut[1]  # the cut costs rounds


def test_the_gap_analysis_takes_a_block_drafter(answered):
    """lab/analysis/acceptance_gap.py on a DSpark head: the teacher-forced chains are what
    decoding drafted round by round, the walk is decoding's tau, and the trainer's
    `tau_estimate` heads the causes table."""
    target, examples = answered
    head = fitted(target, examples, "dspark", 24)
    prompts = [torch.tensor([p]) for p in PROMPTS]
    turns = decode_turns(head, target, prompts, NEW, depth=head.max_draft_depth)
    seqs = [teacher_forced(head, target, *turn.sequence()) for turn in turns]
    stats = decode_stats(turns, seqs)
    assert stats["greedy_mismatches"] == 0
    assert stats["drafted_mismatches"] == 0 and stats["accepted_mismatches"] == 0
    assert summarize(seqs)["tau_walk"] == pytest.approx(stats["tau"], abs=1e-12)
    assert walked_rows(seqs) == queried_rows(turns)
    bench = list(zip(prompts, hf_greedy(target, prompts, NEW), strict=True))
    fp32 = {"feature_dtype": torch.float32, "autocast": None}
    result = analyse(head, target, examples, bench, (), NEW, head.max_draft_depth, 1, fp32)
    steps = causes(result)
    assert steps[0][0].startswith("DSpark val/tau_estimate")
    assert steps[-1][2] == pytest.approx(0.0, abs=1e-12)  # decoding is the walk
    walk = result["validation"]["tau_walk"]
    assert result["validation_trainer"]["val/chain_tau_est"] == pytest.approx(walk)
    with pytest.raises(ValueError, match="drafts at most 4"):
        teacher_forced(head, target, *turns[0].sequence(), depth=5)


@pytest.mark.parametrize("method", ["dspark", "dflash"])
def test_the_walk_is_validation_only(answered, method):
    """`loss` never walks, in train or eval mode; `validate` is `loss` plus the walk."""
    target, examples = answered
    head = fitted(target, examples, method, 24, steps=0).train()
    batch = collate(examples)
    feats = target.features(batch["input_ids"], batch["attention_mask"], head.feature_layers())
    walked = {"chain_tau_est", "slot1/top1_all", "slot1/accept"}
    assert not walked & set(head.loss(batch, feats).stats)
    head.eval()
    with torch.no_grad():
        torch.manual_seed(3)  # the same anchors for both calls
        trained = head.loss(batch, feats)
        torch.manual_seed(3)
        validated = head.validate(batch, feats)
    assert not walked & set(trained.stats) and walked <= set(validated.stats)
    assert torch.equal(trained.loss, validated.loss)
    for key, value in trained.stats.items():
        assert torch.equal(value, validated.stats[key]), key


def test_every_anchor_is_every_position_anchors_are_drawn_from(answered):
    _, examples = answered
    for batch in (collate(examples), collate(pack_examples(examples, 100))):
        anchors, valid = every_anchor(batch)
        drawn, ok = sample_anchors(batch, batch["input_ids"].shape[1])
        for b in range(anchors.shape[0]):
            assert anchors[b][valid[b]].tolist() == drawn[b][ok[b]].tolist()  # both ascending
