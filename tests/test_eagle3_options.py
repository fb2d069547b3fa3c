"""EAGLE-3 training candidates as head options: EAGLE-3.1's `fc_norm` and `norm_output`, feature
noise, GRIFFIN-style chain masking (`mask_after_miss`) and HASS's top-K term. Shapes, the
training-time-test unroll against drafting, the loss against a row-by-row reference, a loss that
falls, save and load (old config.json files too), lossless greedy decoding, the GGUF refusal."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import diverse, fit, make_llama
from safetensors.torch import load_file

import heads
from data.errors import ConfigError, DraftsmithError
from eval.engine.drafting import make_proposer
from eval.engine.dynamic_tree import DynamicTreeConfig
from eval.engine.eagle_proposer import draft_tree_mask
from eval.engine.generator import SpeculativeGenerator
from eval.engine.tree_spec import resolve_tree
from eval.engine.verify import GreedyVerifier
from heads.draft_layer import DraftCache
from heads.eagle3 import Eagle3Config, Eagle3Head, ttt_attention_mask
from heads.interop.gguf import gguf_source_format, spec_type_for
from heads.target import Target

OPTIONS = [
    {"fc_norm": True},
    {"norm_output": True},
    {"fc_norm": True, "norm_output": True},
]


def _batch(T=16, B=2, V=256, seed=0, start=4):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, V, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.long)
    mask[:, start:] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}


def _head(target, seed=0, **kw) -> Eagle3Head:
    torch.manual_seed(seed)
    kw.setdefault("draft_vocab_size", None)
    return Eagle3Head.for_target(Eagle3Config(**kw), target)


def _features(head, target, batch):
    return target.features(batch["input_ids"], batch["attention_mask"], head.feature_layers())


def _perturb_norms(head, seed=5):
    """Give every RMSNorm scale (all ones when built) its own values, so tests see them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.ndim == 1:
                p.mul_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return head


# ---- shapes and parameters -----------------------------------------------------------------


def test_fc_norm_adds_one_norm_per_fused_layer(tiny_llama):
    H = tiny_llama.hidden_size
    plain, normed = _head(tiny_llama), _head(tiny_llama, fc_norm=True)
    k = len(normed.feature_layers())
    extra = sorted(set(normed.state_dict()) - set(plain.state_dict()))
    assert extra == [f"fc_norm.{i}.weight" for i in range(k)]
    assert all(normed.state_dict()[n].shape == (H,) for n in extra)
    count = lambda h: sum(p.numel() for p in h.parameters())  # noqa: E731
    assert count(normed) - count(plain) == k * H
    # norm_output adds no parameters: it moves the final norm in front of the next step
    assert _head(tiny_llama, norm_output=True).state_dict().keys() == plain.state_dict().keys()


def test_fc_norm_normalises_each_layer_on_its_own(tiny_llama):
    """Scaling one fused layer's features leaves the fused feature unchanged with fc_norm (each
    layer is divided by its own RMS), and changes it without."""
    batch = _batch(T=8, B=1)
    H, change = tiny_llama.hidden_size, {}
    for fc_norm in (True, False):
        head = _head(tiny_llama, fc_norm=fc_norm)
        aux = _features(head, tiny_llama, batch)["aux"]  # (1, T, kH)
        scaled = aux.clone()
        scaled[..., H : 2 * H] *= 7.0
        with torch.no_grad():
            a, b = head.target_hidden({"aux": aux}), head.target_hidden({"aux": scaled})
        assert a.shape == (1, 8, H)
        change[fc_norm] = ((a - b).norm() / a.norm()).item()
    assert change[True] < 1e-3 < 0.1 < change[False]  # (the norm's eps keeps a trace)


# a draft of two layers (tests/test_eagle3_layers.py) must pass the same checks
LAYERED = [*OPTIONS, {"num_layers": 2}]


