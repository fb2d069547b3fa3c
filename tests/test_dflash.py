"""DFlash block drafting (heads/dflash.py, eval/engine/block_proposer.py) on tiny Llama and
Qwen2 targets.

- the training block mask is the reference's (block j sees the context before its anchor, in its
  own conversation, and its own block, bidirectionally);
- training input equals inference input: a block computed among all blocks of a batch equals the
  block drafted against a cache of the committed context;
- the draft's context cache after every step equals a recompute from the committed tokens;
- greedy output equals HF generate (random heads, chains and static trees; an oracle head forcing
  every accept length, an EOS inside the block, the context limit);
- sampling through a block draft is lossless (chi-square);
- configs, layer ids, the mask token and save/load.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import diverse, make_llama, make_qwen2, make_tokenizer
from test_eagle_decode import chisquare_pvalue
from tokenizers import AddedToken

from eval.engine import kv_cache
from eval.engine.block_proposer import BlockProposer
from eval.engine.drafting import make_proposer
from eval.engine.generator import SpeculativeGenerator
from eval.engine.proposers import DecodeState
from eval.engine.tree import build_tree, chain_tree
from eval.engine.tree_spec import resolve_tree
from eval.engine.verify import GreedyVerifier, SpeculativeSampler, process_logits
from heads.block_training import block_attention_mask, position_weights, sample_anchors
from heads.dflash import DFlashConfig, DFlashHead
from heads.dflash_target import build_target_layer_ids, default_mask_token
from heads.target import Target

PROMPT = torch.tensor([[2, 40, 17, 99, 5, 63, 120, 8]])
NEW = 20
TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request):
    make = make_llama if request.param == "llama" else make_qwen2
    model = diverse(make(hidden=32, layers=4))
    return Target.from_model(model, make_tokenizer(), name_or_path=f"tiny-{request.param}")


@pytest.fixture(scope="module")
def greedy_future(target):
    out = target.model.generate(PROMPT, max_new_tokens=NEW + 8, do_sample=False, pad_token_id=0)
    return out[0]


def real_head(target, block_size=5, reduced=False, **kw):
    torch.manual_seed(3)
    config = DFlashConfig(
        block_size=block_size,
        num_anchors=8,
        draft_vocab_size=target.vocab_size // 2 if reduced else None,
        **kw,
    )
    counts = torch.arange(target.vocab_size).flip(0) if reduced else None
    head = DFlashHead.for_target(config, target, token_counts=counts)
    return diverse(head, std=0.3, seed=4).eval()  # strong attention: the context matters


def generate(model, proposer, n=NEW, verifier=None, prompt=PROMPT, **kwargs):
    gen = SpeculativeGenerator(model, proposer, verifier or GreedyVerifier(), **kwargs)
    return gen.generate(prompt, n)


# ---- the training mask ---------------------------------------------------------------------


def test_block_mask_matches_the_reference_semantics():
    anchors = torch.tensor([[2, 5], [1, 4]])
    segments = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 2, 2, 2, 2]])
    T, Bk = 7, 3
    for segs in (None, segments):
        mask = block_attention_mask(anchors, T, Bk, segs)
        assert mask.shape == (2, 1, 2 * Bk, T + 2 * Bk)
        for b in range(2):
            for j in range(2):
                a = int(anchors[b, j])
                for r in range(Bk):
                    row = mask[b, 0, j * Bk + r]
                    for p in range(T):
                        own = segs is None or segs[b, p] == segs[b, a]
                        assert bool(row[p]) == (p < a and bool(own)), (b, j, r, p)
                    for jj in range(2):
                        block = row[T + jj * Bk : T + (jj + 1) * Bk]
                        assert bool(block.all()) == (jj == j) and bool(block.any()) == (jj == j)


def test_target_layer_ids_follow_the_reference():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(30, 2) == [1, 27]
    assert build_target_layer_ids(30, 3) == [1, 14, 27]
    assert build_target_layer_ids(30, 1) == [15]
    assert build_target_layer_ids(4, 2) == [1, 1]  # clamped: id + 1 must be a residual state
    with pytest.raises(ValueError, match="2 or more layers"):
        build_target_layer_ids(1, 1)


def test_default_mask_token_is_a_special_token_the_template_never_writes():
    tok = make_tokenizer()
    assert default_mask_token(tok) is None  # every special is used or reserved
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<mask>"]})
    mask = tok.convert_tokens_to_ids("<mask>")
    assert default_mask_token(tok) == mask
    rendered = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=True)
    assert mask not in rendered
    # a token marked special without a role (as SmolLM2's <empty_output>) counts too
    plain = make_tokenizer()
    plain.add_tokens([AddedToken("<meta>", special=True)])
    assert default_mask_token(plain) == plain.convert_tokens_to_ids("<meta>")


def test_config_errors(tiny_llama):
    with pytest.raises(ValueError, match="block_size=1"):
        DFlashConfig(block_size=1)
    with pytest.raises(ValueError, match="loss='mse'"):
        DFlashConfig(loss="mse")
    with pytest.raises(ValueError, match=r"must lie in \[0, 0\]"):
        DFlashHead.for_target(DFlashConfig(target_layer_ids=[1]), tiny_llama)
    target = Target.from_model(make_llama(), None, name_or_path="t")  # no tokenizer at all
    with pytest.raises(ValueError, match="set head.mask_token_id"):
        DFlashHead.for_target(DFlashConfig(learn_mask=False), target)
    head = DFlashHead.for_target(DFlashConfig(block_size=3), tiny_llama)
    with pytest.raises(ValueError, match="drafts at most 2 tokens"):
        BlockProposer(head, chain_tree(3))
    with pytest.raises(ValueError, match="drafts a static tree only"):
        make_proposer(head, resolve_tree("dynamic"))


# ---- training input == inference input ------------------------------------------------------


def packed_batch(target):
    """Two rows: a plain one, and a packed one holding two conversations."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, target.vocab_size, (2, 24), generator=g)
    loss = torch.zeros_like(ids)
    loss[0, 6:] = 1
    loss[1, 4:11] = 1
    loss[1, 16:] = 1
    segments = torch.tensor([[1] * 24, [1] * 11 + [2] * 13])
    positions = torch.cat(
        [torch.arange(24)[None], torch.cat([torch.arange(11), torch.arange(13)])[None]]
    )
    return ids, loss, segments, positions


