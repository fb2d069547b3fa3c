"""EAGLE-1 and EAGLE-3 heads: the draft layer, step/cache consistency, training-time test,
reduced vocabulary, checkpoints, losses, on tiny Llama and Qwen2 targets."""

from __future__ import annotations

import pytest
import torch
from conftest import make_llama
from safetensors.torch import load_file

import heads
from heads.base import HeadMismatchError
from heads.draft_layer import DraftCache, DraftDecoderLayer, LayerSpec, rotary_embedding
from heads.eagle import EagleConfig, EagleHead
from heads.eagle3 import Eagle3Config, Eagle3Head, default_aux_layers, ttt_attention_mask
from heads.target import Target
from heads.vocab import count_tokens

LAYER_KEYS = [
    "layers.0.mlp.down_proj.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.post_attention_layernorm.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.v_proj.weight",
]


def _batch(T=20, B=2, V=256, seed=0, start=6):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, V, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.long)
    mask[:, start:] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}


def _counts(batch, vocab):
    rows = zip(batch["input_ids"], batch["loss_mask"])
    return count_tokens([{"input_ids": r, "loss_mask": m} for r, m in rows], vocab)


def _features(head, target, batch):
    return target.features(batch["input_ids"], batch["attention_mask"], head.feature_layers())


def _eagle(target, **kw):
    torch.manual_seed(0)
    return EagleHead.for_target(EagleConfig(**kw), target)


def _eagle3(target, counts=None, **kw):
    torch.manual_seed(0)
    kw.setdefault("draft_vocab_size", None)
    return Eagle3Head.for_target(Eagle3Config(**kw), target, token_counts=counts)


def _rows(head, target, batch):
    """Step inputs for every position: tokens x_{t+1}, target features, positions."""
    feats = _features(head, target, batch)
    hidden = head.target_hidden(feats)  # (B, T, H)
    ids = batch["input_ids"]
    B, T = ids.shape
    tokens = torch.cat([ids[:, 1:], torch.zeros(B, 1, dtype=torch.long)], dim=1)
    return tokens, hidden, torch.arange(T).expand(B, T)


# ---- draft layer -------------------------------------------------------------------------


def test_rotary_matches_target(tiny_target):
    spec = LayerSpec.from_hf_config(tiny_target.model.config)
    pos = torch.arange(11)[None]
    x = torch.zeros(1, 11, spec.head_dim)
    cos, sin = rotary_embedding(spec)(x, pos)
    want_cos, want_sin = tiny_target.model.model.rotary_emb(x, pos)
    assert torch.allclose(cos, want_cos) and torch.allclose(sin, want_sin)


def test_llama3_rope_scaling_is_followed():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    cfg = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters=rope,
    )
    spec = LayerSpec.from_hf_config(cfg)
    assert spec.rope_parameters["rope_type"] == "llama3"
    ours, theirs = rotary_embedding(spec), LlamaRotaryEmbedding(cfg)
    assert torch.allclose(ours.inv_freq, theirs.inv_freq)