@pytest.mark.parametrize("options", LAYERED)
def test_step_shapes_and_cache_equal_a_full_pass(tiny_llama, options):
    head = _perturb_norms(_head(tiny_llama, **options)).eval()
    batch = _batch(T=12)
    hidden = head.target_hidden(_features(head, tiny_llama, batch))
    ids = batch["input_ids"]
    tokens = torch.cat([ids[:, 1:], torch.zeros(2, 1, dtype=torch.long)], 1)
    pos = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        full_h, full_l = head.step(tokens, hidden, pos, DraftCache())
        assert full_h.shape == (2, 12, 64) and full_l.shape == (2, 12, 256)
        assert torch.allclose(head(full_h), full_l, atol=1e-6)
        cache, parts = DraftCache(), []
        for a, b in [(0, 5), (5, 6), (6, 12)]:
            parts.append(head.step(tokens[:, a:b], hidden[:, a:b], pos[:, a:b], cache))
        assert torch.allclose(torch.cat([p[0] for p in parts], 1), full_h, atol=1e-5)
        assert torch.allclose(torch.cat([p[1] for p in parts], 1), full_l, atol=1e-5)


def test_norm_output_feeds_the_post_norm_state(tiny_llama):
    """Same weights: the first step scores alike (lm_head reads norm(out) either way), but with
    norm_output the state handed on is norm(out), so the next step differs."""
    pre = _perturb_norms(_head(tiny_llama)).eval()
    post = _perturb_norms(_head(tiny_llama, norm_output=True)).eval()
    post.load_state_dict(pre.state_dict())
    batch = _batch(T=6, B=1)
    hidden = pre.target_hidden(_features(pre, tiny_llama, batch))
    tokens, pos = batch["input_ids"], torch.arange(6)[None]
    with torch.no_grad():
        h_pre, l_pre = pre.step(tokens, hidden, pos, DraftCache())
        h_post, l_post = post.step(tokens, hidden, pos, DraftCache())
        assert torch.allclose(l_pre, l_post, atol=1e-5)
        assert torch.allclose(h_post, pre.norm(h_pre), atol=1e-5)
        assert not torch.allclose(h_post, h_pre, atol=1e-3)
        nxt = [
            h.step(tokens, s, pos + 1, DraftCache())[1] for h, s in ((pre, h_pre), (post, h_post))
        ]
        assert not torch.allclose(nxt[0], nxt[1], atol=1e-3)


# ---- training-time test against drafting ---------------------------------------------------


@pytest.mark.parametrize("options", LAYERED)
def test_ttt_unroll_equals_drafting_a_chain(tiny_llama, options):
    """The loss's unrolled steps see exactly what drafting a chain with the cache sees (with
    each option on, the state fed back is the same one in both)."""
    head = _perturb_norms(_head(tiny_llama, ttt_steps=3, **options)).eval()
    batch = _batch(T=9, B=1)
    ids, T = batch["input_ids"], 9
    feats = _features(head, tiny_llama, batch)
    cache, hidden, unrolled = DraftCache(), head.target_hidden(feats), []
    with torch.no_grad():
        for i in range(3):
            tokens = torch.zeros_like(ids)
            tokens[:, : T - i - 1] = ids[:, i + 1 :]
            mask = ttt_attention_mask(T, i)[None, None]
            hidden = head.draft_hidden(tokens, hidden, torch.arange(T)[None] + i, cache, mask)
            unrolled.append(head.logits(hidden))
        fused = head.target_hidden(feats)
        for t in range(T - 3):
            cache = DraftCache()
            out, logits = head.step(
                ids[:, 1 : t + 2], fused[:, : t + 1], torch.arange(t + 1)[None], cache
            )
            parent = out[:, -1:]
            assert torch.allclose(logits[:, -1:], unrolled[0][:, t : t + 1], atol=1e-5)
            for depth in (1, 2):
                mask = draft_tree_mask([list(range(depth - 1))], t + 1, depth - 1)[None, None]
                tok = ids[:, t + depth + 1 : t + depth + 2]
                parent, logits = head.step(tok, parent, torch.tensor([[t + depth]]), cache, mask)
                assert torch.allclose(logits, unrolled[depth][:, t : t + 1], atol=1e-5)


