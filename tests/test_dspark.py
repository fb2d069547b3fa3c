"""DSpark block drafting (heads/dspark.py through eval/engine/block_proposer.py) on tiny Llama
and Qwen2 targets.

- training input equals inference input: the teacher-forced slot logits (Markov bias included)
  and confidence logits equal the drafted block's for the same previous tokens;
- the draft's context cache after every step equals a recompute from the committed tokens;
- greedy output equals HF generate (random heads; an oracle forcing every accept length up to
  the whole block, an EOS inside the block, the context limit, confidence cuts);
- sampling with sampled chains is lossless (chi-square);
- training lowers the loss; the L1/TV/BCE terms on a hand-computed case; configs and save/load.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import diverse, make_llama, make_qwen2, make_tokenizer
from test_eagle_decode import chisquare_pvalue

from data.errors import ConfigError
from eval.engine import kv_cache
from eval.engine.block_proposer import BlockProposer
from eval.engine.drafting import make_proposer
from eval.engine.generator import SpeculativeGenerator
from eval.engine.proposers import DecodeState
from eval.engine.tree import build_tree, chain_tree
from eval.engine.tree_spec import resolve_tree
from eval.engine.verify import GreedyVerifier, SpeculativeSampler, process_logits
from heads.block_training import position_weights
from heads.dspark import DSparkConfig, DSparkHead, dspark_terms
from heads.target import Target

PROMPT = torch.tensor([[2, 40, 17, 99, 5, 63, 120, 8]])
NEW = 20


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request):
    make = make_llama if request.param == "llama" else make_qwen2
    model = diverse(make(hidden=32, layers=4))
    return Target.from_model(model, make_tokenizer(), name_or_path=f"tiny-{request.param}")


@pytest.fixture(scope="module")
def greedy_future(target):
    out = target.model.generate(PROMPT, max_new_tokens=NEW + 8, do_sample=False, pad_token_id=0)
    return out[0]


def real_head(target, block_size=4, reduced=False, **kw):
    torch.manual_seed(3)
    config = DSparkConfig(
        block_size=block_size,
        num_anchors=8,
        markov_rank=8,
        draft_vocab_size=target.vocab_size // 2 if reduced else None,
        **kw,
    )
    counts = torch.arange(target.vocab_size).flip(0) if reduced else None
    head = DSparkHead.for_target(config, target, token_counts=counts)
    return diverse(head, std=0.3, seed=4).eval()  # a non-zero Markov bias too


def generate(model, proposer, n=NEW, verifier=None, prompt=PROMPT, **kwargs):
    gen = SpeculativeGenerator(model, proposer, verifier or GreedyVerifier(), **kwargs)
    return gen.generate(prompt, n)


def test_config_errors(tiny_llama):
    with pytest.raises(ValueError, match="markov_rank=-1"):
        DSparkConfig(markov_rank=-1)
    with pytest.raises(ValueError, match="markov_rank=0"):  # rank 0 has no Markov head to read
        DSparkConfig(markov_rank=0)
    assert DSparkConfig(markov_rank=0, enable_confidence_head=False).markov_rank == 0
    with pytest.raises(ValueError, match="markov_head_type='gated'"):
        DSparkConfig(markov_head_type="gated")
    with pytest.raises(ValueError, match="confidence_threshold=1.5"):
        DSparkConfig(confidence_threshold=1.5)
    with pytest.raises(ValueError, match="needs the confidence head"):
        DSparkConfig(confidence_threshold=0.5, enable_confidence_head=False)
    with pytest.raises(ValueError, match="head.loss='kd' is DFlash's option"):
        DSparkConfig(loss="kd")
    with pytest.raises(ValueError, match="non-negative weights"):
        DSparkConfig(l1_weight=-1.0)
    with pytest.raises(ValueError, match="block_size=1"):
        DSparkConfig(block_size=1)
    head = DSparkHead.for_target(DSparkConfig(block_size=3), tiny_llama)
    assert head.max_draft_depth == 3  # every slot drafts
    BlockProposer(head, chain_tree(3))
    with pytest.raises(ValueError, match="drafts at most 3 tokens"):
        BlockProposer(head, chain_tree(4))
    with pytest.raises(ValueError, match="drafts a static tree only"):
        make_proposer(head, resolve_tree("dynamic"))
    # a slot conditions on the token before it: a tree with branches is refused when the
    # proposer is made, naming the chain to use instead
    with pytest.raises(ConfigError, match=r"drafts a chain .* use tree=3 \(a chain of 3\)"):
        BlockProposer(head, build_tree([[0], [1], [0, 0]]))


def _state(target, head, ids=PROMPT):
    out = kv_cache.forward_features(
        target.model, kv_cache.make_cache(target.model), ids, layers=head.feature_layers()
    )
    return DecodeState(
        out.hidden, torch.cat([ids[0, 1:], torch.tensor([7])]), ids.shape[1], out.aux
    )


# ---- training input == inference input ------------------------------------------------------


@pytest.mark.parametrize("reduced", [False, True])
def test_teacher_forced_slots_equal_the_drafted_chain(target, reduced):
    """Write each anchor's greedy chain into the data after it: the training path, which takes
    the data's tokens as the previous tokens, must then score every slot exactly as drafting."""
    head = real_head(target, block_size=4, reduced=reduced)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, target.vocab_size, (1, 24), generator=g)
    anchors = torch.tensor([[3, 9, 15]])
    layers = head.feature_layers()
    drafted = {}
    with torch.no_grad():
        for a in anchors[0].tolist():  # in order: each chain becomes later anchors' context
            cache = head.new_cache()
            ctx = head.context(target.features(ids[:, :a], torch.ones_like(ids[:, :a]), layers))
            head.extend_cache(cache, ctx, torch.arange(a)[None])
            position = torch.tensor([a])
            tokens, _ = head.draft_chain(ids[0, a : a + 1], position, cache, head.block_size)
            block = head.draft_block(ids[0, a : a + 1], position, cache)[0]  # (Bk, D)
            assert tokens.tolist() == head.draft_to_target(block.argmax(-1)).tolist()
            hidden = head.block_hidden(ids[0, a : a + 1], position, cache)[0]
            prev = torch.cat([ids[0, a : a + 1], tokens[:-1]])
            conf = head.confidence(hidden, head.markov_head.embed(prev))
            drafted[a] = (block, conf)
            ids[0, a + 1 : a + 1 + head.block_size] = tokens
        batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}
        feats = target.features(ids, torch.ones_like(ids), layers)
        valid = torch.ones_like(anchors, dtype=torch.bool)
        ok, labels, logits, conf = head.teacher_forced(batch, feats, anchors, valid)
    assert bool(ok.all()) and logits.shape == (3 * head.block_size, head.draft_vocab_size)
    for j, a in enumerate(anchors[0].tolist()):
        rows = slice(j * head.block_size, (j + 1) * head.block_size)
        torch.testing.assert_close(logits[rows], drafted[a][0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(conf[rows], drafted[a][1], atol=1e-4, rtol=1e-4)
        assert labels[0, j].tolist() == ids[0, a + 1 : a + 1 + head.block_size].tolist()


def test_only_the_labelled_run_from_the_anchor_is_scored(target):
    head = real_head(target, block_size=4)
    ids = torch.arange(10, 30)[None]
    loss = torch.ones_like(ids)
    loss[0, 7] = 0  # a hole: the block at anchor 4 scores x5, x6 only
    batch = {"input_ids": ids, "loss_mask": loss}
    feats = target.features(ids, torch.ones_like(ids), head.feature_layers())
    anchors, valid = torch.tensor([[4, 8, 17]]), torch.tensor([[True, True, True]])
    with torch.no_grad():
        ok, labels, _, _ = head.teacher_forced(batch, feats, anchors, valid)
    assert ok[0].tolist() == [
        [True, True, False, False],
        [True, True, True, True],
        [True, True, False, False],  # x18, x19; the row ends
    ]
    assert labels[0, 1].tolist() == [19, 20, 21, 22]  # slot k is x_{a+k+1}


# ---- the loss ------------------------------------------------------------------------------


def test_loss_terms_on_a_hand_computed_case():
    config = DSparkConfig(ce_weight=0.1, l1_weight=0.9, confidence_weight=1.0)
    q = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    p = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    conf = torch.tensor([0.0, math.log(3.0)])  # sigmoid: 0.5, 0.75
    terms = dspark_terms(q.log(), torch.tensor([0, 1]), p, conf, config)
    torch.testing.assert_close(terms.ce, torch.tensor([-math.log(0.75), math.log(2.0)]))
    torch.testing.assert_close(terms.l1, torch.tensor([1.0, 0.0]))  # sum |q - p| = 2 TV
    torch.testing.assert_close(terms.accept, torch.tensor([0.5, 1.0]))  # 1 - TV
    bce = torch.tensor([math.log(2.0), -math.log(0.75)])  # -(a log s + (1 - a) log(1 - s))
    torch.testing.assert_close(terms.bce, bce)
    want = 0.1 * terms.ce + 0.9 * terms.l1 + bce
    torch.testing.assert_close(terms.total, want)
    # the confidence target carries no gradient; the L1 term does
    logits = q.log().requires_grad_()
    conf = conf.clone().requires_grad_()
    dspark_terms(logits, torch.tensor([0, 1]), p, conf, config).bce.sum().backward()
    assert logits.grad is None and conf.grad is not None


def test_slot_weights_decay_from_the_first_drafted_token(target):
    head = real_head(target, block_size=4)
    ok = torch.tensor([[[True, True, True, False]]])
    w = position_weights(torch.zeros(ok.shape), ok, 0, head.config)
    torch.testing.assert_close(w, torch.tensor([[[1.0, math.exp(-0.25), math.exp(-0.5), 0.0]]]))


@pytest.mark.parametrize("options", [{}, {"weighting": "dpace", "enable_confidence_head": False}])
def test_training_lowers_the_loss(target, options):
    head = real_head(target, block_size=4, **options)
    head.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, target.vocab_size, (2, 24), generator=g)
    loss = torch.zeros_like(ids)
    loss[:, 5:] = 1
    batch = {"input_ids": ids, "loss_mask": loss}
    feats = target.features(ids, torch.ones_like(ids), head.feature_layers())
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    losses, ce = [], []
    for _ in range(30):
        torch.manual_seed(1)
        out = head.loss(batch, feats)
        losses.append(float(out.loss.detach()))
        ce.append(float(out.stats["ce"][0] / out.stats["ce"][1]))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    # the BCE and L1 terms have floors above 0 (soft targets), so the total falls less than CE
    assert losses[-1] < 0.8 * losses[0] and ce[-1] < 0.7 * ce[0]
    trained = [head.markov_head.markov_w1, head.markov_head.markov_w2, head.confidence_head]
    for module in trained[: 3 if head.confidence_head is not None else 2]:
        grads = [p.grad.abs().sum() for p in module.parameters()]
        assert all(float(x) > 0 for x in grads), module
    assert ("confidence/bce" in out.stats) == (head.confidence_head is not None)
    for name in ("ce", "tv", "tau_estimate", "slot1/top1", "slot4/top1"):
        assert out.stats[name][1] > 0, name
    tau = out.stats["tau_estimate"]
    assert 1.0 <= float(tau[0] / tau[1]) <= 1.0 + head.block_size


# ---- decoding ------------------------------------------------------------------------------


class Recorder:
    """A proposer that records each state and the committed context cache after its step."""

    def __init__(self, inner):
        self.inner, self.feature_layers, self.steps = inner, inner.feature_layers, []

    def propose(self, state):
        draft = self.inner.propose(state)
        layer = self.inner.cache.layers[-1]
        self.steps.append((state, layer.keys.clone(), layer.values.clone()))
        return draft


def test_context_cache_after_each_step_equals_a_recompute(target):
    head = real_head(target)
    recorder = Recorder(BlockProposer(head, chain_tree(4)))
    with torch.no_grad():
        sequence = generate(target.model, recorder).tokens[0]
        assert len(recorder.steps) >= 3
        for state, keys, values in recorder.steps:
            ids = sequence[: state.position][None]
            feats = target.features(ids, torch.ones_like(ids), head.feature_layers())
            want = head.context_keys_values(head.context(feats), torch.arange(ids.shape[1])[None])
            assert keys.shape[2] == state.position
            torch.testing.assert_close(keys, want[-1][0], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(values, want[-1][1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("reduced", [False, True])
def test_random_heads_are_lossless(target, greedy_future, reduced):
    head = real_head(target, reduced=reduced)
    want = greedy_future[PROMPT.shape[1] :][:NEW].tolist()
    for depth in (4, 2):
        proposer = make_proposer(head, resolve_tree(depth))
        assert isinstance(proposer, BlockProposer)
        assert generate(target.model, proposer).new_tokens.tolist() == want


def oracle(head, future, correct, cut=None):
    """The head, drafting through its own Markov walk but with slot logits that know the
    target's greedy future (right for slots k < correct, wrong beyond) and a confidence that
    falls below 0.5 from slot `cut` on."""
    real_chain = head.draft_chain
    V = head.draft_vocab_size
    step = {}

    def draft_chain(root, position, cache, depth, draft_temperature=None, generator=None):
        p = int(position[0])
        assert int(root[0]) == int(future[p]), "the root is the token at the block's position"
        assert cache.length == p, "the context holds every position before the root"
        step.update(p=p, k=0)
        return real_chain(root, position, cache, depth, draft_temperature, generator)

    def slot_logits(hidden, embedding):
        k, p = step["k"], step["p"]
        step["k"] += 1
        true = int(future[p + k + 1]) if p + k + 1 < future.numel() else 0
        out = torch.zeros(V)
        out[true if k < correct else (true + 1) % V] = 10.0
        return out

    def confidence(hidden, embedding):
        return torch.tensor(5.0 if cut is None or step["k"] < cut else -5.0)

    head.draft_chain, head.slot_logits, head.confidence = draft_chain, slot_logits, confidence
    return head


@pytest.mark.parametrize("correct", [0, 2, 4])
def test_oracle_forces_each_accept_length(target, greedy_future, correct):
    head = oracle(real_head(target), greedy_future, correct)
    result = generate(target.model, BlockProposer(head, chain_tree(4)))
    assert result.new_tokens.tolist() == greedy_future[PROMPT.shape[1] :][:NEW].tolist()
    assert set(result.accept_lengths[:-1]) == {correct + 1}  # a block of 4 drafts 4


@pytest.mark.parametrize("cut", [0, 2])
def test_a_confidence_cut_shortens_every_block(target, greedy_future, cut):
    head = oracle(real_head(target, confidence_threshold=0.5), greedy_future, 4, cut)
    result = generate(target.model, BlockProposer(head, chain_tree(4)))
    assert result.new_tokens.tolist() == greedy_future[PROMPT.shape[1] :][:NEW].tolist()
    assert set(result.accept_lengths[:-1]) == {cut + 1}


def test_a_real_confidence_cut(target, greedy_future):
    """The trained-path confidence decides: a threshold between the slots' confidences cuts the
    drafted chain where the first one falls below it, and decoding stays exact."""
    head = real_head(target, confidence_threshold=0.5)
    with torch.no_grad():
        head.confidence_head.proj.bias.fill_(20.0)  # every slot confident ...
        proposer = BlockProposer(head, chain_tree(4))
        assert proposer.propose(_state(target, head)).tokens.numel() == 5
        head.confidence_head.proj.bias.fill_(-20.0)  # ... or none: plain decoding
        proposer = BlockProposer(head, chain_tree(4))
        assert proposer.propose(_state(target, head)).tokens.numel() == 1
        result = generate(target.model, BlockProposer(head, chain_tree(4)))
    assert result.new_tokens.tolist() == greedy_future[PROMPT.shape[1] :][:NEW].tolist()
    assert set(result.accept_lengths) == {1}


def test_the_confidence_cut_is_an_evaluation_setting(tmp_path):
    """evaluate.py `head_settings`: a trained DSpark head's confidence threshold is set at
    evaluation (recorded in the summary), a setting the head does not allow or a bad value is
    refused with the reason, and a refused value leaves the config as it was."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from test_bench import CONF, write_prompts

    from eval.bench.harness import run
    from heads.base import apply_runtime_settings
    from heads.target import load_target

    overrides = [
        "model=tiny_random_llama", "bench=jsonl",
        f"bench.path={write_prompts(tmp_path / 'p.jsonl')}", "bench.limit=2",
        "bench.max_new_tokens=8", "tree=chain", "tree.paths=[[0],[0,0],[0,0,0]]",
        "methods=[head]", "threads=1", f"out_dir={tmp_path / 'out'}",
        "head_settings={confidence_threshold: 0.5}",
    ]  # fmt: skip
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("evaluate", overrides=overrides)
    target = load_target(instantiate(cfg.model, _convert_="all"))
    head = real_head(target)
    with torch.no_grad():
        head.confidence_head.proj.bias.fill_(-20.0)  # no slot is ever confident
    head.save_pretrained(tmp_path / "head")
    cfg.head_path = str(tmp_path / "head")
    summary = run(cfg)
    assert summary["meta"]["head_settings"] == {"confidence_threshold": 0.5}
    overall = summary["methods"]["head"]["overall"]
    assert overall["greedy_mismatches"] == 0 and overall["tau"] == 1.0  # every block cut at 0

    with pytest.raises(ValueError, match=r"can change only \['confidence_threshold'\]"):
        apply_runtime_settings(head, {"block_size": 8})
    with pytest.raises(ValueError, match="confidence_threshold=2"):
        apply_runtime_settings(head, {"confidence_threshold": 2})
    assert head.config.confidence_threshold == 0.0
    assert apply_runtime_settings(head, {"confidence_threshold": 0.25}) == {
        "confidence_threshold": 0.25
    }
    assert head.config.confidence_threshold == 0.25


def test_eos_inside_a_block_and_the_context_limit(target, greedy_future):
    start = PROMPT.shape[1]
    future = greedy_future[start:].tolist()
    index = next(i for i in range(3, len(future)) if future[i] not in future[:i])
    eos = future[index]
    head = oracle(real_head(target), greedy_future, 4)
    result = generate(target.model, BlockProposer(head, chain_tree(4)), n=NEW, eos_token_id=eos)
    hf = target.model.generate(
        PROMPT, max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=0
    )
    assert result.stop_reason == "eos"
    assert result.new_tokens.tolist() == hf[0, start:].tolist() == future[: index + 1]
    limit = start + 9
    result = generate(target.model, BlockProposer(head, chain_tree(4)), n=100, max_context=limit)
    assert result.stop_reason == "context" and result.tokens.shape[1] == limit
    assert result.new_tokens.tolist() == greedy_future[start:limit].tolist()


def test_sampled_chain_reports_the_distributions_it_drew_from(target):
    """Row i of draft_probs is the distribution node i + 1 was drawn from: softmax of slot i's
    logits (Markov bias from the token before it) over the target vocabulary."""
    head = real_head(target, reduced=True)
    proposer = BlockProposer(
        head, chain_tree(4), draft_temperature=0.7, generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        state = _state(target, head)
        draft = proposer.propose(state)
        position = torch.tensor([state.position])
        hidden = head.block_hidden(draft.tokens[:1], position, proposer.cache)
        prev = draft.tokens[:-1]
        logits = head.slot_logits(hidden[0], head.markov_head.embed(prev))  # (4, D)
    want = torch.zeros(4, target.vocab_size)
    want[:, head.draft_to_target(torch.arange(head.draft_vocab_size))] = torch.softmax(
        logits / 0.7, -1
    )
    torch.testing.assert_close(draft.draft_probs[:4], want)
    for i in range(4):
        assert float(draft.draft_probs[i, draft.tokens[i + 1]]) > 0


# ---- sampling ------------------------------------------------------------------------------

SMALL_VOCAB = 8


@pytest.mark.parametrize("draft_temperature, temperature", [(None, 1.0), (1.0, 0.8)])
def test_sampling_with_dspark_chains_is_lossless(draft_temperature, temperature):
    model = diverse(make_llama(hidden=32, layers=3, vocab=SMALL_VOCAB), std=0.25, seed=2)
    target = Target.from_model(model, make_tokenizer(), name_or_path="tiny-8")
    torch.manual_seed(0)
    config = DSparkConfig(block_size=3, mask_token_id=1, markov_rank=4)
    head = diverse(DSparkHead.for_target(config, target), std=0.5, seed=6).eval()
    proposer = BlockProposer(
        head, chain_tree(3), draft_temperature, generator=torch.Generator().manual_seed(5)
    )
    sampler = SpeculativeSampler(temperature, generator=torch.Generator().manual_seed(3))
    gen = SpeculativeGenerator(model, proposer, sampler)
    context = torch.tensor([2, 5, 1, 7, 4])  # prompt, then the root
    layers = head.feature_layers()
    with torch.inference_mode():
        cache = kv_cache.make_cache(model)
        out = kv_cache.forward_features(model, cache, context[None, :-1], layers=layers)
        state = DecodeState(out.hidden, context[1:], context.numel() - 1, out.aux)
        samples = []
        for _ in range(1500):
            step, emitted = state, []
            while len(emitted) < 2:
                step, tokens = gen.step(cache, step, 512)
                emitted += tokens
            kv_cache.crop_to(cache, state.position)
            samples.append(emitted[0] * SMALL_VOCAB + emitted[1])
        logits = model(input_ids=context[None]).logits[0, -1]
        p1 = process_logits(logits, temperature, 0, 1.0)
        nexts = torch.cat([context.repeat(SMALL_VOCAB, 1), torch.arange(SMALL_VOCAB)[:, None]], 1)
        p2 = process_logits(model(input_ids=nexts).logits[:, -1], temperature, 0, 1.0)
    observed = torch.bincount(torch.tensor(samples), minlength=SMALL_VOCAB**2).double()
    assert chisquare_pvalue(observed, (p1[:, None] * p2).flatten()) > 1e-3
    if temperature != 1.0:  # the test has power: the unprocessed distribution is rejected
        raw = (
            torch.softmax(logits, -1)[:, None]
            * torch.softmax(model(input_ids=nexts).logits[:, -1].detach(), -1)
        ).flatten()
        assert chisquare_pvalue(observed, raw) < 1e-6


# ---- checkpoints ---------------------------------------------------------------------------


@pytest.mark.parametrize("reduced", [False, True])
def test_save_and_load_round_trip(target, tmp_path, reduced):
    import heads

    head = real_head(target, reduced=reduced, confidence_threshold=0.3)
    head.save_pretrained(tmp_path / "h")
    loaded = heads.from_pretrained(tmp_path / "h", target)
    assert type(loaded) is DSparkHead and loaded.config == head.config
    assert loaded.config.confidence_threshold == 0.3
    assert loaded.state_dict().keys() == head.state_dict().keys()
    for name, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    V, D, H, r = target.vocab_size, head.draft_vocab_size, target.hidden_size, 8
    shapes = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    assert shapes["markov_head.markov_w1.weight"] == (V, r)
    assert shapes["markov_head.markov_w2.weight"] == (D, r)
    assert shapes["confidence_head.proj.weight"] == (1, H + r)
    assert shapes["confidence_head.proj.bias"] == (1,)
    assert "embed_weight" not in shapes and "target_lm_head" not in shapes
    assert ("lm_head.weight" in shapes) == reduced


def test_an_untrained_markov_head_adds_nothing(target):
    config = DSparkConfig(block_size=4, markov_rank=8, enable_confidence_head=False)
    head = DSparkHead.for_target(config, target).eval()
    assert head.confidence_head is None
    assert not any(k.startswith("confidence_head") for k in head.state_dict())
    assert not head.markov_head.markov_w2.weight.detach().any()
    markov = sum(p.numel() for p in head.markov_head.parameters())
    assert markov == 2 * target.vocab_size * 8  # two tables, not shared
