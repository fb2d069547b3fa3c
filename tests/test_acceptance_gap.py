"""The chain estimate (heads/acceptance.py, EAGLE-3's validation stats) and the acceptance-gap
analysis (lab/analysis/acceptance_gap.py).

On a tiny EAGLE-3 head fitted to a tiny target's greedy answers (so that chains are accepted
for 0 to 3 tokens): the draft logits decoding computes in every round equal the training-time
-test unroll's for the same context and step (padded and packed rows), the walk over the
target's greedy answers reproduces the tau decoding measures, and validation's chain stats
equal the analysis's.
"""

from __future__ import annotations

import pytest
import torch
from conftest import diverse, make_llama

from data.dataset import collate
from eval.engine.drafting import make_proposer
from eval.engine.generator import SpeculativeGenerator
from eval.engine.tree_spec import resolve_tree
from eval.engine.verify import GreedyVerifier
from heads.acceptance import accepted_lengths, chain_tau, chain_walk, label_runs, walk_turn
from heads.eagle3 import Eagle3Config, Eagle3Head
from heads.target import Target
from heads.vocab import count_tokens
from lab.analysis.acceptance_gap import (
    ChainRecorder,
    analyse,
    causes,
    data_agreement,
    decode_stats,
    decode_turns,
    first_turn,
    first_turn_prompts,
    hf_greedy,
    markdown,
    queried_rows,
    summarize,
    teacher_forced,
    ttt_unroll,
    walked_rows,
)
from train.features import batch_features

PROMPTS = [[2, 40, 17, 99, 5, 63, 120, 8], [2, 41, 18, 9, 50, 6, 12]]
NEW = 24


# ---- the walk --------------------------------------------------------------------------------


def test_accepted_lengths_are_leading_runs():
    hits = torch.tensor([[[1, 0, 1, 1]], [[1, 1, 0, 1]], [[0, 1, 1, 1]]]).bool()  # (S, B, T)
    assert accepted_lengths(hits).tolist() == [[2, 0, 1, 3]]


def test_label_runs_split_at_gaps_and_conversations():
    assert label_runs([0, 1, 1, 0, 1, 1, 1]) == [(1, 2), (4, 6)]
    assert label_runs([1, 1, 1, 1], [1, 1, 2, 2]) == [(0, 1), (2, 3)]
    assert label_runs([0, 0]) == []


@pytest.mark.parametrize("accepted, rounds", [(0, 9), (1, 5), (3, 3)])
def test_walk_turn_counts_rounds(accepted, rounds):
    # labels 10..19: the first comes from the prompt's forward, 9 more take `rounds` rounds
    assert walk_turn([accepted] * 30, 10, 19) == rounds


def test_walk_skips_rows_decoding_never_queries():
    # row 4 accepts 3 (emits x6..x9); rows 5-7 would accept nothing but are never queried
    row = [0, 0, 0, 0, 3, 0, 0, 0, 3, 0, 0, 0]
    assert walk_turn(row, 5, 11) == 2
    tokens, rounds = chain_walk(torch.tensor([row]), torch.tensor([[0] * 5 + [1] * 7]))
    assert (tokens, rounds) == (6, 2)
    assert chain_tau([0.5, 0.5, 0.5]) == 1.875 and chain_tau([]) == 1.0


def test_walk_in_packed_rows_equals_the_conversations_walked_alone():
    """A conversation packed after another walks as it does alone, also when its labels start
    at its first token (then that token stands for the prompt, as at index 0)."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 4, (n,), generator=g) for n in (9, 7, 8)]
    masks = [torch.tensor([0, 0, 1, 1, 1, 1, 0, 1, 1]), torch.ones(7, dtype=torch.long),
             torch.tensor([1, 1, 1, 0, 0, 1, 1, 1])]  # fmt: skip
    alone = [chain_walk(r[None], m[None]) for r, m in zip(rows, masks, strict=True)]
    segments = torch.cat([torch.full((len(r),), k + 1) for k, r in enumerate(rows)])
    packed = chain_walk(torch.cat(rows)[None], torch.cat(masks)[None], segments[None])
    assert packed == tuple(map(sum, zip(*alone, strict=True)))


# ---- a tiny head that gets chains accepted ---------------------------------------------------


@pytest.fixture(scope="module")
def fitted():
    """(target, head, examples): EAGLE-3 (3 TTT steps, 32 of 256 tokens) fitted to the tiny
    target's greedy answers to PROMPTS."""
    from conftest import make_tokenizer

    model = diverse(make_llama(hidden=32), std=0.3, seed=1)
    target = Target.from_model(model, make_tokenizer(), name_or_path="tiny")
    examples = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = model.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=0)[0]
        mask = torch.zeros_like(out)
        mask[ids.shape[1] :] = 1
        examples.append({"input_ids": out, "loss_mask": mask})
    counts = count_tokens(examples, target.vocab_size)
    torch.manual_seed(0)
    config = Eagle3Config(draft_vocab_size=32, ttt_steps=3)
    head = Eagle3Head.for_target(config, target, token_counts=counts)
    batch = collate(examples)
    feats = target.features(batch["input_ids"], batch["attention_mask"], head.feature_layers())
    optimizer = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(60):
        loss = head.loss(batch, feats).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return target, head.eval(), examples