# ---- losses ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        *OPTIONS,
        {"fc_norm": True, "norm_output": True, "feature_noise": 0.2},
        {"feature_noise": 0.1, "feature_noise_type": "gaussian"},
        {"mask_after_miss": True, "hass_topk": 5},
        {"dropout": 0.1},
    ],
)
def test_loss_falls_with_the_options_on(tiny_llama, options):
    with torch.no_grad():
        tiny_llama.lm_head.weight.mul_(40.0)  # sharpen the target: something to learn
    head = _head(tiny_llama, ttt_steps=3, **options).train()
    batch = _batch()
    feats = _features(head, tiny_llama, batch)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    torch.manual_seed(0)
    first, out = fit(head, batch, feats, opt)
    assert torch.isfinite(out.loss) and out.loss.item() < 0.6 * first
    if options.get("fc_norm"):  # the new norms learn too
        assert not torch.equal(head.fc_norm[0].weight, torch.ones_like(head.fc_norm[0].weight))


@pytest.mark.parametrize("kind", ["uniform", "gaussian"])
def test_feature_noise_only_while_training_and_of_its_size(tiny_llama, kind):
    batch = _batch()
    head = _head(tiny_llama, ttt_steps=2, feature_noise=0.5, feature_noise_type=kind)
    feats = _features(head, tiny_llama, batch)
    head.eval()
    a = head.loss(batch, feats).loss
    assert torch.equal(a, head.loss(batch, feats).loss)
    head.train()
    assert not torch.allclose(head.loss(batch, feats).loss, a)
    quiet = _head(tiny_llama, ttt_steps=2).train()  # no noise: training equals evaluation
    quiet.load_state_dict(head.state_dict())
    assert torch.equal(quiet.loss(batch, feats).loss, a)
    torch.manual_seed(0)
    noise = head.noisy(torch.zeros(200_000)) / 0.5
    if kind == "uniform":  # U(-1/2, 1/2): std 1/sqrt(12), bounded by 1/2
        assert noise.abs().max() <= 0.5 and abs(noise.std().item() - 12**-0.5) < 0.01
    else:
        assert abs(noise.std().item() - 1.0) < 0.01 and noise.abs().max() > 3
    assert torch.equal(_head(tiny_llama).noisy(torch.ones(3)), torch.ones(3))


def test_dropout_only_while_training_and_of_its_rate(tiny_llama):
    batch = _batch()
    head = _head(tiny_llama, ttt_steps=2, dropout=0.3)
    feats = _features(head, tiny_llama, batch)
    head.eval()
    a = head.loss(batch, feats).loss
    plain = _head(tiny_llama, ttt_steps=2).eval()  # without dropout: the same eval loss
    plain.load_state_dict(head.state_dict())
    assert torch.equal(plain.loss(batch, feats).loss, a)
    head.train()
    torch.manual_seed(0)
    b = head.loss(batch, feats).loss
    assert torch.isfinite(b) and not torch.allclose(b, a)
    kept = head.dropped(torch.ones(100_000))
    assert abs((kept == 0).float().mean().item() - 0.3) < 0.01  # the rate it was given
    assert torch.allclose(kept[kept != 0], torch.full_like(kept[kept != 0], 1 / 0.7))
    plain.train()  # at 0 training leaves the state alone
    assert torch.equal(plain.dropped(torch.ones(5)), torch.ones(5))