def test_layer_matches_hf_llama_decoder_layer(tiny_llama):
    """With input_norm the draft layer is a plain Llama decoder layer (export parity)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    cfg = tiny_llama.model.config
    spec = LayerSpec.from_hf_config(cfg)
    ours = DraftDecoderLayer(spec, input_norm=True)
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.2)
    theirs = LlamaDecoderLayer(cfg, layer_idx=0).eval()
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    assert not missing and not unexpected
    x, pos = torch.randn(2, 9, spec.hidden_size), torch.arange(9).expand(2, 9)
    emb = tiny_llama.model.model.rotary_emb(x, pos)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()[None, None]
    want = theirs(x, attention_mask=causal, position_ids=pos, position_embeddings=emb)
    want = want[0] if isinstance(want, tuple) else want
    assert torch.allclose(ours(x, pos, DraftCache()), want, atol=1e-5)


def test_draft_cache_crop_and_gather():
    cache = DraftCache()
    assert cache.length == 0
    k = torch.arange(2 * 1 * 5 * 3, dtype=torch.float).view(2, 1, 5, 3)
    cache.append(k, -k)
    cache.append(k[:, :, :2], -k[:, :, :2])
    assert cache.length == 7
    cache.crop(5)
    assert torch.equal(cache.keys, k)
    cache.gather(torch.tensor([0, 3]))
    assert torch.equal(cache.keys, k[:, :, [0, 3]]) and torch.equal(cache.values, -k[:, :, [0, 3]])
    cache.gather(torch.tensor([[1], [0]]))
    assert torch.equal(cache.keys[0, :, 0], k[0, :, 3]) and torch.equal(cache.keys[1], k[1, :, :1])


# ---- step / cache consistency --------------------------------------------------------------


@pytest.mark.parametrize("make", [_eagle, _eagle3])
def test_shapes_and_step_with_cache_equals_full_pass(make, tiny_target):
    head = make(tiny_target).eval()
    tokens, hidden, pos = _rows(head, tiny_target, _batch(T=14))
    H, V = tiny_target.hidden_size, tiny_target.vocab_size
    with torch.no_grad():
        full_h, full_l = head.step(tokens, hidden, pos, DraftCache())
        assert full_h.shape == (2, 14, H) and full_l.shape == (2, 14, V)
        cache, outs = DraftCache(), []
        for a, b in [(0, 5), (5, 6), (6, 11), (11, 14)]:
            outs.append(head.step(tokens[:, a:b], hidden[:, a:b], pos[:, a:b], cache))
        assert cache.length == 14
        assert torch.allclose(torch.cat([o[0] for o in outs], 1), full_h, atol=1e-5)
        assert torch.allclose(torch.cat([o[1] for o in outs], 1), full_l, atol=1e-5)
        assert torch.allclose(head(full_h), full_l, atol=1e-6)


# ---- training-time test ----------------------------------------------------------------------


def test_ttt_mask_properties():
    T = 5
    m0 = ttt_attention_mask(T, 0)
    assert torch.equal(m0, torch.ones(T, T, dtype=torch.bool).tril())
    m3 = ttt_attention_mask(T, 3)
    assert m3.shape == (T, 4 * T)
    assert torch.equal(m3[:, :T], m0)
    for j in range(1, 4):
        assert torch.equal(m3[:, j * T : (j + 1) * T], torch.eye(T, dtype=torch.bool))
    assert torch.equal(m3.sum(1), torch.arange(T) + 1 + 3)  # prefix t+1 keys, one per step


def test_ttt_unroll_equals_drafting_a_chain(tiny_llama):
    """TTT step i at row t equals drafting i levels below the prefix ending at t with the
    decoding engine's cache layout and tree mask (eval/engine/eagle_proposer.py)."""
    from eval.engine.eagle_proposer import draft_tree_mask

    head = _eagle3(tiny_llama, ttt_steps=3).eval()
    batch = _batch(T=10, B=1)
    ids, T = batch["input_ids"], 10
    feats = _features(head, tiny_llama, batch)
    # the unrolled pass, as in Eagle3Head.loss
    cache, hidden, unrolled = DraftCache(), head.target_hidden(feats), []
    with torch.no_grad():
        for i in range(3):
            tokens = torch.zeros_like(ids)
            tokens[:, : T - i - 1] = ids[:, i + 1 :]
            mask = ttt_attention_mask(T, i)[None, None]
            hidden = head.draft_hidden(tokens, hidden, torch.arange(T)[None] + i, cache, mask)
            unrolled.append(hidden)
        # drafting after a prefix that ends at t: committed = t + 1 rows, then a chain
        fused = head.target_hidden(feats)
        for t in range(T - 3):
            cache = DraftCache()
            out, _ = head.step(
                ids[:, 1 : t + 2], fused[:, : t + 1], torch.arange(t + 1)[None], cache
            )
            parent = out[:, -1:]
            assert torch.allclose(parent, unrolled[0][:, t : t + 1], atol=1e-5)
            for depth in (1, 2):
                mask = draft_tree_mask([list(range(depth - 1))], t + 1, depth - 1)[None, None]
                pos = torch.tensor([[t + 1 + depth - 1]])
                tok = ids[:, t + depth + 1 : t + depth + 2]
                parent, _ = head.step(tok, parent, pos, cache, mask)
                assert torch.allclose(parent, unrolled[depth][:, t : t + 1], atol=1e-5), (t, depth)


