"""data/feature_cache.py: the sharded on-disk feature cache equals the in-memory features, trains
the same, resumes a killed build, splits work over ranks and refuses a cache for other data."""

from __future__ import annotations

import json
import os
import pickle
import socket

import pytest
import torch
from omegaconf import OmegaConf

from data.dataset import collate
from data.feature_cache import FeatureCacheDataset, open_or_build_feature_cache
from data.feature_cache_build import build_feature_cache
from data.feature_cache_format import dequantize_int8, quantize_int8, shard_file
from data.features import FeatureCacheMismatch, compute_features, feature_meta
from heads.dflash import DFlashConfig, DFlashHead
from heads.eagle3 import Eagle3Config, Eagle3Head
from heads.medusa import MedusaConfig, MedusaHeads
from train.features import batch_features

LENGTHS = (7, 3, 12, 5, 9, 4, 10)  # 7 examples: 4 shards of 2, the last one holds 1


def make_examples(lengths=LENGTHS, vocab=256, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(4, vocab, (n,), generator=gen),
            "loss_mask": (torch.arange(n) >= n // 3).long(),
        }
        for n in lengths
    ]


def build(examples, target, folder, **kw):
    # batch_tokens=1: every example runs alone, exactly as in the reference below.
    kw = {"examples_per_shard": 2, "batch_tokens": 1, "progress": False, **kw}
    return build_feature_cache(examples, target, folder, **kw)


def reference(examples, target, layers, dtype=torch.float32):
    return compute_features(examples, target, layers, batch_tokens=1, dtype=dtype, progress=False)


def expected(target, layers, dtype):
    return {**feature_meta(target, layers), "dtype": dtype}


def shard_bytes(folder) -> dict[str, bytes]:
    return {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))}


# ---- contents -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_float_cache_equals_computed_features(tiny_llama, tmp_path, dtype):
    examples, layers = make_examples(), [0, 1]
    index = build(examples, tiny_llama, tmp_path, layers=layers, dtype=dtype)
    assert [s["file"] for s in index["shards"]] == [shard_file(s) for s in range(4)]
    assert [(s["first"], s["last"]) for s in index["shards"]] == [(0, 1), (2, 3), (4, 5), (6, 6)]
    assert index["num_examples"] == 7 and index["num_tokens"] == sum(LENGTHS)
    assert sorted(os.listdir(tmp_path)) == ["index.json", *(shard_file(s) for s in range(4))]

    cache = FeatureCacheDataset(tmp_path, examples, expected(tiny_llama, layers, dtype))
    want = reference(examples, tiny_llama, layers, getattr(torch, dtype))
    assert len(cache) == 7 and cache.lengths() == list(LENGTHS)
    for i in range(len(cache)):
        item = cache[i]
        assert set(item) == {"input_ids", "loss_mask", "hidden", "aux"}
        assert item["input_ids"] is examples[i]["input_ids"]
        for key in ("hidden", "aux"):
            assert item[key].dtype == getattr(torch, dtype)
            assert torch.equal(item[key], want[i][key]), (i, key)
    assert "hidden" not in examples[0]
    copy = pickle.loads(pickle.dumps(cache))  # as DataLoader workers get it: shards reopened
    assert torch.equal(copy[6]["aux"], want[6]["aux"])


def test_int8_cache_is_within_half_a_step(tiny_llama, tmp_path):
    examples, layers = make_examples(), [1]
    build(examples, tiny_llama, tmp_path, layers=layers, dtype="int8")
    meta = expected(tiny_llama, layers, "int8")
    cache = FeatureCacheDataset(tmp_path, examples, meta, dequantize_to=torch.float32)
    want = reference(examples, tiny_llama, layers)
    for i in range(len(cache)):
        for key in ("hidden", "aux"):
            x, got = want[i][key], cache[i][key]
            step = x.abs().amax(dim=-1, keepdim=True) / 127  # (T, 1)
            assert ((got - x).abs() <= step / 2 + 1e-6).all()
            assert (got - x).norm() / x.norm() < 0.01
    # Read as float16 by default: the training code never sees int8.
    default = FeatureCacheDataset(tmp_path, examples, meta)
    assert default[0]["hidden"].dtype == torch.float16


