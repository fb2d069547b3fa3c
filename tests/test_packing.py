"""Packed rows (`trainer.pack_tokens`): several conversations per row, no padding.

For every head type a packed batch must give the padded batch's loss, statistics and gradients;
a conversation's loss terms must not depend on the conversation packed next to it (attention,
positions, labels and EAGLE-3's unrolled steps stay inside it); and a packed run trains like a
padded one and resumes exactly. Tiny random Llama targets (conftest), seconds to run.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from conftest import make_llama, make_tokenizer

from data.dataset import collate, pack_examples, packed_collate
from data.features import compute_features
from heads.eagle import EagleConfig, EagleHead
from heads.eagle3 import Eagle3Config, Eagle3Head
from heads.medusa import MedusaConfig, MedusaHeads
from heads.medusa2 import Medusa2Config, Medusa2Head
from heads.target import Target
from heads.vocab import count_tokens
from train.config import TrainerConfig
from train.features import batch_features
from train.loop import Trainer

VOCAB = 256


def make_examples(lengths, seed=0, prompt=None) -> list[dict]:
    """Random conversations; `prompt[i]` tokens without loss (default: a third, and 0 for every
    third example, so some conversations start with assistant tokens right at a boundary)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        p = (n // 3 if i % 3 else 0) if prompt is None else prompt[i]
        mask = torch.zeros(n, dtype=torch.long)
        mask[p:] = 1
        out.append({"input_ids": torch.randint(4, VOCAB, (n,), generator=g), "loss_mask": mask})
    return out


def fresh_target() -> Target:
    return Target.from_model(make_llama(), make_tokenizer(), name_or_path="tiny-llama")


def build(kind: str, target: Target, examples):
    torch.manual_seed(0)
    counts = count_tokens(examples, VOCAB)
    if kind == "medusa":
        head = MedusaHeads.for_target(MedusaConfig(num_heads=3, num_layers=1), target)
    elif kind == "medusa_soft":
        cfg = MedusaConfig(num_heads=2, draft_vocab_size=64, soft_targets=True)
        head = MedusaHeads.for_target(cfg, target, token_counts=counts)
    elif kind == "eagle":
        head = EagleHead.for_target(EagleConfig(feature_noise=0.0), target)
    elif kind == "eagle3":
        head = Eagle3Head.for_target(
            Eagle3Config(draft_vocab_size=64, ttt_steps=3), target, token_counts=counts
        )
    else:
        head = Medusa2Head.for_target(Medusa2Config(num_heads=2, lora_rank=4), target)
    return head.eval()


def with_features(head, target, examples):
    if not getattr(head, "uses_target_features", True):
        return examples
    return compute_features(
        examples, target, head.feature_layers(), dtype=torch.float32, progress=False
    )


def head_loss(head, batch, target):
    return head.loss(batch, batch_features(batch, target, head.feature_layers(), head))


def loss_and_grads(head, batch, target=None):
    head.zero_grad(set_to_none=True)
    out = head.loss(batch, batch_features(batch, target, head.feature_layers(), head))
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}
    return out, grads


KINDS = ["medusa", "medusa_soft", "eagle", "eagle3", "medusa2"]


# ---- packing itself ------------------------------------------------------------------------


def test_pack_examples_fills_rows_and_restarts_positions():
    examples = make_examples([5, 3, 7, 2, 12])
    rows = pack_examples(examples, 8)
    # first-fit decreasing: 12 (longer than a row) | 7 | 5 + 3 | 2 (fits nowhere else)
    assert [len(r["input_ids"]) for r in rows] == [12, 7, 8, 2]
    placed = []
    for row in rows:
        starts = (row["position_ids"] == 0).nonzero().flatten().tolist()
        assert row["segment_ids"][starts].tolist() == list(range(1, len(starts) + 1))
        for s, start in enumerate(starts):
            n = int((row["segment_ids"] == s + 1).sum())
            assert row["position_ids"][start : start + n].tolist() == list(range(n))
            placed.append(row["input_ids"][start : start + n].tolist())
    assert sorted(placed) == sorted(e["input_ids"].tolist() for e in examples)
    batch = collate(rows, pad_id=0)
    assert batch["input_ids"].shape == (4, 12)
    assert batch["attention_mask"].sum() == sum(len(e["input_ids"]) for e in examples)
    assert batch["segment_ids"][1, 7:].eq(0).all() and batch["position_ids"][1, 7:].eq(0).all()


def test_packing_removes_padding():
    examples = make_examples([30, 4, 5, 6, 28, 3])
    padded = collate(examples)
    packed = collate(pack_examples(examples, 32))
    assert padded["input_ids"].numel() == 6 * 30
    assert packed["input_ids"].numel() == 3 * 32  # rows: 30 | 28 + 4 | 6 + 5 + 3
    assert packed["attention_mask"].sum() == padded["attention_mask"].sum()