@pytest.mark.parametrize("reduced", [False, True])
def test_training_blocks_equal_drafting_blocks(target, reduced):
    head = real_head(target, block_size=4, reduced=reduced)
    ids, loss, segments, positions = packed_batch(target)
    layers = head.feature_layers()
    with torch.no_grad():
        feats = [
            target.features(ids[i : i + 1], torch.ones_like(ids[i : i + 1]), layers) for i in (0,)
        ]
        # the packed row: each conversation's features computed on its own (as packing does)
        second = [
            target.features(ids[1:2, s:e], torch.ones_like(ids[1:2, s:e]), layers)["aux"]
            for s, e in ((0, 11), (11, 24))
        ]
        aux = torch.cat([feats[0]["aux"], torch.cat(second, dim=1)], dim=0)
        batch = {
            "input_ids": ids,
            "loss_mask": loss,
            "segment_ids": segments,
            "position_ids": positions,
        }
        anchors = torch.tensor([[3, 7, 20], [5, 12, 17]])
        blocks = head.train_blocks(batch, {"aux": aux}, anchors)  # (2, 3, Bk, H)
        for b in range(2):
            for j in range(3):
                a = int(anchors[b, j])
                start = 0 if b == 0 or a < 11 else 11  # the anchor's conversation
                cache = head.new_cache()
                ctx = head.context({"aux": aux[b : b + 1, start:a]})
                head.extend_cache(cache, ctx, positions[b : b + 1, start:a])
                drafted = head.block_hidden(ids[b, a : a + 1], positions[b, a : a + 1], cache)
                torch.testing.assert_close(blocks[b, j], drafted[0], atol=1e-5, rtol=1e-4)
                logits = head.draft_block(ids[b, a : a + 1], positions[b, a : a + 1], cache)
                torch.testing.assert_close(
                    head.logits(blocks[b, j, 1:]), logits[0], atol=1e-4, rtol=1e-4
                )