def _means(out) -> dict[str, float]:
    """A LossOutput's stats as sum / count (stats that counted nothing left out)."""
    return {k: float(s / c) for k, (s, c) in out.stats.items() if c > 0}


def _prompts():
    return [torch.tensor([p]) for p in PROMPTS]


def _record_step_logits(head, calls):
    """Wrap head.step (on this instance) to keep (last row's position, its logits)."""
    step = type(head).step

    def recording(tokens, hidden, position_ids, cache, attn_mask=None):
        out, logits = step(head, tokens, hidden, position_ids, cache, attn_mask)
        calls.append((int(position_ids[0, -1]), logits[0, -1].clone()))
        return out, logits

    head.step = recording


@torch.no_grad()
def test_decoding_draft_logits_equal_the_training_unroll(fitted):
    """Round by round (partial acceptance, bonus tokens, the draft cache refreshed from target
    features): the logits decoding drafts depth d with equal the unroll's step d-1 at row
    position - 1, fed the same context and the drafted chain, padded and packed."""
    target, head, _ = fitted
    calls: list = []
    recorder = ChainRecorder(make_proposer(head, resolve_tree(3)))
    _record_step_logits(head, calls)
    try:
        gen = SpeculativeGenerator(target.model, recorder, GreedyVerifier())
        result = gen.generate(_prompts()[0], NEW)
    finally:
        del head.step
    assert len(calls) == 3 * len(recorder.rounds)  # the root's scores, then depths 1 and 2
    lengths = set(result.accept_lengths)
    assert len(lengths) >= 2 and lengths & {2, 3}, lengths  # partial acceptance happens
    full = result.tokens[0].tolist()
    layers = head.feature_layers()
    for k, (position, chain) in enumerate(recorder.rounds):
        ids = torch.tensor(full[: position + 1] + chain[:-1])  # context, root, drafted nodes
        feats = target.features(ids[None], torch.ones_like(ids)[None], layers)
        unrolled = ttt_unroll(head, {"input_ids": ids[None]}, feats, 3)
        # packed after another conversation: positions restart, the segment mask isolates it
        other = torch.tensor(PROMPTS[1])
        packed = {
            "input_ids": torch.cat([other, ids])[None],
            "segment_ids": torch.tensor([1] * len(other) + [2] * len(ids))[None],
            "position_ids": torch.cat([torch.arange(len(other)), torch.arange(len(ids))])[None],
            "attention_mask": torch.ones(1, len(other) + len(ids), dtype=torch.long),
        }
        packed_out = ttt_unroll(head, packed, batch_features(packed, target, layers), 3)
        for depth in range(3):
            where, drafted = calls[3 * k + depth]
            assert where == position - 1 + depth
            want = head.logits(unrolled[depth][0, position - 1])
            torch.testing.assert_close(drafted, want, atol=1e-5, rtol=1e-4)
            row = len(other) + position - 1
            torch.testing.assert_close(head.logits(packed_out[depth][0, row]), want,
                                       atol=1e-5, rtol=1e-4)  # fmt: skip


@torch.no_grad()
def test_walk_on_greedy_answers_is_the_measured_tau(fitted):
    target, head, _ = fitted
    turns = decode_turns(head, target, _prompts(), NEW, depth=3)
    seqs = [teacher_forced(head, target, *turn.sequence(), 3) for turn in turns]
    decoded = decode_stats(turns, seqs)
    assert decoded["greedy_mismatches"] == 0  # lossless against HF generate
    assert decoded["drafted_mismatches"] == 0 and decoded["accepted_mismatches"] == 0
    everywhere, queried = summarize(seqs), summarize(seqs, queried_rows(turns))
    assert 1.5 < decoded["tau"] < 4
    assert everywhere["tau_walk"] == pytest.approx(decoded["tau"], abs=1e-12)
    assert queried["accept"] == pytest.approx(decoded["accept"], abs=1e-12)
    assert walked_rows(seqs) == queried_rows(turns)  # the walk queries where decoding did
    assert data_agreement(seqs, [turn.sequence() for turn in turns]) == 1.0