def test_int8_zero_rows_and_round_trip():
    x = torch.randn(5, 16) * torch.tensor([1.0, 0.0, 1e-3, 100.0, 1.0])[:, None]
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.shape == (5,) and scale[1] == 0
    back = dequantize_int8(q, scale, torch.float32)
    assert torch.isfinite(back).all() and (back[1] == 0).all()
    assert ((back - x).abs() <= scale[:, None] / 2 + 1e-7).all()
    assert q.abs().amax(dim=-1).tolist() == [127, 0, 127, 127, 127]


def test_int8_uses_less_than_60_percent_of_float16(tiny_llama, tmp_path):
    examples = make_examples(lengths=[64] * 8)
    sizes = {}
    for dtype in ("float16", "int8"):
        index = build(examples, tiny_llama, tmp_path / dtype, layers=[0, 1], dtype=dtype)
        sizes[dtype] = index["bytes_per_token"]
        on_disk = sum(os.path.getsize(tmp_path / dtype / s["file"]) for s in index["shards"])
        assert sizes[dtype] == pytest.approx(on_disk / (64 * 8))
    # fp16: (64 + 128) values * 2 B; int8: 192 B + two float32 scales, plus headers.
    assert sizes["float16"] >= 384 and sizes["int8"] >= 200
    assert sizes["int8"] < 0.6 * sizes["float16"]


# ---- training on it -----------------------------------------------------------------------


def medusa(target):
    torch.manual_seed(0)
    return MedusaHeads.for_target(MedusaConfig(num_heads=2), target).eval()


def eagle3(target):
    torch.manual_seed(0)
    config = Eagle3Config(aux_layers=[0, 1, 1], draft_vocab_size=None, ttt_steps=2)
    return Eagle3Head.for_target(config, target).eval()


def dflash(target):
    torch.manual_seed(0)
    config = DFlashConfig(block_size=4, num_anchors=6, target_layer_ids=[0, 0])
    return DFlashHead.for_target(config, target).eval()


@pytest.mark.parametrize("make_head", [medusa, eagle3, dflash])
def test_cached_features_give_the_online_loss(tiny_llama, tmp_path, make_head):
    head = make_head(tiny_llama)
    layers = head.feature_layers()
    examples = make_examples()
    cache = open_or_build_feature_cache(
        examples, tiny_llama, tmp_path, layers, "float32", examples_per_shard=3, progress=False
    )
    online = collate(examples)
    cached = collate([cache[i] for i in range(len(cache))])
    assert ("aux" in cached) == bool(layers)
    with torch.no_grad():  # the same seed: DFlash samples the same anchors
        torch.manual_seed(7)
        want = head.loss(online, batch_features(online, tiny_llama, layers))
        torch.manual_seed(7)
        got = head.loss(cached, batch_features(cached, None, layers))
    torch.testing.assert_close(got.loss, want.loss, atol=1e-6, rtol=0)
    assert got.loss > 0
    for name, value in want.stats.items():
        torch.testing.assert_close(got.stats[name], value, atol=1e-5, rtol=1e-6)


# ---- resuming and sharding ----------------------------------------------------------------


def counting_features(target, monkeypatch, fail_after=None):
    """Count target.features calls; raise on the call after `fail_after`."""
    calls = []
    original = target.features

    def features(*args, **kwargs):
        if fail_after is not None and len(calls) >= fail_after:
            raise RuntimeError("killed")
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(target, "features", features)
    return calls


