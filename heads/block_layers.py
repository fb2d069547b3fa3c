"""The draft layers of the block drafters (DFlash, heads/dflash.py, and DSpark): Qwen3-style
pre-norm decoder layers whose queries come from the block and whose keys/values are [context;
block], with the committed context's keys/values kept per layer while drafting."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from heads.draft_layer import (
    DraftCache,
    DraftMLP,
    LayerSpec,
    RMSNorm,
    _rotate_half,
    rotary_embedding,
)


class BlockAttention(nn.Module):
    """Grouped-query attention of a block over [context; block]; Qwen3's per-head q/k norms."""

    def __init__(self, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        H, nh, kv, d = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
        if nh % kv:
            raise ValueError(f"num_attention_heads={nh} is not a multiple of kv heads={kv}")
        self.q_proj = nn.Linear(H, nh * d, bias=False)
        self.k_proj = nn.Linear(H, kv * d, bias=False)
        self.v_proj = nn.Linear(H, kv * d, bias=False)
        self.o_proj = nn.Linear(nh * d, H, bias=False)
        self.q_norm = RMSNorm(d, spec.rms_norm_eps)
        self.k_norm = RMSNorm(d, spec.rms_norm_eps)
        self.rotary = rotary_embedding(spec)

    def _rope(self, x: Tensor, position_ids: Tensor) -> Tensor:
        cos, sin = self.rotary(x, position_ids)  # (B, S, d)
        cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
        return x * cos + _rotate_half(x) * sin

    def keys_values(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """(B, S, H) rows at `position_ids` (B, S) -> keys, values (B, kv, S, d)."""
        B, S, _ = x.shape
        d = self.spec.head_dim
        keys = self.k_norm(self.k_proj(x).view(B, S, -1, d)).transpose(1, 2)
        values = self.v_proj(x).view(B, S, -1, d).transpose(1, 2)
        return self._rope(keys, position_ids), values

    def forward(
        self,
        x: Tensor,
        position_ids: Tensor,
        context: tuple[Tensor, Tensor],
        attn_mask: Tensor | None,
    ) -> Tensor:
        """x (B, Q, H): the normed block rows; context: keys/values (B, kv, C, d) of the context;
        attn_mask: bool (B or 1, 1, Q, C + Q) or None (every row sees everything)."""
        B, Q, _ = x.shape
        d = self.spec.head_dim
        queries = self.q_norm(self.q_proj(x).view(B, Q, -1, d)).transpose(1, 2)
        queries = self._rope(queries, position_ids)
        keys, values = self.keys_values(x, position_ids)
        keys = torch.cat([context[0].to(keys.dtype), keys], dim=2)
        values = torch.cat([context[1].to(values.dtype), values], dim=2)
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=attn_mask, enable_gqa=True
        )  # (B, nh, Q, d)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, -1))


class BlockLayer(nn.Module):
    """Pre-norm decoder layer whose attention also reads the context keys/values."""

    def __init__(self, spec: LayerSpec, intermediate_size: int):
        super().__init__()
        H = spec.hidden_size
        self.input_layernorm = RMSNorm(H, spec.rms_norm_eps)
        self.self_attn = BlockAttention(spec)
        self.post_attention_layernorm = RMSNorm(H, spec.rms_norm_eps)
        self.mlp = DraftMLP(H, intermediate_size)

    def forward(
        self,
        hidden: Tensor,
        position_ids: Tensor,
        context: tuple[Tensor, Tensor],
        attn_mask: Tensor | None = None,
    ) -> Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), position_ids, context, attn_mask)
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class BlockCache:
    """The committed context's keys/values, one DraftCache per draft layer."""

    def __init__(self, num_layers: int) -> None:
        self.layers = [DraftCache() for _ in range(num_layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length

    def crop(self, length: int) -> None:
        for layer in self.layers:
            layer.crop(length)


__all__ = ["BlockAttention", "BlockCache", "BlockLayer"]