@torch.no_grad()
def test_validation_chain_stats_equal_the_analysis(fitted):
    """Eagle3Head.validate reports top-1 over all positions, conditional acceptance and the
    walk; they equal the analysis's (in-vocab top-1 equals the loss's step top-1)."""
    target, head, examples = fitted
    batch = collate(examples)
    feats = target.features(batch["input_ids"], batch["attention_mask"], head.feature_layers())
    stats = _means(head.validate(batch, feats))
    seqs = [teacher_forced(head, target, e["input_ids"], e["loss_mask"], 3) for e in examples]
    want = summarize(seqs)
    assert 0 < want["outside_vocab"][0] < 0.5 and want["top1_all"][0] > 0.3
    for i in range(3):
        assert stats[f"step{i}/top1"] == pytest.approx(want["top1_in_vocab"][i])
        assert stats[f"step{i}/top1_all"] == pytest.approx(want["top1_all"][i])
        assert stats[f"step{i}/accept"] == pytest.approx(want["accept"][i])
    assert stats["chain_tau_est"] == pytest.approx(want["tau_walk"])
    assert want["tau_walk"] < want["tau_in_vocab"]


@torch.no_grad()
def test_the_training_loss_leaves_the_estimates_to_validate(fitted):
    """`loss` returns the loss and the stats training logs, in train and eval mode alike;
    `validate` returns the same loss and stats plus the chain estimates."""
    target, head, examples = fitted
    batch = collate(examples)
    feats = target.features(batch["input_ids"], batch["attention_mask"], head.feature_layers())
    estimates = {"chain_tau_est", "step0/top1_all", "step2/accept"}
    validated = head.validate(batch, feats)
    assert estimates <= set(validated.stats)
    trained = head.loss(batch, feats)  # eval mode: the same unroll, no noise, no dropout
    assert not estimates & set(trained.stats)
    assert torch.equal(trained.loss, validated.loss)
    for key, value in trained.stats.items():
        assert torch.equal(value, validated.stats[key]), key
    head.train()
    try:
        assert not estimates & set(head.loss(batch, feats).stats)
    finally:
        head.eval()


def test_trainer_validation_calls_validate(fitted):
    """train/validation.py's evaluate_head reports a `Validates` head's estimates: val/chain_tau_est
    is the analysis's walk."""
    from accelerate import Accelerator

    from train.validation import evaluate_head

    target, head, examples = fitted
    acc = Accelerator(cpu=True)
    metrics, _ = evaluate_head(
        acc, head, examples, collate, target=target, layers=head.feature_layers(), batch_size=2
    )
    seqs = [teacher_forced(head, target, e["input_ids"], e["loss_mask"], 3) for e in examples]
    assert metrics["val/chain_tau_est"] == pytest.approx(summarize(seqs)["tau_walk"])
    assert "val/step0/loss" in metrics and not head.training


def test_horizon_walk_keeps_each_turns_first_tokens():
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 1, 1, 1]])
    none = torch.zeros_like(mask)
    # turns 1..5 and 7..9; each turn's first token is the prompt's, so 4 + 2 tokens, 1 a round
    assert chain_walk(none, mask) == (6, 6)
    assert chain_walk(none, mask, horizon=3) == (4, 4)  # 1..3 and 7..9
    assert chain_walk(none, mask, horizon=100) == chain_walk(none, mask)


@torch.no_grad()
def test_horizon_estimate_is_the_tau_of_a_shorter_benchmark(fitted):
    """chain_tau_est_horizon over the target's 40-token greedy answers equals the tau decoding
    measures when it stops at max_new_tokens = the horizon."""
    target, head, examples = fitted
    horizon = 10
    turns = decode_turns(head, target, _prompts(), horizon, depth=3)
    decoded = decode_stats(turns, [teacher_forced(head, target, *t.sequence(), 3) for t in turns])
    assert decoded["greedy_mismatches"] == 0 and decoded["tau"] > 1.2
    batch = collate(examples)
    feats = target.features(batch["input_ids"], batch["attention_mask"], head.feature_layers())
    kept = head.config.estimate_horizon
    try:
        head.config.estimate_horizon = horizon
        stats = _means(head.validate(batch, feats))
        # equal up to the float32 of the stat's sums (integer tokens over integer rounds)
        assert stats["chain_tau_est_horizon"] == pytest.approx(decoded["tau"], abs=1e-6)
        head.config.estimate_horizon = 40  # the whole answers: the plain estimate
        stats = _means(head.validate(batch, feats))
        assert stats["chain_tau_est_horizon"] == pytest.approx(stats["chain_tau_est"])
        head.config.estimate_horizon = None
        assert "chain_tau_est_horizon" not in head.validate(batch, feats).stats
    finally:
        head.config.estimate_horizon = kept


def test_estimate_horizon_must_be_positive():
    from heads.dflash import DFlashConfig

    for make in (Eagle3Config, DFlashConfig):
        with pytest.raises(ValueError, match="estimate_horizon=0"):
            make(estimate_horizon=0)


