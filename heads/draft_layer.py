"""The decoder layer an EAGLE draft runs, and the key/value cache it drafts with.

Llama-style whatever the target family: RMSNorm, grouped-query attention with rotary positions,
SwiGLU MLP, no biases. Sizes and the rotary settings come from the target's HF config, so the
draft's attention sees positions the way the target's does (rope_theta, rope_scaling / llama3
scaling, head_dim). The rotary tables come from transformers' own rotary embedding class (built
on a LlamaConfig carrying the target's rope parameters); nothing else is taken from HF modelling
code. Parameter names match Llama's (`self_attn.q_proj`, `mlp.gate_proj`, ...) so that export to
serving engines is a prefix rename.

Two inputs feed the layer (see `DraftDecoderLayer.forward`):
- EAGLE-1: `hidden` = fc([embed(x_{t+1}); f_t]); q/k/v read input_layernorm(hidden) (H wide),
  or `hidden` itself when the layer is built with `input_norm=False`.
- EAGLE-3: `hidden` = the fused feature h_t and `embeds` = embed(x_{t+1}); q/k/v read
  [input_layernorm(embeds); hidden_norm(hidden)] (2H wide). The residual stream is `hidden`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class LayerSpec:
    """The draft layer's geometry, read from the target's HF config."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default"})

    @classmethod
    def from_hf_config(cls, cfg) -> LayerSpec:
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        heads = int(cfg.num_attention_heads)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        if not rope:  # transformers < 5 kept these as top-level attributes
            rope = dict(getattr(cfg, "rope_scaling", None) or {})
        per_type = {k: v for k, v in rope.items() if isinstance(v, dict)}
        if per_type:  # one entry per attention type (Gemma-3: sliding and full attention)
            rope = dict(per_type.get("full_attention") or next(iter(per_type.values())))
        theta = getattr(cfg, "rope_theta", None) or getattr(cfg, "default_theta", None)
        if isinstance(theta, dict):
            theta = theta.get("full_attention") or next(iter(theta.values()), None)
        rope.setdefault("rope_theta", float(theta or 10000.0))
        rope.setdefault("rope_type", rope.pop("type", "default"))
        return cls(
            hidden_size=int(cfg.hidden_size),
            num_heads=heads,
            num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            intermediate_size=int(cfg.intermediate_size),
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
            max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 2048)),
            rope_parameters=rope,
        )