# ---- the same loss, statistics and gradients --------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_packed_batch_equals_padded_batch(kind):
    target = fresh_target()
    examples = make_examples([14, 9, 11, 5, 16, 7])
    head = build(kind, target, examples)
    examples = with_features(head, target, examples)
    padded = collate(examples)
    packed = collate(pack_examples(examples, 24))
    assert packed["input_ids"].shape[0] < padded["input_ids"].shape[0]
    out_pad, grads_pad = loss_and_grads(head, padded, target)
    out_pack, grads_pack = loss_and_grads(head, packed, target)
    torch.testing.assert_close(out_pack.loss, out_pad.loss, rtol=1e-5, atol=1e-6)
    assert out_pack.stats.keys() == out_pad.stats.keys()
    for name, pair in out_pad.stats.items():
        assert out_pack.stats[name][1] == pair[1], name  # the same positions count
        torch.testing.assert_close(out_pack.stats[name], pair, rtol=1e-4, atol=1e-5)
    assert grads_pad and grads_pack.keys() == grads_pad.keys()
    for name, grad in grads_pad.items():
        torch.testing.assert_close(grads_pack[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3"])
def test_online_packed_features_equal_per_conversation_features(kind):
    """With no cache the target runs on the packed rows (4-D mask, restarting positions)."""
    target = fresh_target()
    examples = make_examples([10, 7, 12, 5])
    head = build(kind, target, examples)
    cached = collate(pack_examples(with_features(head, target, examples), 40))
    online = collate(pack_examples(examples, 40))
    assert "hidden" not in online
    want = batch_features(cached, None, head.feature_layers())
    got = batch_features(online, target, head.feature_layers())
    real = online["attention_mask"].bool()
    for key in want:
        torch.testing.assert_close(got[key][real], want[key][real], rtol=1e-4, atol=1e-5)


# ---- boundaries ----------------------------------------------------------------------------


def row_of(first, second):
    """One packed row holding `first` then `second` (first is the longer one)."""
    rows = pack_examples([first, second], 64)
    assert len(rows) == 1
    assert torch.equal(rows[0]["input_ids"][: len(first["input_ids"])], first["input_ids"])
    return collate(rows)


@pytest.mark.parametrize("kind", KINDS)
def test_a_conversation_does_not_see_its_neighbour(kind):
    target = fresh_target()
    a, b = make_examples([16, 10], prompt=[4, 0])  # b is all assistant tokens
    a_other = make_examples([16], seed=5, prompt=[4])[0]
    head = build(kind, target, [a, b])
    a, b, a_other = with_features(head, target, [a, b, a_other])
    quiet = {**a, "loss_mask": torch.zeros_like(a["loss_mask"])}
    quiet_other = {**a_other, "loss_mask": torch.zeros_like(a["loss_mask"])}
    # b's loss terms: the same next to either a, and the same as b alone (positions restart)
    b_next_to_a = head_loss(head, row_of(quiet, b), target)
    b_next_to_other = head_loss(head, row_of(quiet_other, b), target)
    b_alone = head_loss(head, collate([b]), target)
    torch.testing.assert_close(b_next_to_a.loss, b_alone.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b_next_to_other.loss, b_alone.loss, rtol=1e-5, atol=1e-6)
    # a's terms never take b's tokens as labels: the packed counts are a's alone plus b's alone
    packed = head_loss(head, row_of(a, b), target)
    a_only = head_loss(head, collate([a]), target)
    for name, pair in packed.stats.items():
        if name != "loss":
            assert pair[1] == a_only.stats[name][1] + b_alone.stats[name][1], name


def test_unmasked_packing_would_leak():
    """The boundary test can fail: the same row without segment_ids lets b attend to a."""
    target = fresh_target()
    a, b = make_examples([16, 10], prompt=[4, 0])
    a_other = make_examples([16], seed=5, prompt=[4])[0]
    head = build("eagle", target, [a, b])
    a, b, a_other = with_features(head, target, [a, b, a_other])
    losses = []
    for first in (a, a_other):
        row = row_of({**first, "loss_mask": torch.zeros_like(first["loss_mask"])}, b)
        del row["segment_ids"], row["position_ids"]
        losses.append(float(head.loss(row, batch_features(row, None, None)).loss.detach()))
    assert abs(losses[0] - losses[1]) > 1e-4


# ---- training and resuming -------------------------------------------------------------------


def train_medusa(run_dir, examples, target, stop_at=None, **overrides):
    torch.manual_seed(0)
    config = MedusaConfig(num_heads=2, draft_vocab_size=64)
    head = MedusaHeads.for_target(config, target, token_counts=count_tokens(examples, VOCAB))
    base = dict(lr=1e-2, max_steps=6, batch_size=4, save_every=3, log_every=1, progress=False)
    base.update(seed=0, max_grad_norm=0.0)
    trainer = Trainer(
        head,
        TrainerConfig(**{**base, **overrides}),
        run_dir,
        train_dataset=examples,
        collate_fn=partial(collate, pad_id=0),
        target=target,
        val_dataset=examples[:3],
        callbacks=[lambda state: state.step == stop_at] if stop_at else (),
    )
    return head, trainer.fit()


def test_packed_run_trains_like_padded_and_resumes_exactly(tmp_path):
    target = fresh_target()
    lengths = [6 + (7 * i) % 19 for i in range(12)]
    examples = compute_features(make_examples(lengths), target, progress=False, dtype=torch.float32)
    padded, padded_result = train_medusa(tmp_path / "padded", examples, target)
    packed, result = train_medusa(tmp_path / "packed", examples, target, pack_tokens=48)
    assert result.step == 6 and result.tokens == padded_result.tokens
    assert result.loss_tokens == padded_result.loss_tokens
    for (name, x), (_, y) in zip(padded.state_dict().items(), packed.state_dict().items()):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-5, msg=name)
    assert result.val_metrics["val/head0/top1"] == padded_result.val_metrics["val/head0/top1"]

    _, first = train_medusa(tmp_path / "resumed", examples, target, stop_at=2, pack_tokens=48)
    assert first.stopped_early and first.step == 2
    resumed, second = train_medusa(tmp_path / "resumed", examples, target, pack_tokens=48)
    assert second.step == 6 and second.tokens == result.tokens
    for (name, x), (_, y) in zip(packed.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(x, y), name


def test_a_padded_run_resumes_with_packing_switched_on(tmp_path):
    target = fresh_target()
    lengths = [6 + (7 * i) % 19 for i in range(12)]
    examples = compute_features(make_examples(lengths), target, progress=False, dtype=torch.float32)
    straight, _ = train_medusa(tmp_path / "straight", examples, target)
    train_medusa(tmp_path / "switched", examples, target, stop_at=3)
    switched, result = train_medusa(tmp_path / "switched", examples, target, pack_tokens=48)
    assert result.step == 6 and not result.stopped_early
    for (name, x), (_, y) in zip(straight.state_dict().items(), switched.state_dict().items()):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-5, msg=name)


def test_packed_collate_is_picklable_and_config_checks():
    import pickle

    fn = pickle.loads(pickle.dumps(partial(packed_collate, partial(collate, pad_id=0), 16)))
    batch = fn(make_examples([5, 6, 7]))
    assert batch["input_ids"].shape == (2, 13)  # 7 + 6 | 5
    with pytest.raises(Exception, match="pack_tokens"):
        TrainerConfig(pack_tokens=-1)
    assert TrainerConfig(pack_tokens=0).pack_tokens == 0  # 0 = padded, as null


# ---- bf16 feature extraction (data/features.py `autocast`) ------------------------------------


def test_autocast_extraction_is_close_but_recorded(tmp_path):
    from data.feature_cache import open_or_build_feature_cache
    from data.feature_cache_format import default_cache_dir
    from data.features import FeatureCacheMismatch, LazyFeatureDataset

    target = fresh_target()
    examples = make_examples([12, 9, 15])
    fp32 = compute_features(examples, target, [1], dtype=torch.float32, progress=False)
    bf16 = compute_features(
        examples, target, [1], dtype=torch.float32, progress=False, autocast="bfloat16"
    )
    for a, b in zip(fp32, bf16, strict=True):
        assert not torch.equal(a["hidden"], b["hidden"])  # autocast really ran
        assert torch.cosine_similarity(a["hidden"], b["hidden"], dim=-1).min() > 0.99
    lazy = LazyFeatureDataset(examples, target, [1], torch.float32, autocast="bfloat16")
    torch.testing.assert_close(lazy[0]["aux"], bf16[0]["aux"], rtol=0.02, atol=0.02)
    with pytest.raises(ValueError, match="autocast"):
        LazyFeatureDataset(examples, target, [1], autocast="int8")

    folder = tmp_path / "cache"
    cache = open_or_build_feature_cache(
        examples, target, folder, [1], "float32", progress=False, autocast="bfloat16"
    )
    torch.testing.assert_close(cache[1]["hidden"], bf16[1]["hidden"])
    with pytest.raises(FeatureCacheMismatch, match="autocast"):
        open_or_build_feature_cache(examples, target, folder, [1], "float32", progress=False)
    plain = open_or_build_feature_cache(examples, target, tmp_path / "plain", [1], "float32")
    torch.testing.assert_close(plain[1]["hidden"], fp32[1]["hidden"])
    with pytest.raises(FeatureCacheMismatch, match="autocast"):
        open_or_build_feature_cache(
            examples, target, tmp_path / "plain", [1], "float32", autocast="bfloat16"
        )
    assert default_cache_dir("f" * 12, [1], "float16", "s" * 12, "bfloat16") != default_cache_dir(
        "f" * 12, [1], "float16", "s" * 12
    )