def test_anchors_and_labels_stay_in_their_conversation(target):
    head = real_head(target, block_size=4)
    ids, loss, segments, positions = packed_batch(target)
    batch = {
        "input_ids": ids,
        "loss_mask": loss,
        "segment_ids": segments,
        "position_ids": positions,
    }
    torch.manual_seed(0)
    for _ in range(20):
        anchors, valid = sample_anchors(batch, head.config.num_anchors)
        for b in range(2):
            for a, ok in zip(anchors[b].tolist(), valid[b].tolist()):
                if ok:
                    assert loss[b, a + 1] == 1 and segments[b, a + 1] == segments[b, a]
                    assert positions[b, a] >= 1
    # every usable position is drawn when anchors outnumber them
    head.config.num_anchors = 64
    anchors, valid = sample_anchors(batch, head.config.num_anchors)
    assert int(valid[0].sum()) == 18 and int(valid[1].sum()) == 7 + 8


def test_training_lowers_the_loss(target):
    head = real_head(target, block_size=4)
    head.train()
    ids, loss, segments, positions = packed_batch(target)
    batch = {
        "input_ids": ids,
        "loss_mask": loss,
        "segment_ids": segments,
        "position_ids": positions,
    }
    feats = {
        "aux": torch.cat(
            [
                target.features(ids[i : i + 1], torch.ones_like(ids[:1]), head.feature_layers())[
                    "aux"
                ]
                for i in range(2)
            ]
        )
    }
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for _ in range(30):
        torch.manual_seed(1)
        out = head.loss(batch, feats)
        first = first if first is not None else float(out.loss.detach())
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert float(out.loss) < 0.5 * first
    assert head.mask_embedding.grad is not None and head.mask_embedding.grad.abs().sum() > 0
    assert out.stats["slot1/top1"][1] > 0  # counted positions


# ---- decoding ------------------------------------------------------------------------------


class Recorder:
    """A proposer that records each state and the committed context cache after its step."""

    def __init__(self, inner):
        self.inner, self.feature_layers, self.steps = inner, inner.feature_layers, []

    def propose(self, state):
        draft = self.inner.propose(state)
        layer = self.inner.cache.layers[-1]
        self.steps.append((state, draft, layer.keys.clone(), layer.values.clone()))
        return draft


def test_context_cache_after_each_step_equals_a_recompute(target, greedy_future):
    head = real_head(target)
    recorder = Recorder(BlockProposer(head, chain_tree(4)))
    with torch.no_grad():
        result = generate(target.model, recorder)
        sequence = result.tokens[0]
        assert len(recorder.steps) >= 3
        for state, _, keys, values in recorder.steps:
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
    for tree in (4, TREE):
        proposer = make_proposer(head, resolve_tree(tree))
        assert isinstance(proposer, BlockProposer)
        assert generate(target.model, proposer).new_tokens.tolist() == want


def oracle(head, future, correct):
    """The head, with block logits that know the target's greedy future: slot k scores the true
    token k places after the anchor first for k <= correct, and a wrong one first beyond."""
    real = head.draft_block
    V = head.draft_vocab_size

    def draft_block(anchor, position, cache):
        logits = real(anchor, position, cache)
        p = int(position[0])
        assert int(anchor[0]) == int(future[p]), "the anchor is the token at the block's position"
        assert cache.length == p, "the context holds every position before the anchor"
        out = torch.zeros_like(logits)
        for k in range(1, head.block_size):
            true = int(future[p + k]) if p + k < future.numel() else 0
            out[0, k - 1, true if k <= correct else (true + 1) % V] = 10.0
        return out

    head.draft_block = draft_block
    return head