def test_killed_build_resumes_without_recomputing(tiny_llama, tmp_path, monkeypatch):
    examples, layers = make_examples(), [1]
    whole = build(examples, tiny_llama, tmp_path / "whole", layers=layers)

    folder = tmp_path / "resumed"
    counting_features(tiny_llama, monkeypatch, fail_after=3)
    with pytest.raises(RuntimeError, match="killed"):
        build(examples, tiny_llama, folder, layers=layers)
    # Shard 0 (2 examples, 2 calls) was written; shard 1 died on its 2nd example; no index.
    assert sorted(os.listdir(folder)) == [shard_file(0)]
    # Tmp files: one left by a killed process on this host, one of another host (left alone).
    dead = folder / f"{shard_file(1)}.tmp-{socket.gethostname()}-999999999"
    other = folder / f"{shard_file(2)}.tmp-another-host-{os.getpid()}"
    dead.write_bytes(b"half a shard")
    other.write_bytes(b"someone else's")

    monkeypatch.undo()
    calls = counting_features(tiny_llama, monkeypatch)
    index = build(examples, tiny_llama, folder, layers=layers)
    assert len(calls) == len(examples) - 2  # shard 0 was not recomputed
    assert not dead.exists() and other.exists()
    other.unlink()
    assert index == whole
    assert shard_bytes(folder) == shard_bytes(tmp_path / "whole")

    calls.clear()  # a finished cache is opened, not rebuilt
    cache = open_or_build_feature_cache(examples, tiny_llama, folder, layers, progress=False)
    assert len(calls) == 0 and len(cache) == len(examples)


def test_two_ranks_build_the_one_process_cache(tiny_llama, tmp_path, monkeypatch):
    examples, layers = make_examples(), [0]
    kw = {"layers": layers, "dtype": "int8"}
    single = build(examples, tiny_llama, tmp_path / "single", **kw)

    folder = tmp_path / "ranks"
    calls = counting_features(tiny_llama, monkeypatch)
    assert build(examples, tiny_llama, folder, **kw, rank=0, world_size=2) is None
    assert sorted(os.listdir(folder)) == [shard_file(0), shard_file(2)]  # shards s % 2 == 0
    assert len(calls) == 2 + 2
    index = build(examples, tiny_llama, folder, **kw, rank=1, world_size=2)
    assert len(calls) == 7  # every example once over both ranks
    assert index == single
    assert shard_bytes(folder) == shard_bytes(tmp_path / "single")

    cache = FeatureCacheDataset(folder, examples, expected(tiny_llama, layers, "int8"))
    ref = FeatureCacheDataset(tmp_path / "single", examples, expected(tiny_llama, layers, "int8"))
    assert all(torch.equal(cache[i]["aux"], ref[i]["aux"]) for i in range(len(examples)))

    barriers = []  # with a barrier, every rank gets the index back after two barriers

    def barrier():
        barriers.append(1)

    again = build(examples, tiny_llama, folder, **kw, barrier=barrier)
    assert again == single and len(barriers) == 2 and len(calls) == 7


# ---- refusals -----------------------------------------------------------------------------


def test_refuses_another_target_layers_dtype_or_examples(tiny_llama, tiny_qwen2, tmp_path):
    examples = make_examples()
    build(examples, tiny_llama, tmp_path, layers=[1])
    ok = FeatureCacheDataset(tmp_path, examples, expected(tiny_llama, [1], "float16"))
    assert len(ok) == 7

    with pytest.raises(FeatureCacheMismatch) as err:
        FeatureCacheDataset(tmp_path, examples, expected(tiny_qwen2, [1], "float16"))
    message = str(err.value)
    assert "fingerprint" in message and tiny_llama.fingerprint in message
    assert tiny_qwen2.fingerprint in message and "tiny-llama" in message
    assert str(tmp_path) in message and "data.feature_cache" in message

    with pytest.raises(FeatureCacheMismatch, match=r"layers=\[1\] .* layers=\[0, 1\]"):
        FeatureCacheDataset(tmp_path, examples, expected(tiny_llama, [0, 1], "float16"))
    with pytest.raises(FeatureCacheMismatch, match="dtype='float16' .* dtype='int8'"):
        FeatureCacheDataset(tmp_path, examples, expected(tiny_llama, [1], "int8"))
    with pytest.raises(FeatureCacheMismatch, match="other examples"):
        FeatureCacheDataset(tmp_path, make_examples(seed=1), expected(tiny_llama, [1], "float16"))
    with pytest.raises(FeatureCacheMismatch, match="num_examples=7 .* num_examples=6"):
        FeatureCacheDataset(tmp_path, examples[:6], expected(tiny_llama, [1], "float16"))
    # Building into the folder for another target refuses too, before computing anything.
    with pytest.raises(FeatureCacheMismatch, match="fingerprint"):
        open_or_build_feature_cache(examples, tiny_qwen2, tmp_path, [1], progress=False)
    with pytest.raises(FeatureCacheMismatch, match=shard_file(0)):
        build(examples, tiny_qwen2, tmp_path, layers=[1])


