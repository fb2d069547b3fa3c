"""Medusa heads: shapes, parameter ownership, loss decay, reduced vocab, save/load and mismatch."""

from __future__ import annotations

import pytest
import torch
from conftest import make_llama

import heads
from heads.base import HeadMismatchError
from heads.medusa import MedusaConfig, MedusaHeads
from heads.target import Target
from heads.vocab import count_tokens


def _batch(T=24, B=2, V=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, V, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.long)
    mask[:, T // 3 :] = 1
    return {
        "input_ids": ids,
        "attention_mask": torch.ones(B, T, dtype=torch.long),
        "loss_mask": mask,
    }


def _features(target, batch):
    return target.features(batch["input_ids"], batch["attention_mask"])


def test_shapes_and_each_block_owns_its_weights(tiny_llama):
    cfg = MedusaConfig(num_heads=3, num_layers=2)
    m = MedusaHeads.for_target(cfg, tiny_llama)
    H, V = tiny_llama.hidden_size, tiny_llama.vocab_size
    assert m(torch.randn(5, 7, H)).shape == (3, 5, 7, V)
    n_params = sum(p.numel() for p in m.parameters())
    assert n_params == 3 * 2 * (H * H + H) + 3 * V * H
    ptrs = {p.data_ptr() for p in m.parameters()}
    assert len(ptrs) == len(list(m.parameters()))  # no shared blocks ([ResBlock] * n bug)


def test_untrained_head_equals_target_lm_head(tiny_llama):
    m = MedusaHeads.for_target(MedusaConfig(num_heads=2), tiny_llama)
    h = torch.randn(4, tiny_llama.hidden_size)
    ref = tiny_llama.lm_head(h)
    assert torch.allclose(m(h)[1], ref, atol=1e-5)


def test_shared_lm_head_is_frozen_and_not_saved(tiny_llama, tmp_path):
    m = MedusaHeads.for_target(MedusaConfig(num_heads=2, share_lm_head=True), tiny_llama)
    H = tiny_llama.hidden_size
    assert sum(p.numel() for p in m.parameters()) == 2 * (H * H + H)
    m.save_pretrained(tmp_path / "h")
    loaded = heads.from_pretrained(tmp_path / "h", tiny_llama)
    assert "shared_proj" not in loaded.state_dict()
    h = torch.randn(3, H)
    assert torch.allclose(loaded(h), m(h))


def test_loss_decay_weights_heads(tiny_llama):
    batch = _batch()
    feats = _features(tiny_llama, batch)
    out_a = MedusaHeads.for_target(MedusaConfig(num_heads=3, decay=1.0), tiny_llama).loss(
        batch, feats
    )
    out_b = MedusaHeads.for_target(MedusaConfig(num_heads=3, decay=0.5), tiny_llama).loss(
        batch, feats
    )
    per_head = [out_a.stats[f"head{k}/loss"] for k in range(3)]
    means = [s[0] / s[1] for s in per_head]
    assert torch.allclose(out_a.loss, sum(means), atol=1e-5)
    assert torch.allclose(out_b.loss, means[0] + 0.5 * means[1] + 0.25 * means[2], atol=1e-5)


def test_loss_counts_only_assistant_labels(tiny_llama):
    batch = _batch(T=20)
    batch["loss_mask"][:] = 0
    batch["loss_mask"][0, 10:13] = 1  # three labelled tokens in row 0
    out = MedusaHeads.for_target(MedusaConfig(num_heads=2), tiny_llama).loss(
        batch, _features(tiny_llama, batch)
    )
    assert out.stats["head0/top1"][1] == 3  # labels at t+2 in {10,11,12} -> t in {8,9,10}
    assert out.stats["head1/top1"][1] == 3


def test_head_predicts_two_ahead():
    """Trained on one fixed batch, a head must learn x_{t+2} exactly."""
    target = Target.from_model(make_llama(vocab=64), name_or_path="t")
    m = MedusaHeads.for_target(MedusaConfig(num_heads=1, num_layers=1), target)
    batch = _batch(T=16, B=2, V=64)
    feats = _features(target, batch)
    opt = torch.optim.Adam(m.parameters(), lr=3e-2)
    first = m.loss(batch, feats).loss.item()
    for _ in range(60):
        opt.zero_grad()
        out = m.loss(batch, feats)
        out.loss.backward()
        opt.step()
    assert out.loss.item() < 0.2 * first
    assert out.stats["head0/top1"][0] == out.stats["head0/top1"][1]


def test_reduced_vocab_roundtrip(tiny_llama, tmp_path):
    batch = _batch()
    counts = count_tokens(
        [{"input_ids": r, "loss_mask": m} for r, m in zip(batch["input_ids"], batch["loss_mask"])],
        tiny_llama.vocab_size,
    )
    cfg = MedusaConfig(num_heads=2, draft_vocab_size=40)
    m = MedusaHeads.for_target(cfg, tiny_llama, token_counts=counts)
    assert m.draft_vocab_size == 40
    assert m.t2d.sum() == 40 and m.t2d[3]  # eos always kept
    ids = m.draft_to_target(torch.arange(40))
    assert torch.equal(m.target_to_draft(ids), torch.arange(40))
    assert bool(m.t2d[ids].all())
    assert m(torch.randn(2, tiny_llama.hidden_size)).shape == (2, 2, 40)
    out = m.loss(batch, _features(tiny_llama, batch))
    assert torch.isfinite(out.loss)
    m.save_pretrained(tmp_path / "h")
    loaded = heads.from_pretrained(tmp_path / "h", tiny_llama)
    assert torch.equal(loaded.d2t, m.d2t) and torch.equal(loaded.t2d, m.t2d)


def test_save_load_roundtrip_and_mismatch(tiny_llama, tmp_path):
    m = MedusaHeads.for_target(MedusaConfig(num_heads=2, num_layers=1), tiny_llama)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    m.save_pretrained(tmp_path / "h")
    assert sorted(p.name for p in (tmp_path / "h").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    loaded = heads.from_pretrained(tmp_path / "h", tiny_llama)
    for (k, a), (_, b) in zip(m.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), k
    other = Target.from_model(make_llama(hidden=32), name_or_path="other")
    with pytest.raises(HeadMismatchError, match="hidden_size=64.*hidden_size=32"):
        heads.from_pretrained(tmp_path / "h", other)


def test_from_pretrained_without_config_is_clear(tmp_path, tiny_llama):
    with pytest.raises(FileNotFoundError, match="config.json"):
        heads.from_pretrained(tmp_path, tiny_llama)


def test_config_validation():
    with pytest.raises(ValueError, match="num_heads"):
        MedusaConfig(num_heads=0)
    with pytest.raises(ValueError, match="decay"):
        MedusaConfig(decay=1.5)


def test_soft_targets_distil_the_target_distribution(tiny_llama):
    batch = _batch(T=16)
    feats = _features(tiny_llama, batch)
    m = MedusaHeads.for_target(MedusaConfig(num_heads=2, soft_targets=True), tiny_llama)
    out = m.loss(batch, feats)
    h, mask = feats["hidden"], batch["loss_mask"]
    for k in range(2):
        s = k + 2
        valid = torch.zeros_like(mask, dtype=torch.bool)
        valid[:, : 16 - s] = mask[:, s:].bool()
        teacher = tiny_llama.lm_head(h[:, k + 1 : 16 - s + k + 1][valid[:, : 16 - s]]).softmax(-1)
        student = m(h[:, : 16 - s][valid[:, : 16 - s]])[k].log_softmax(-1)
        want = -(teacher * student).sum(-1).mean()
        got = out.stats[f"head{k}/loss"]
        assert torch.allclose(got[0] / got[1], want, atol=1e-5)
    # An untrained head is the target's lm_head, so head 0 agrees with the teacher only where
    # h_t and h_{t+1} share an argmax; after training on the teacher it agrees far more often.
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    before = out.stats["head0/agree"]
    for _ in range(40):
        opt.zero_grad()
        out = m.loss(batch, feats)
        out.loss.backward()
        opt.step()
    after = out.stats["head0/agree"]
    assert after[0] / after[1] > before[0] / before[1] + 0.3