def test_default_aux_layers():
    assert default_aux_layers(30) == [2, 15, 27]
    assert default_aux_layers(32) == [2, 16, 29]
    assert all(0 <= i < 2 for i in default_aux_layers(2))


# ---- losses ----------------------------------------------------------------------------------


def _fit(head, target, batch, steps, lr=3e-3):
    feats = _features(head, target, batch)
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=lr)
    first = head.loss(batch, feats).loss.item()
    for _ in range(steps):
        opt.zero_grad()
        out = head.loss(batch, feats)
        out.loss.backward()
        opt.step()
    return first, out


@pytest.mark.parametrize("make", [_eagle, _eagle3])
def test_loss_decreases_on_a_fixed_batch(make, tiny_target):
    # A random target's next-token distributions are nearly uniform, so the soft CE's floor
    # (their entropy) is close to where it starts: sharpen them to leave something to learn.
    with torch.no_grad():
        tiny_target.lm_head.weight.mul_(40.0)
    head = make(tiny_target).train()
    first, out = _fit(head, tiny_target, _batch(T=16), steps=15)
    assert out.loss.item() < 0.5 * first
    assert torch.isfinite(out.loss)


def test_eagle_loss_positions_and_stats(tiny_llama):
    batch = _batch(T=20)
    batch["loss_mask"][:] = 0
    batch["loss_mask"][0, 10:13] = 1  # labels x_{t+2} at 10..12 -> t in 8..10
    head = _eagle(tiny_llama, feature_noise=0.0)
    out = head.loss(batch, _features(head, tiny_llama, batch))
    for key in ("feat_loss", "ce", "top1", "top5", "head0/top1", "head0/top5"):
        assert out.stats[key][1] == 3, key
    s = out.stats
    want = s["feat_loss"][0] / 3 + 0.1 * s["ce"][0] / 3
    assert torch.allclose(out.loss, want, atol=1e-5)


def test_eagle_noise_only_while_training(tiny_llama):
    batch = _batch()
    head = _eagle(tiny_llama, feature_noise=0.5)
    feats = _features(head, tiny_llama, batch)
    head.eval()
    a, b = head.loss(batch, feats).loss, head.loss(batch, feats).loss
    assert torch.equal(a, b)
    head.train()
    assert not torch.allclose(head.loss(batch, feats).loss, a)


def test_eagle_loss_vocab_in_training_only(tiny_llama):
    batch = _batch()
    counts = _counts(batch, tiny_llama.vocab_size)
    torch.manual_seed(0)
    head = EagleHead.for_target(EagleConfig(loss_vocab_size=30), tiny_llama, token_counts=counts)
    assert head.loss_ids.numel() == 30 and "loss_ids" not in head.state_dict()
    feats = _features(head, tiny_llama, batch)
    head.train()
    train_ce = head.loss(batch, feats).stats["ce"]
    head.eval()
    val_ce = head.loss(batch, feats).stats["ce"]
    assert train_ce[0] / train_ce[1] < val_ce[0] / val_ce[1]  # 30-way vs 256-way CE
    with pytest.raises(ValueError, match="token counts"):
        EagleHead.for_target(EagleConfig(loss_vocab_size=30), tiny_llama)