@pytest.mark.parametrize("correct", [0, 2, 4])
def test_oracle_forces_each_accept_length(target, greedy_future, correct):
    head = oracle(real_head(target), greedy_future, correct)
    result = generate(target.model, BlockProposer(head, chain_tree(4)))
    assert result.new_tokens.tolist() == greedy_future[PROMPT.shape[1] :][:NEW].tolist()
    assert set(result.accept_lengths[:-1]) == {correct + 1}


def test_eos_inside_a_block_and_the_context_limit(target, greedy_future):
    start = PROMPT.shape[1]
    future = greedy_future[start:].tolist()
    # an EOS that first appears a few tokens in, so a 4-token block crosses it
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


def test_static_tree_children_are_each_slots_ranked_tokens(target):
    head = real_head(target)
    proposer = BlockProposer(head, build_tree(TREE))
    tree = proposer.tree
    with torch.no_grad():
        ids = PROMPT
        out = kv_cache.forward_features(
            target.model, kv_cache.make_cache(target.model), ids, layers=head.feature_layers()
        )
        state = DecodeState(
            out.hidden, torch.cat([ids[0, 1:], torch.tensor([7])]), ids.shape[1], out.aux
        )
        draft = proposer.propose(state)
        top = proposer.last_logits.topk(2, dim=-1).indices
        for node in range(1, tree.num_nodes):
            d, r = int(tree.depth[node]), int(tree.rank[node])
            assert int(draft.tokens[node]) == int(head.draft_to_target(top[d - 1, r]))


# ---- sampling ------------------------------------------------------------------------------

SMALL_VOCAB = 8


@pytest.mark.parametrize("draft_temperature, temperature", [(None, 1.0), (1.0, 0.8)])
def test_sampling_with_block_drafts_is_lossless(draft_temperature, temperature):
    model = diverse(make_llama(hidden=32, layers=3, vocab=SMALL_VOCAB), std=0.25, seed=2)
    target = Target.from_model(model, make_tokenizer(), name_or_path="tiny-8")
    torch.manual_seed(0)
    head = DFlashHead.for_target(DFlashConfig(block_size=4, mask_token_id=1), target).eval()
    proposer = BlockProposer(
        head, build_tree([[0], [1], [0, 0], [0, 0, 0]]), draft_temperature,
        generator=torch.Generator().manual_seed(5),
    )  # fmt: skip
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

    head = real_head(target, reduced=reduced)
    head.save_pretrained(tmp_path / "h")
    loaded = heads.from_pretrained(tmp_path / "h", target)
    assert type(loaded) is DFlashHead and loaded.config == head.config
    assert loaded.state_dict().keys() == head.state_dict().keys()
    for name, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    saved = set(head.state_dict())
    assert "embed_weight" not in saved and "target_lm_head" not in saved
    assert ("lm_head.weight" in saved) == reduced and "mask_embedding" in saved
    assert math.isclose(head.config.decay, 2.5)  # B = 5: B / 2


def test_dpace_and_decay_weights():
    config = DFlashConfig(block_size=4, weighting="dpace", dpace_alpha=0.5)
    ok = torch.tensor([[[True, True, False]]])
    per_slot = torch.tensor([[[math.log(2.0), 0.0, 5.0]]])  # q = 0.5, 1.0 (third not scored)
    w = position_weights(per_slot, ok, 0, config)
    s1, s2 = 0.5 * 0.5 + 0.5, 1.0  # smoothed chances
    torch.testing.assert_close(w, torch.tensor([[[s1 + s1 * s2, s1 * s2, 0.0]]]))
    w = position_weights(per_slot, ok, 0, DFlashConfig(block_size=4, gamma=2.0))
    torch.testing.assert_close(w, torch.tensor([[[1.0, math.exp(-0.5), 0.0]]]))