def test_first_turn_keeps_the_first_answer():
    ids = torch.arange(10)
    mask = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1, 1, 0])
    got_ids, got_mask = first_turn(ids, mask)
    assert got_ids.tolist() == [0, 1, 2, 3] and got_mask.tolist() == [0, 0, 1, 1]


@torch.no_grad()
def test_analyse_splits_the_gap(fitted):
    target, head, examples = fitted
    prompts = _prompts()
    bench = list(zip(prompts, hf_greedy(target, prompts, NEW), strict=True))
    firsts = first_turn_prompts(examples)
    answers = hf_greedy(target, [p for p, _ in firsts], [n for _, n in firsts])
    regenerated = [(p, a) for (p, _), a in zip(firsts, answers, strict=True)]
    fp32 = {"feature_dtype": torch.float32, "autocast": None}
    result = analyse(head, target, examples, bench, regenerated, NEW, 3, 1, fp32)
    # one prompt decoded, both walked
    assert 0 < result["decode_queried"]["rows"] < result["mt_bench_queried"]["rows"]
    steps = causes(result)
    assert steps[-1][2] == pytest.approx(0.0, abs=1e-12)  # (d): decoding is the walk
    # the fitted examples are the target's own greedy answers: regenerating changes nothing
    first, greedy = (s for s in steps if s[0].startswith(("    first", "(e)")))
    assert greedy[1] == pytest.approx(first[1]) and greedy[2] == pytest.approx(0.0)
    # what the trainer logs (head.validate) is the analysis's walk
    walk = result["validation"]["tau_walk"]
    assert result["validation_trainer"]["val/chain_tau_est"] == pytest.approx(walk)
    table = markdown(result)
    assert "(c) only the positions decoding" in table and "drafted-token mismatches" in table


def test_script_on_a_run_dir(tmp_path):
    """scripts/acceptance_gap.py on a run dir (config.yaml and a head; eagle3_tiny's target and
    data): the table prints and the JSON holds every section."""
    import json
    import sys
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from heads.target import load_target
    from train.rundir import write_run_config

    root = Path(__file__).resolve().parents[1]
    with initialize_config_dir(config_dir=str(root / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=eagle3_tiny", "data.max_length=128"])
    write_run_config(tmp_path, OmegaConf.to_container(cfg, resolve=True))
    target = load_target(instantiate(cfg.model))
    torch.manual_seed(0)
    counts = torch.arange(target.vocab_size).flip(0)  # any counts: a reduced vocabulary
    config = Eagle3Config(draft_vocab_size=512, ttt_steps=3)
    head = Eagle3Head.for_target(config, target, token_counts=counts)
    head.save_pretrained(tmp_path / "head")
    sys.path.insert(0, str(root / "scripts"))
    from acceptance_gap import main

    out = tmp_path / "gap.json"
    args = ["--run-dir", str(tmp_path), "--limit", "2", "--max-new-tokens", "6"]
    assert main([*args, "--val-limit", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["decode"]["greedy_mismatches"] == 0
    assert result["setup"]["validation_conversations"] == 2
    assert result["validation"]["rows"] > 0 and result["mt_bench"]["rows"] > 0


def test_references_are_cached_per_target_prompts_and_length(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from lab.analysis import acceptance_gap

    calls = []

    def fake_greedy(target, prompts, max_new_tokens):
        calls.append(len(prompts))
        return [[7] * max_new_tokens for _ in prompts]

    monkeypatch.setattr(acceptance_gap, "hf_greedy", fake_greedy)
    target = SimpleNamespace(fingerprint="t1")
    prompts = [torch.tensor([[1, 2]]), torch.tensor([[3]])]
    path = str(tmp_path / "refs.json")
    assert acceptance_gap.references_for(path, target, prompts, 2) == [[7, 7], [7, 7]]
    assert acceptance_gap.references_for(path, target, prompts[:1], 2) == [[7, 7]]  # read back
    assert calls == [2]
    acceptance_gap.references_for(path, target, prompts, 3)  # another length: computed again
    acceptance_gap.references_for(path, SimpleNamespace(fingerprint="t2"), prompts, 3)
    acceptance_gap.references_for(None, target, prompts, 3)  # no cache: always computed
    assert calls == [2, 2, 2, 2]


def test_script_without_a_head_is_a_usage_error(tmp_path, monkeypatch, capsys):
    import sys
    from pathlib import Path

    from lab.analysis import acceptance_gap

    monkeypatch.setattr(acceptance_gap, "load_run", lambda run_dir: (None, [], {}))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from acceptance_gap import main

    with pytest.raises(SystemExit) as stop:
        main(["--run-dir", str(tmp_path)])
    assert stop.value.code == 2 and "holds no head (best_head/ or head/)" in capsys.readouterr().err