def test_eagle3_step_weights_and_counts(tiny_llama):
    batch = _batch(T=16, start=8)
    head = _eagle3(tiny_llama, ttt_steps=3, decay=0.5)
    out = head.loss(batch, _features(head, tiny_llama, batch))
    means = [out.stats[f"step{i}/loss"][0] / out.stats[f"step{i}/loss"][1] for i in range(3)]
    assert torch.allclose(out.loss, means[0] + 0.5 * means[1] + 0.25 * means[2], atol=1e-5)
    # step i row t counts when x_{t+i+2} is a label: t+i+2 in 8..15, two rows each
    assert [int(out.stats[f"step{i}/top1"][1]) for i in range(3)] == [16, 16, 16]
    assert torch.equal(out.stats["head0/top1"], out.stats["step0/top1"])
    batch["loss_mask"][:, 14:] = 0  # fewer labels: later steps lose rows at the start only
    out = head.loss(batch, _features(head, tiny_llama, batch))
    assert [int(out.stats[f"step{i}/top1"][1]) for i in range(3)] == [12, 12, 12]


def test_eagle3_masks_positions_outside_the_draft_vocab(tiny_llama):
    batch = _batch()
    counts = _counts(batch, tiny_llama.vocab_size)
    feats = None
    n = {}
    for flag in (True, False):
        torch.manual_seed(0)
        cfg = Eagle3Config(draft_vocab_size=12, ttt_steps=1, mask_outside_vocab=flag)
        head = Eagle3Head.for_target(cfg, tiny_llama, token_counts=counts)
        feats = feats or _features(head, tiny_llama, batch)
        n[flag] = int(head.loss(batch, feats).stats["step0/top1"][1])
    assert n[False] == 28 and n[True] < n[False]


# ---- vocabulary, parameters, checkpoints -----------------------------------------------------


def test_eagle3_reduced_vocab_roundtrip(tiny_llama):
    batch = _batch()
    counts = _counts(batch, tiny_llama.vocab_size)
    head = _eagle3(tiny_llama, counts, draft_vocab_size=40)
    assert head.draft_vocab_size == 40 and int(head.t2d.sum()) == 40 and head.t2d[3]  # eos
    ids = head.draft_to_target(torch.arange(40))
    assert bool(head.t2d[ids].all()) and torch.equal(head.target_to_draft(ids), torch.arange(40))
    assert torch.equal(head.lm_head.weight, tiny_llama.lm_head.weight[ids])
    tokens, hidden, pos = _rows(head, tiny_llama, batch)
    with torch.no_grad():
        _, logits = head.step(tokens, hidden, pos, DraftCache())
    assert logits.shape[-1] == 40
    drafted = head.draft_to_target(logits.topk(5, dim=-1).indices)
    assert bool(head.t2d[drafted].all())
    out = head.loss(batch, _features(head, tiny_llama, batch))
    assert torch.isfinite(out.loss)


def test_parameters_are_owned_and_target_weights_frozen(tiny_llama):
    H, V = tiny_llama.hidden_size, tiny_llama.vocab_size
    spec = LayerSpec.from_hf_config(tiny_llama.model.config)
    kv = spec.num_kv_heads * spec.head_dim
    attn = lambda width: width * H + 2 * width * kv + H * H  # noqa: E731  q, k, v, o
    mlp = 3 * H * spec.intermediate_size
    e1 = _eagle(tiny_llama)
    assert sum(p.numel() for p in e1.parameters()) == 2 * H * H + H + attn(H) + mlp + H
    e3 = _eagle3(tiny_llama)
    n_aux = len(e3.feature_layers())
    want = n_aux * H * H + attn(2 * H) + mlp + 3 * H + H + V * H
    assert sum(p.numel() for p in e3.parameters()) == want
    for head in (e1, e3):
        params = list(head.parameters())
        assert len({p.data_ptr() for p in params}) == len(params)
        assert all(p.requires_grad for p in params)
        assert head.embed_weight.data_ptr() == tiny_llama.embed_tokens.weight.data_ptr()


