"""data/features.py: target features computed once, batched = unbatched, lazily per example."""

from __future__ import annotations

import torch

from data import collate, compute_features
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
