"""data/features.py: target features computed once, batched = unbatched, saved and reloaded."""

from __future__ import annotations

import os

import pytest
import torch

from data import (
    FeatureCacheMismatch,
    collate,
    compute_features,
    feature_meta,
    load_feature_file,
    read_feature_meta,
    save_feature_file,
)
from data.features import length_batches


def make_examples(lengths=(7, 3, 12, 5, 9), vocab=256, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(4, vocab, (n,), generator=gen),
            "loss_mask": (torch.arange(n) >= n // 2).long(),
        }
        for n in lengths
    ]


def test_length_batches_respect_the_token_budget():
    lengths = [7, 3, 12, 5, 9, 40]
    batches = length_batches(lengths, batch_tokens=20)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert batches[0] == [5]  # longer than the budget: alone
    for batch in batches[1:]:
        assert max(lengths[i] for i in batch) * len(batch) <= 20


def test_features_batched_equal_unbatched(tiny_llama):
    examples = make_examples()
    layers = [0, 1]
    out = compute_features(
        examples, tiny_llama, layers=layers, batch_tokens=24, dtype=torch.float32, progress=False
    )
    assert len(out) == len(examples)
    hidden_size = tiny_llama.hidden_size
    for example, result in zip(examples, out, strict=True):
        assert result["input_ids"] is example["input_ids"]  # the input list is not modified
        assert "hidden" not in example
        ids = example["input_ids"][None]
        ref = tiny_llama.features(ids, torch.ones_like(ids), layers)
        length = len(example["input_ids"])
        assert result["hidden"].shape == (length, hidden_size)
        assert result["aux"].shape == (length, len(layers) * hidden_size)
        torch.testing.assert_close(result["hidden"], ref["hidden"][0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(result["aux"], ref["aux"][0], atol=1e-5, rtol=1e-4)


def test_features_dtype_and_collate(tiny_llama):
    out = compute_features(make_examples(), tiny_llama, progress=False)
    assert all(e["hidden"].dtype == torch.float16 and "aux" not in e for e in out)
    batch = collate(out)
    assert batch["hidden"].shape == (5, 12, tiny_llama.hidden_size)
    assert batch["hidden"][1, 3:].abs().sum() == 0  # the 3-token example is zero-padded


def test_save_load_round_trip(tiny_llama, tmp_path):
    examples = compute_features(make_examples(), tiny_llama, layers=[1], progress=False)
    meta = feature_meta(tiny_llama, layers=[1])
    path = str(tmp_path / "cache" / "features.safetensors")
    save_feature_file(examples, path, meta)
    assert os.listdir(tmp_path / "cache") == ["features.safetensors"]  # no tmp file left
    stored = read_feature_meta(path)
    assert stored["fingerprint"] == tiny_llama.fingerprint and stored["layers"] == [1]
    assert stored["num_examples"] == 5 and stored["num_tokens"] == 36
    assert stored["dtype"] == "torch.float16"

    loaded = load_feature_file(path, expected_meta=meta)
    assert len(loaded) == len(examples)
    for a, b in zip(examples, loaded, strict=True):
        assert set(a) == set(b) == {"input_ids", "loss_mask", "hidden", "aux"}
        for key in a:
            assert torch.equal(a[key], b[key]) and a[key].dtype == b[key].dtype


def test_load_refuses_another_target_or_layers(tiny_llama, tmp_path):
    examples = compute_features(make_examples(lengths=(4, 6)), tiny_llama, progress=False)
    path = str(tmp_path / "f.safetensors")
    save_feature_file(examples, path, feature_meta(tiny_llama))

    other = {"fingerprint": "0123456789abcdef", "layers": None}
    with pytest.raises(FeatureCacheMismatch) as err:
        load_feature_file(path, expected_meta=other)
    message = str(err.value)
    assert tiny_llama.fingerprint in message and "0123456789abcdef" in message
    assert path in message and "delete the file" in message

    with pytest.raises(FeatureCacheMismatch, match=r"layers=None .* layers=\[1, 2\]"):
        load_feature_file(path, expected_meta=feature_meta(tiny_llama, layers=[1, 2]))
    assert len(load_feature_file(path, expected_meta=feature_meta(tiny_llama))) == 2


def test_lazy_features_match_batched_and_are_computed_once(tiny_llama):
    from data.features import LazyFeatureDataset

    g = torch.Generator().manual_seed(1)
    examples = [
        {"input_ids": torch.randint(4, 200, (n,), generator=g), "loss_mask": torch.ones(n).long()}
        for n in (5, 9, 7)
    ]
    calls = []
    original = tiny_llama.features

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    tiny_llama.features = counting
    lazy = LazyFeatureDataset(examples, tiny_llama, layers=[1], dtype=torch.float32)
    eager = compute_features(examples, tiny_llama, layers=[1], dtype=torch.float32, progress=False)
    calls.clear()
    for _ in range(3):  # three "epochs"
        for i in range(len(lazy)):
            item = lazy[i]
            assert torch.allclose(item["hidden"], eager[i]["hidden"], atol=1e-5)
            assert torch.allclose(item["aux"], eager[i]["aux"], atol=1e-5)
    assert len(calls) == len(examples) and lazy.num_cached == len(examples)
    assert "hidden" not in examples[0]  # the source examples are not modified