def _reference_loss(head, target, batch, steps):
    """The TTT loss recomputed row by row from the unrolled logits (B = 1, full vocabulary):
    (total, per step: counted rows, chain hits, chain rows)."""
    ids, T = batch["input_ids"], batch["input_ids"].shape[1]
    feats = _features(head, target, batch)
    with torch.no_grad():
        probs = torch.softmax(feats["hidden"] @ head.target_lm_head.T, -1)[0]  # (T, V)
        cache, hidden, logps = DraftCache(), head.target_hidden(feats), []
        for i in range(steps):
            tokens = torch.zeros_like(ids)
            tokens[:, : T - i - 1] = ids[:, i + 1 :]
            mask = ttt_attention_mask(T, i)[None, None]
            hidden = head.draft_hidden(tokens, hidden, torch.arange(T)[None] + i, cache, mask)
            logps.append(head.logits(hidden)[0].float().log_softmax(-1))
    c = head.config
    total, on_chain, rows = 0.0, [True] * T, []
    for i, logp in enumerate(logps):
        valid = [t + i + 2 < T and bool(batch["loss_mask"][0, t + i + 2]) for t in range(T)]
        counted, losses, hits = [], [], []
        for t in (t for t in range(T) if valid[t]):
            want = probs[t + i + 1]
            hit = int(logp[t].argmax()) == int(want.argmax())
            if on_chain[t] or not c.mask_after_miss:
                loss = -(want * logp[t]).sum()
                if c.hass_topk:
                    top = want.topk(c.hass_topk)
                    loss = loss - c.hass_weight * (top.values * logp[t][top.indices]).sum()
                losses.append(loss)
                counted.append(t)
            hits.append((t, hit))
        chain = [(t, h) for t, h in hits if on_chain[t]]
        rows.append((len(counted), sum(h for _, h in chain), len(chain)))
        if losses:
            total += c.decay**i * torch.stack(losses).mean()
        on_chain = [valid[t] and on_chain[t] and dict(hits).get(t, False) for t in range(T)]
    return total, rows


@pytest.mark.parametrize(
    "options",
    [{}, {"mask_after_miss": True}, {"hass_topk": 4, "hass_weight": 0.5},
     {"mask_after_miss": True, "hass_topk": 3, "norm_output": True}],
)  # fmt: skip
def test_chain_masking_and_topk_term_match_a_row_by_row_reference(tiny_llama, options):
    with torch.no_grad():
        tiny_llama.lm_head.weight.mul_(40.0)  # a sharp target, learnt in a few steps
    head = _head(tiny_llama, ttt_steps=3, decay=0.7, **options)
    batch = _batch(T=14, B=1, start=3)
    feats = _features(head, tiny_llama, batch)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    for _ in range(25):  # fit the batch: most steps right, so chains run on
        opt.zero_grad()
        head.loss(batch, feats).loss.backward()
        opt.step()
    head.eval()
    out = head.loss(batch, feats)
    want, rows = _reference_loss(head, tiny_llama, batch, 3)
    assert torch.allclose(out.loss, torch.as_tensor(want), atol=1e-5)
    for i, (counted, hits, reached) in enumerate(rows):
        assert out.stats[f"step{i}/chain_top1"].tolist() == [hits, reached], i
        if not head.config.mask_after_miss:
            assert counted == int(out.stats[f"step{i}/loss"][1])
    assert torch.equal(out.stats["step0/chain_top1"], out.stats["step0/top1"])
    # a chain goes on from step-0 hits (bar row T-3, which has no step-1 label)
    assert rows[0][1] - 1 <= rows[1][2] <= rows[0][1] and rows[2][2] <= rows[1][1]
    assert 0 < rows[2][2] < rows[1][2] < rows[0][2]


def test_config_validation():
    with pytest.raises(ValueError, match="feature_noise="):
        Eagle3Config(feature_noise=-0.1)
    with pytest.raises(ValueError, match="feature_noise_type"):
        Eagle3Config(feature_noise_type="laplace")
    with pytest.raises(ValueError, match="hass_topk"):
        Eagle3Config(hass_topk=-1)
    for rate in (-0.1, 1.0):
        with pytest.raises(ValueError, match="head.dropout="):
            Eagle3Config(dropout=rate)


# ---- checkpoints -----------------------------------------------------------------------------


