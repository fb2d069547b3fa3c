"""Every touch of the transformers cache and forward API, in one place (tested on 5.24).

Facts this module relies on (checked by experiment on transformers 5.24, CPU):
- caches are `DynamicCache` objects; `DynamicCache(config=model.config)` builds one layer object per
  decoder layer (`DynamicLayer`, or `DynamicSlidingWindowLayer` for sliding-window layers), each
  holding `.keys` / `.values` of shape [batch, kv_heads, seq, head_dim];
- `cache.crop(n)` takes only n <= 0 and drops the last -n entries of every layer;
- the forward argument is `cache` since 5.24 (`past_key_values` still works but warns until 5.40);
  the cache object is updated in place, so the returned one is the one passed in;
- a 4-D `attention_mask` [batch, 1, q, past + q] is used as given. Eager attention *adds* it to
  the scores, so it must be an additive float mask (0 = attend, a large negative = masked): a bool
  mask there is silently wrong. sdpa accepts either; the float mask works for both;
- positions come only from `position_ids` (there is no `cache_position` argument any more);
- `output_hidden_states=True` returns num_layers + 1 states; the last is after the final norm.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache

TREE_ATTENTION = ("sdpa", "eager")  # implementations that honour a custom 4-D mask


def check_attention(model) -> None:
    """Refuse attention implementations that ignore a 4-D mask (e.g. flash attention)."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in TREE_ATTENTION:
        raise ValueError(
            f"tree verification needs attention that honours a 4-D mask ({TREE_ATTENTION}); the "
            f"target uses {impl!r}. Load it with attn_implementation='sdpa'."
        )


def context_limit(model) -> int:
    """Longest sequence the engine supports: max positions, capped by any sliding window."""
    config = model.config.get_text_config(decoder=True)
    limit = int(getattr(config, "max_position_embeddings", 1 << 30))
    if any("sliding" in t for t in getattr(config, "layer_types", None) or ()):
        # Past the window, the cache drops old entries and a custom mask no longer lines up.
        limit = min(limit, int(config.sliding_window) - 1)
    return limit


def make_cache(model) -> DynamicCache:
    return DynamicCache(config=model.config)


def cache_length(cache: DynamicCache) -> int:
    """Number of tokens whose keys/values are cached."""
    return int(cache.get_seq_length())


def _cache_kwarg(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@dataclass(frozen=True)
class ForwardOutput:
    """logits [q, V] float32; hidden [q, H] after the final norm; aux [q, len(layers) * H] the
    HF hidden_states[i] for i in `layers`, concatenated (None when no layers were asked for)."""

    logits: Tensor
    hidden: Tensor
    aux: Tensor | None = None


def forward_features(
    model,
    cache: DynamicCache,
    input_ids: Tensor,
    position_ids: Tensor | None = None,
    attention_mask: Tensor | None = None,
    layers: Sequence[int] | None = None,
) -> ForwardOutput:
    """Run the unmodified HF forward on top of `cache` (updated in place); input_ids [1, q]."""
    out = model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        use_cache=True,
        output_hidden_states=True,
        **{_cache_kwarg(model): cache},
    )
    states = out.hidden_states
    aux = torch.cat([states[i][0] for i in layers], dim=-1) if layers else None
    return ForwardOutput(out.logits[0].float(), states[-1][0], aux)


def forward(
    model,
    cache: DynamicCache,
    input_ids: Tensor,
    position_ids: Tensor | None = None,
    attention_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """input_ids [1, q] -> (logits [q, V] float32, hidden [q, H]); see `forward_features`."""
    out = forward_features(model, cache, input_ids, position_ids, attention_mask)
    return out.logits, out.hidden


def tree_attention_mask(tree_mask: Tensor, prefix_len: int, dtype: torch.dtype) -> Tensor:
    """Additive mask [1, 1, N, prefix_len + N]: the whole prefix, then each node's ancestors."""
    n = tree_mask.shape[0]
    allowed = torch.ones(n, prefix_len + n, dtype=torch.bool, device=tree_mask.device)
    allowed[:, prefix_len:] = tree_mask
    mask = torch.zeros(allowed.shape, dtype=dtype, device=tree_mask.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def tree_forward_features(
    model,
    cache: DynamicCache,
    tokens: Tensor,
    depth: Tensor,
    tree_mask: Tensor,
    layers: Sequence[int] | None = None,
) -> ForwardOutput:
    """Verify a whole tree in one forward: tokens [N], depth [N], tree_mask [N, N] bool.

    Node i sits at position prefix_len + depth[i] and sees the prefix plus its ancestors. The N
    new entries are appended to the cache; `keep_path` then keeps the accepted ones.
    """
    prefix_len = cache_length(cache)
    mask = tree_attention_mask(tree_mask, prefix_len, model.dtype)
    position_ids = (prefix_len + depth)[None]
    return forward_features(model, cache, tokens[None], position_ids, mask, layers)


def tree_forward(
    model, cache: DynamicCache, tokens: Tensor, depth: Tensor, tree_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """`tree_forward_features` without aux: (logits [N, V] float32, hidden [N, H])."""
    out = tree_forward_features(model, cache, tokens, depth, tree_mask)
    return out.logits, out.hidden


def keep_path(cache: DynamicCache, prefix_len: int, kept_indices: Tensor | list[int]) -> None:
    """Keep only the accepted tree nodes' entries, right after the prefix (gather, then crop).

    The cache holds prefix_len + N entries after a tree forward; node i is at slot prefix_len + i.
    Afterwards it holds prefix_len + len(kept_indices) entries, the kept nodes in the given order.
    No recomputation: the kept keys/values are exactly those the tree forward produced, which are
    what a plain forward on the accepted sequence computes (same positions, same visible tokens).
    """
    kept = torch.as_tensor(kept_indices, dtype=torch.long)
    total = cache_length(cache)
    k = kept.numel()
    if k == 0 or int(kept.min()) < 0 or prefix_len + int(kept.max()) >= total:
        raise ValueError(f"kept node indices {kept.tolist()} do not fit a cache of {total}")
    contiguous = bool((kept == torch.arange(k)).all())
    if not contiguous:
        for layer in cache.layers:
            if layer.keys is None or layer.keys.numel() == 0:
                continue  # layers that share another layer's cache hold nothing
            if layer.keys.shape[-2] != total:
                raise NotImplementedError(
                    "a cache layer holds fewer entries than the sequence (sliding window "
                    "reached); keep the context below the window "
                    "(eval.engine.kv_cache.context_limit)."
                )
            src = (prefix_len + kept).to(layer.keys.device)
            layer.keys[..., prefix_len : prefix_len + k, :] = layer.keys[..., src, :]
            layer.values[..., prefix_len : prefix_len + k, :] = layer.values[..., src, :]
    crop_to(cache, prefix_len + k)


def crop_to(cache: DynamicCache, length: int) -> None:
    """Drop cache entries so that `length` remain."""
    excess = cache_length(cache) - length
    if excess < 0:
        raise ValueError(f"cannot crop a cache of {cache_length(cache)} up to {length}")
    if excess:
        cache.crop(-excess)