def test_checkpoints_hold_only_the_draft(tiny_llama, tmp_path):
    e1 = _eagle(tiny_llama)
    e1.save_pretrained(tmp_path / "e1")
    assert sorted(load_file(tmp_path / "e1" / "model.safetensors")) == sorted(
        ["fc.weight", "fc.bias", *LAYER_KEYS]
    )
    e1n = _eagle(tiny_llama, input_norm=True)
    assert "layers.0.input_layernorm.weight" in e1n.state_dict()
    batch = _batch()
    e3 = _eagle3(tiny_llama, _counts(batch, tiny_llama.vocab_size), draft_vocab_size=50)
    e3.save_pretrained(tmp_path / "e3")
    saved = load_file(tmp_path / "e3" / "model.safetensors")
    extra = ["layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight", "norm.weight"]
    assert sorted(saved) == sorted(
        ["fc.weight", "lm_head.weight", "d2t", "t2d", *LAYER_KEYS, *extra]
    )
    assert saved["lm_head.weight"].shape == (50, tiny_llama.hidden_size)
    assert saved["d2t"].dtype == torch.int64 and saved["t2d"].dtype == torch.bool


@pytest.mark.parametrize("make", [_eagle, _eagle3])
def test_reload_onto_the_right_target_only(make, tiny_target, tmp_path):
    head = make(tiny_target).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    head.save_pretrained(tmp_path / "h")
    loaded = heads.from_pretrained(tmp_path / "h", tiny_target).eval()
    assert type(loaded) is type(head) and loaded.config == head.config
    for (k, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), k
    tokens, hidden, pos = _rows(head, tiny_target, _batch(T=8))
    with torch.no_grad():
        assert torch.equal(
            head.step(tokens, hidden, pos, DraftCache())[1],
            loaded.step(tokens, hidden, pos, DraftCache())[1],
        )
    other = Target.from_model(make_llama(hidden=32), name_or_path="other")
    with pytest.raises(HeadMismatchError, match="hidden_size=64.*hidden_size=32"):
        heads.from_pretrained(tmp_path / "h", other)


def test_eagle3_refuses_a_target_with_other_layers(tiny_llama, tmp_path):
    _eagle3(tiny_llama).save_pretrained(tmp_path / "h")
    deeper = Target.from_model(make_llama(layers=3), name_or_path="deeper")
    with pytest.raises(HeadMismatchError, match="num_layers=2.*num_layers=3"):
        heads.from_pretrained(tmp_path / "h", deeper)


def test_build_head_through_the_registry(tiny_llama):
    assert isinstance(heads.build_head(EagleConfig(), tiny_llama), EagleHead)
    e3 = heads.build_head(Eagle3Config(draft_vocab_size=None), tiny_llama)
    assert isinstance(e3, Eagle3Head) and e3.config.aux_layers == default_aux_layers(2)
    with pytest.raises(ValueError, match="aux_layers"):
        heads.build_head(Eagle3Config(aux_layers=[0, 2]), tiny_llama)


def test_config_validation():
    with pytest.raises(ValueError, match="ce_weight"):
        EagleConfig(ce_weight=-1)
    with pytest.raises(ValueError, match="feature_noise"):
        EagleConfig(feature_noise=-0.1)
    with pytest.raises(ValueError, match="ttt_steps"):
        Eagle3Config(ttt_steps=0)
    with pytest.raises(ValueError, match="decay"):
        Eagle3Config(decay=0)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        Eagle3Config(draft_vocab_size=0)


def test_attention_mask_must_be_bool_and_sized(tiny_llama):
    head = _eagle(tiny_llama).eval()
    tokens, hidden, pos = _rows(head, tiny_llama, _batch(T=4, B=1))
    with pytest.raises(ValueError, match="bool"):
        head.step(tokens, hidden, pos, DraftCache(), torch.zeros(1, 1, 4, 4))
    with pytest.raises(ValueError, match="past"):
        head.step(tokens, hidden, pos, DraftCache(), torch.ones(1, 1, 4, 5, dtype=torch.bool))