@pytest.mark.parametrize("options", [{"loss": "kd"}, {"weighting": "dpace"}])
def test_loss_options_train(target, options):
    head = real_head(target, block_size=4, **options)
    head.train()
    ids, loss, segments, positions = packed_batch(target)
    batch = {"input_ids": ids, "loss_mask": loss}
    feats = target.features(ids, torch.ones_like(ids), head.feature_layers())
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(20):
        torch.manual_seed(1)
        out = head.loss(batch, feats)
        losses.append(float(out.loss.detach()))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert losses[-1] < 0.7 * losses[0]
    if options.get("loss") == "kd":  # soft labels: the loss is a cross-entropy to the target
        assert losses[-1] > 0


def test_init_from_target_copies_the_layers_after_the_deepest_fused_one(target):
    config = DFlashConfig(
        block_size=4, num_layers=2, target_layer_ids=[0, 1], init_from_target=True
    )
    head = DFlashHead.for_target(config, target)
    layers = target.model.base_model.layers
    H = target.hidden_size
    torch.testing.assert_close(head.fc.weight[:, H:], torch.eye(H))
    assert not head.fc.weight[:, :H].any()
    torch.testing.assert_close(head.hidden_norm.weight, layers[2].input_layernorm.weight)
    for i, src in zip(range(2), (layers[2], layers[3])):
        mine = head.layers[i]
        torch.testing.assert_close(mine.self_attn.q_proj.weight, src.self_attn.q_proj.weight)
        torch.testing.assert_close(mine.mlp.down_proj.weight, src.mlp.down_proj.weight)
        assert (mine.self_attn.k_norm.weight > 0).all()
    # the fused context through draft layer 0's k_proj is the target layer's own key projection
    # of its normed input (without Qwen2's bias)
    with torch.no_grad():
        states = target.model(input_ids=PROMPT, output_hidden_states=True).hidden_states
        ctx = head.context({"aux": torch.cat([states[1], states[2]], -1)})
        src = layers[2]
        want = F.linear(src.input_layernorm(states[2]), src.self_attn.k_proj.weight)
        torch.testing.assert_close(head.layers[0].self_attn.k_proj(ctx), want, atol=1e-5, rtol=1e-4)


# ---- the training paths users launch -------------------------------------------------------


@pytest.mark.parametrize("features", ["online", "memory", "disk"])
def test_dflash_trains_in_every_feature_mode(features, tmp_path):
    from hydra import compose, initialize_config_dir
    from test_experiments import SMALL

    import heads
    from heads.target import load_target
    from train.run import run

    overrides = ["+experiment=dflash_tiny", *SMALL, f"data.features={features}",
                 f"data.feature_cache={tmp_path}/features", "trainer.pack_tokens=256"]  # fmt: skip
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    result = run(cfg, run_dir=tmp_path)
    assert result.step == 2 and math.isfinite(result.val_metrics["val/loss"])
    assert result.val_metrics["val/slot1/top1"] >= 0
    target = load_target(__import__("hydra").utils.instantiate(cfg.model))
    assert type(heads.from_pretrained(tmp_path / "head", target)) is DFlashHead


@pytest.mark.integration
def test_dflash_under_accelerate_launch(tmp_path):
    """train.py with a DFlash head on 2 CPU processes (gloo): anchors are drawn per rank, the
    gathered validation and the one written head come out."""
    import os
    import subprocess
    import sys

    from tests.test_multiprocess import REPO, free_port

    args = ["train.py", "+experiment=dflash_tiny", "trainer.max_steps=2", "trainer.eval_every=2",
            "trainer.save_every=2", "data.features=online", "logger.mode=disabled",
            f"hydra.run.dir={tmp_path}"]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}  # fmt: skip
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
              "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no", "--main_process_port", str(free_port())]  # fmt: skip
    proc = subprocess.run(
        [*launch, *args], env=env, capture_output=True, text=True, timeout=600, cwd=REPO
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    from train.checkpoint import list_checkpoints, load_checkpoint

    (step, path), *_ = list_checkpoints(tmp_path)
    assert step == 2 and len(load_checkpoint(path).rng) == 2  # one entry per process
    assert (tmp_path / "head").is_dir()