def test_incomplete_cache_is_not_opened(tiny_llama, tmp_path):
    with pytest.raises(FileNotFoundError, match="index.json not found"):
        FeatureCacheDataset(tmp_path, make_examples(), feature_meta(tiny_llama))


# ---- training config ----------------------------------------------------------------------


def test_run_builds_train_and_val_caches(tiny_llama, tmp_path, monkeypatch):
    from train.run import PreparedData, feature_datasets

    data = PreparedData(train=make_examples(), val=make_examples(seed=2)[:3])
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    cfg = OmegaConf.create(
        {
            "features": "disk",
            "feature_dtype": "int8",
            "feature_cache": None,
            "feature_autocast": None,
        }
    )
    train_set, val_set = feature_datasets(data, tiny_llama, [1], cfg)
    assert isinstance(train_set, FeatureCacheDataset) and len(val_set) == 3
    (root,) = (tmp_path / "features").iterdir()
    assert root.name.startswith(f"{tiny_llama.fingerprint[:12]}-1-int8-")
    assert sorted(p.name for p in root.iterdir()) == ["train", "val"]
    assert json.loads((root / "val" / "index.json").read_text())["num_examples"] == 3
    assert train_set[0]["aux"].dtype == torch.float16

    cfg.feature_cache = str(tmp_path / "mine")
    train_set, val_set = feature_datasets(PreparedData(data.train, []), tiny_llama, None, cfg)
    assert (tmp_path / "mine" / "train" / "index.json").exists()
    assert len(train_set) == 7 and len(val_set) == 0 and "aux" not in train_set[6]

    # features extracted under bf16 autocast: a folder of their own, recorded, close to fp32's
    cfg.feature_cache, cfg.feature_dtype = None, "float32"
    exact, _ = feature_datasets(data, tiny_llama, [1], cfg)
    cfg.feature_autocast = "bfloat16"
    cast, _ = feature_datasets(data, tiny_llama, [1], cfg)
    folders = sorted(p.name for p in (tmp_path / "features").iterdir())
    assert any("-1-float32+bfloat16-" in name for name in folders)
    assert any("-1-float32-" in name for name in folders)
    index = next((tmp_path / "features").glob("*float32+bfloat16*/train/index.json"))
    assert json.loads(index.read_text())["autocast"] == "bfloat16"
    a, b = exact[0]["hidden"], cast[0]["hidden"]
    assert not torch.equal(a, b)
    torch.testing.assert_close(b, a, rtol=0.1, atol=0.1)


# ---- values outside the dtype's range ------------------------------------------------------


def test_a_cache_refuses_features_past_float16s_range(tiny_llama, tmp_path):
    from data.errors import FeatureRangeError

    with torch.no_grad():  # activations of this size exist in real targets (massive activations)
        tiny_llama.model.model.embed_tokens.weight.mul_(1e5)
        tiny_llama.model.model.norm.weight.mul_(1e5)
    examples, layers = make_examples(), [0, 1]
    with pytest.raises(FeatureRangeError, match=r"shard 0: .*beyond float16's range.*bfloat16"):
        build(examples, tiny_llama, tmp_path / "f16", layers=layers, dtype="float16")
    assert not [n for n in os.listdir(tmp_path / "f16") if n.endswith(".safetensors")]
    build(examples, tiny_llama, tmp_path / "bf16", layers=layers, dtype="bfloat16")
    cache = FeatureCacheDataset(
        tmp_path / "bf16", examples, expected(tiny_llama, layers, "bfloat16")
    )
    hidden = torch.cat([cache[i]["hidden"] for i in range(len(cache))]).float()
    assert hidden.abs().max() > 65504 and bool(hidden.isfinite().all())