@pytest.mark.parametrize("options", OPTIONS)
def test_save_and_load_round_trip(tiny_llama, tmp_path, options):
    head = _perturb_norms(_head(tiny_llama, feature_noise=0.1, **options)).eval()
    head.save_pretrained(tmp_path / "h")
    doc = json.loads((tmp_path / "h" / "config.json").read_text())
    assert {k: doc["config"][k] for k in options} == options
    saved = load_file(tmp_path / "h" / "model.safetensors")
    assert ("fc_norm.0.weight" in saved) == bool(options.get("fc_norm"))
    back = heads.from_pretrained(tmp_path / "h", tiny_llama).eval()
    assert back.config == head.config
    for (k, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    hidden = torch.randn(1, 5, 64)
    tokens, pos = torch.randint(4, 256, (1, 5)), torch.arange(5)[None]
    with torch.no_grad():
        outs = [h.step(tokens, hidden, pos, DraftCache()) for h in (head, back)]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_a_head_saved_before_the_options_loads_unchanged(tiny_llama, tmp_path):
    head = _head(tiny_llama)
    head.save_pretrained(tmp_path / "old")
    file = tmp_path / "old" / "config.json"
    doc = json.loads(file.read_text())
    new = ("fc_norm", "norm_output", "feature_noise", "feature_noise_type", "mask_after_miss")
    for key in (*new, "hass_topk", "hass_weight"):
        del doc["config"][key]  # what a config.json written before them holds
    file.write_text(json.dumps(doc))
    back = heads.from_pretrained(tmp_path / "old", tiny_llama)
    assert back.config == head.config
    assert not back.config.fc_norm and not back.config.norm_output
    assert back.config.feature_noise == 0.0


# ---- decoding ----------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [OPTIONS[2], {"norm_output": True}])
def test_greedy_decoding_with_the_options_is_lossless(options):
    model = diverse(make_llama(hidden=32))
    target = Target.from_model(model, None, name_or_path="tiny")
    prompt = torch.tensor([[2, 40, 17, 99, 5, 63, 120, 8]])
    want = model.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)[0, 8:]
    torch.manual_seed(3)
    config = Eagle3Config(draft_vocab_size=target.vocab_size // 2, **options)
    counts = torch.arange(target.vocab_size).flip(0)
    head = diverse(Eagle3Head.for_target(config, target, token_counts=counts), std=0.3, seed=4)
    head = _perturb_norms(head).eval()
    dynamic = DynamicTreeConfig(depth=4, top_k=3, total_tokens=10)
    for tree in ([[0], [1], [0, 0], [0, 1], [0, 0, 0]], 3, dynamic):  # a tree, a chain, dynamic
        proposer = make_proposer(head, resolve_tree(tree))
        gen = SpeculativeGenerator(model, proposer, GreedyVerifier())
        assert gen.generate(prompt, 16).new_tokens.tolist() == want.tolist()


# ---- llama.cpp -------------------------------------------------------------------------------


def test_gguf_refuses_what_llama_cpp_lacks(tiny_llama):
    assert gguf_source_format(_head(tiny_llama)) == "eagle3"
    assert gguf_source_format(_head(tiny_llama, feature_noise=0.2)) == "eagle3"  # training only
    for options in OPTIONS:
        head = _head(tiny_llama, **options)
        for call in (gguf_source_format, spec_type_for):
            with pytest.raises(ConfigError, match="llama.cpp's EAGLE-3 graph") as err:
                call(head)
            assert isinstance(err.value, DraftsmithError) and "\n" not in str(err.value)
            for name in options:
                assert f"head.{name}=false" in str(err.value)


# ---- the overrides, end to end -------------------------------------------------------------


def test_the_overrides_train_save_and_resume_end_to_end(tmp_path):
    """The names the recipes use: compose eagle3_tiny with every option on, train two steps with
    Muon, save, resume to four; the saved head carries the options."""
    from tests.test_experiments import _compose
    from train.run import run

    overrides = [
        "head.fc_norm=true", "head.norm_output=true", "head.feature_noise=0.1",
        "head.feature_noise_type=gaussian", "head.mask_after_miss=true", "head.hass_topk=4",
        "trainer.optimizer=muon", "trainer.muon_lr=0.01", "evaluators=[]",
        "trainer.best_metric=null",
    ]  # fmt: skip
    result = run(_compose("eagle3_tiny", overrides), run_dir=tmp_path)
    assert result.step == 2 and "val/step0/chain_top1" in result.val_metrics
    saved = json.loads((tmp_path / "head" / "config.json").read_text())["config"]
    assert saved["fc_norm"] and saved["norm_output"] and saved["hass_topk"] == 4
    more = run(_compose("eagle3_tiny", [*overrides, "trainer.max_steps=4"]), run_dir=tmp_path)
    assert more.step == 4