class DraftCache:
    """Keys and values of the draft's first layer, `[B, kv_heads, S, head_dim]` each; a draft
    with more layers keeps theirs in `layer(i)`, which every layer's rows enter in the same order.

    `append` adds the q new rows and returns the whole cache; `crop(n)` keeps the first n
    entries; `gather(index)` keeps the entries at `index` (`[S']` or `[B, S']`), in that order,
    e.g. the prefix plus an accepted tree path. Both apply to every layer's cache alike, so the
    callers that roll a draft back need not know how many layers it has.
    """

    def __init__(self) -> None:
        self.keys: Tensor | None = None
        self.values: Tensor | None = None
        self.deeper: list[DraftCache] = []  # layers 1, 2, ... (made on first use)

    def layer(self, index: int) -> DraftCache:
        """The cache of draft layer `index`: this one for 0."""
        if index == 0:
            return self
        while len(self.deeper) < index:
            self.deeper.append(DraftCache())
        return self.deeper[index - 1]

    @property
    def length(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[2])

    def append(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)
        return self.keys, self.values

    def crop(self, length: int) -> None:
        if length < 0:
            raise ValueError(f"crop({length}): give the number of entries to keep (>= 0).")
        if self.keys is not None:
            self.keys = self.keys[:, :, :length]
            self.values = self.values[:, :, :length]
        for cache in self.deeper:
            cache.crop(length)

    def gather(self, index: Tensor) -> None:
        for cache in self.deeper:
            cache.gather(index)
        if self.keys is None:
            return
        index = index.to(self.keys.device, torch.long)
        if index.dim() == 1:
            self.keys, self.values = self.keys[:, :, index], self.values[:, :, index]
            return
        B, K, _, D = self.keys.shape
        idx = index[:, None, :, None].expand(B, K, index.shape[1], D)
        self.keys = torch.gather(self.keys, 2, idx)
        self.values = torch.gather(self.values, 2, idx)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 (as Llama does)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary_embedding(spec: LayerSpec) -> nn.Module:
    """transformers' Llama rotary embedding for the target's rope settings: (x, pos) -> cos, sin."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(
        hidden_size=spec.num_heads * spec.head_dim,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters=dict(spec.rope_parameters),
    )
    return LlamaRotaryEmbedding(cfg)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def causal_mask(q: int, past: int, device=None) -> Tensor:
    """`[q, past + q]` bool: new row i sees every cached entry and new rows 0..i."""
    cols = torch.arange(past + q, device=device)
    rows = torch.arange(q, device=device) + past
    return cols[None, :] <= rows[:, None]


class DraftAttention(nn.Module):
    """Grouped-query attention over the DraftCache plus the new rows (torch sdpa, bool mask)."""

    def __init__(self, spec: LayerSpec, input_size: int):
        super().__init__()
        self.spec = spec
        nh, kv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        if nh % kv:
            raise ValueError(f"num_attention_heads={nh} is not a multiple of kv heads={kv}")
        self.q_proj = nn.Linear(input_size, nh * d, bias=False)
        self.k_proj = nn.Linear(input_size, kv * d, bias=False)
        self.v_proj = nn.Linear(input_size, kv * d, bias=False)
        self.o_proj = nn.Linear(nh * d, spec.hidden_size, bias=False)
        self.rotary = rotary_embedding(spec)

    def forward(
        self, x: Tensor, position_ids: Tensor, cache: DraftCache, attn_mask: Tensor | None
    ) -> Tensor:
        B, q, _ = x.shape  # x: (B, q, input_size)
        d = self.spec.head_dim
        qs = self.q_proj(x).view(B, q, -1, d).transpose(1, 2)  # (B, nh, q, d)
        ks = self.k_proj(x).view(B, q, -1, d).transpose(1, 2)  # (B, kv, q, d)
        vs = self.v_proj(x).view(B, q, -1, d).transpose(1, 2)
        cos, sin = self.rotary(vs, position_ids)  # (B, q, d)
        cos, sin = cos[:, None], sin[:, None]
        qs = qs * cos + _rotate_half(qs) * sin
        ks = ks * cos + _rotate_half(ks) * sin
        past = cache.length
        keys, values = cache.append(ks, vs)  # (B, kv, past + q, d)
        if attn_mask is None:
            attn_mask = causal_mask(q, past, x.device)[None, None]
        elif attn_mask.dtype != torch.bool or tuple(attn_mask.shape[-2:]) != (q, past + q):
            raise ValueError(
                f"attn_mask must be bool (True = may attend) and end in (q, past + q) = "
                f"{(q, past + q)}; got {attn_mask.dtype} {tuple(attn_mask.shape)}"
            )
        out = F.scaled_dot_product_attention(
            qs, keys, values, attn_mask=attn_mask, enable_gqa=True
        )  # (B, nh, q, d)
        return self.o_proj(out.transpose(1, 2).reshape(B, q, -1))


class DraftMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftDecoderLayer(nn.Module):
    """Pre-norm decoder layer; `fused_input=True` is EAGLE-3's 2H-wide q/k/v input.

    `input_norm=False` replaces input_layernorm by the identity (original EAGLE-1, whose
    checkpoints have no such weight and which vLLM / SGLang load with an identity there).
    """

    def __init__(self, spec: LayerSpec, fused_input: bool = False, input_norm: bool = True):
        super().__init__()
        H = spec.hidden_size
        if fused_input and not input_norm:
            raise ValueError("EAGLE-3's fused input always normalises the token embeddings")
        self.input_layernorm = RMSNorm(H, spec.rms_norm_eps) if input_norm else nn.Identity()
        self.hidden_norm = RMSNorm(H, spec.rms_norm_eps) if fused_input else None
        self.self_attn = DraftAttention(spec, 2 * H if fused_input else H)
        self.post_attention_layernorm = RMSNorm(H, spec.rms_norm_eps)
        self.mlp = DraftMLP(H, spec.intermediate_size)

    def forward(
        self,
        hidden: Tensor,
        position_ids: Tensor,
        cache: DraftCache,
        attn_mask: Tensor | None = None,
        embeds: Tensor | None = None,
    ) -> Tensor:
        """(B, q, H) -> (B, q, H); `embeds` (B, q, H) only with `fused_input`."""
        if self.hidden_norm is None:
            x = self.input_layernorm(hidden)
        else:
            if embeds is None:
                raise ValueError("a fused-input (EAGLE-3) layer needs the token embeddings")
            x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        hidden = hidden + self.self_attn(x, position_ids, cache, attn_mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))
