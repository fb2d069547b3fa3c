"""KV-cache surgery and tree forwards against from-scratch recomputation (tiny Llama and Qwen2)."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import make_llama, make_qwen2

from eval.engine import kv_cache
from eval.engine.tree import build_tree

PATHS = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [1, 0, 0]]


@pytest.fixture(params=["llama-sdpa", "llama-eager", "qwen2-sdpa"])
def model(request):
    name, attn = request.param.split("-")
    m = make_llama(hidden=32) if name == "llama" else make_qwen2(hidden=32)
    m.set_attn_implementation(attn)
    return m


def prefill(model, ids):
    cache = kv_cache.make_cache(model)
    logits, hidden = kv_cache.forward(model, cache, ids)
    return cache, logits, hidden


def tree_tokens(num_nodes, vocab, seed=1):
    return torch.randint(4, vocab, (num_nodes,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_forward_uses_installed_cache_argument_without_warnings(model):
    ids = torch.randint(4, 256, (1, 7))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache, logits, hidden = prefill(model, ids)
    assert kv_cache.cache_length(cache) == 7
    assert logits.shape == (7, 256) and hidden.shape == (7, 32)
    assert torch.allclose(model.lm_head(hidden).float(), logits, atol=1e-5)  # after final norm


@torch.no_grad()
def test_tree_forward_matches_each_path_from_scratch(model):
    torch.manual_seed(0)
    prefix = torch.randint(4, 256, (1, 6))
    tree = build_tree(PATHS)
    tokens = tree_tokens(tree.num_nodes, 256)
    cache, _, _ = prefill(model, prefix)
    logits, hidden = kv_cache.tree_forward(model, cache, tokens, tree.depth, tree.attn_mask)
    assert kv_cache.cache_length(cache) == 6 + tree.num_nodes
    for i in range(tree.num_nodes):
        path = tree.attn_mask[i].nonzero().flatten()  # ancestors, root first
        seq = torch.cat([prefix[0], tokens[path]])[None]
        ref = model(input_ids=seq).logits[0, -1].float()
        assert torch.allclose(logits[i], ref, atol=1e-5), f"node {i}"


@torch.no_grad()
@pytest.mark.parametrize("kept", [[0], [0, 1, 4, 7], [0, 2, 6, 8], [0, 3]])
def test_keep_path_equals_recomputed_cache(model, kept):
    torch.manual_seed(0)
    prefix = torch.randint(4, 256, (1, 5))
    tree = build_tree(PATHS)
    tokens = tree_tokens(tree.num_nodes, 256)
    cache, _, _ = prefill(model, prefix)
    kv_cache.tree_forward(model, cache, tokens, tree.depth, tree.attn_mask)
    kv_cache.keep_path(cache, 5, kept)
    ref, _, _ = prefill(model, torch.cat([prefix[0], tokens[kept]])[None])
    assert kv_cache.cache_length(cache) == 5 + len(kept)
    for got, want in zip(cache.layers, ref.layers):
        assert got.keys.shape == want.keys.shape
        assert torch.allclose(got.keys, want.keys, atol=1e-5)
        assert torch.allclose(got.values, want.values, atol=1e-5)
    # decoding continues correctly on the surgically edited cache
    nxt = torch.tensor([[7]])
    logits, _ = kv_cache.forward(model, cache, nxt)
    ref_logits, _ = kv_cache.forward(model, ref, nxt)
    assert torch.allclose(logits, ref_logits, atol=1e-5)


@torch.no_grad()
def test_keep_path_and_crop_validate():
    model = make_llama(hidden=32)
    cache, _, _ = prefill(model, torch.randint(4, 256, (1, 4)))
    with pytest.raises(ValueError, match="do not fit"):
        kv_cache.keep_path(cache, 2, [0, 5])
    with pytest.raises(ValueError, match="cannot crop"):
        kv_cache.crop_to(cache, 9)
    kv_cache.crop_to(cache, 3)
    assert kv_cache.cache_length(cache) == 3


def test_tree_attention_mask_layout():
    tree = build_tree([[0], [1], [0, 0]])
    mask = kv_cache.tree_attention_mask(tree.attn_mask, 3, torch.float32)
    assert mask.shape == (1, 1, 4, 7)
    allowed = mask[0, 0] == 0
    assert allowed[:, :3].all()  # the whole prefix is visible
    assert allowed[:, 3:].equal(tree.attn_mask)
    assert (mask[0, 0][~allowed] == torch.finfo(torch.float32).min).all()


def test_attention_and_context_checks():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    model = make_llama(hidden=32)
    assert kv_cache.context_limit(model) == 512
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="sdpa"):
        kv_cache.check_attention(model)
    cfg = Gemma3TextConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=64,
        sliding_window=40,
    )
    assert kv_cache.context_limit(Gemma3ForCausalLM(cfg)) == 39
