"""DFlash block drafter (z-lab, Chen et al., 2026, "DFlash: Block Diffusion for Flash Speculative
Decoding"): a few draft layers propose a whole block of tokens in one forward.

The draft reads target features and a block, and writes the block's tokens:
- Context. k target layers (`target_layer_ids`, in the reference's convention: id i is the output
  of decoder layer i, HF `hidden_states[i + 1]`) are concatenated per position and fused,
  c_t = hidden_norm(fc([h^(i1)_t; ...; h^(ik)_t])) (kH -> H, no bias). Every draft layer projects
  c_t with its own k_proj / v_proj (then k_norm and RoPE at position t) into extra keys/values:
  the target's context enters the draft only through attention.
- Block. [anchor, MASK x (B-1)] at positions a .. a+B-1, where the anchor x_a is the last token
  the target committed (not yet run through it) and the context holds the features of every
  position < a. Input embeddings are the target's frozen ones; MASK is a learned vector
  (`learn_mask`, initialised from the embedding of `mask_token_id`) or that token's embedding.
- Layers. Qwen3-style pre-norm decoder layers sized from the target (per-head q_norm / k_norm,
  RoPE with the target's settings, SwiGLU MLP, no biases). Queries come from the block only;
  keys/values are [context; block], and attention inside the block is bidirectional.
- Output. Final norm, then the target's frozen lm_head (or a trained reduced-vocabulary head,
  `draft_vocab_size`, with d2t/t2d as EAGLE-3). Slot k (1 <= k < B) scores x_{a+k}; slot 0 is the
  anchor itself and is never scored.

Training (`loss`) samples up to `num_anchors` anchors per row where slot 1 has a label and runs all
their blocks in one forward: block j's queries see the context positions before its anchor (in its
own conversation, for packed rows) and its own block. Training input therefore equals inference
input, and no training-time test is needed. Labels are in place: slot k of the block at anchor a
predicts x_{a+k}, with weight exp(-(k-1)/gamma), against the data's token (`loss: ce`) or the
target's distribution there (`loss: kd`).

Drafting (eval/block_proposer.py) keeps, per draft layer, the keys/values of the committed context
(`new_cache`, `extend_cache`); a step appends the positions the target just committed and runs the
block against them (`draft_block`). Block keys are never stored, so only committed positions
survive a step.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from heads.base import (
    BlockDrafter,
    LossOutput,
    TargetInfo,
    batch_positions,
    label_mask,
    stat_pair,
    warm_start,
)
from heads.base import save_head as _save_head
from heads.draft_layer import (
    DraftCache,
    DraftMLP,
    LayerSpec,
    RMSNorm,
    _rotate_half,
    rotary_embedding,
)
from heads.eagle import check_shapes
from heads.folder import load_head_tensors, load_weights, open_head, saved_tensor
from heads.vocab import d2t_t2d, draft_to_target, frequent_ids, saved_draft_ids, target_to_draft

LOSSES = ("ce", "kd")
WEIGHTINGS = ("decay", "dpace")


@dataclass
class DFlashConfig:
    num_layers: int = 2  # draft decoder layers
    block_size: int = 8  # B: the anchor plus B-1 drafted tokens per forward
    # Target layers fused into the context, in the reference's convention (id i = HF
    # hidden_states[i + 1]); null: one per draft layer, spread from layer 1 to N-3.
    target_layer_ids: list[int] | None = None
    # The token whose embedding stands for MASK (and that exports name); null: a special token of
    # the target's tokenizer that its chat template never writes.
    mask_token_id: int | None = None
    learn_mask: bool = True  # train the MASK vector (exported as llama.cpp's mask_embedding.pt)
    draft_vocab_size: int | None = None  # null: the target's full vocabulary and frozen lm_head
    intermediate_size: int | None = None  # null: the target's MLP width
    # Start the draft layers as copies of the target's layers right after the deepest fused one
    # (fc then selects that layer's features): attention is then meaningful from step one, which
    # matters when the training data is small (see `init_from_target_layers`).
    init_from_target: bool = False
    num_anchors: int = 64  # blocks trained per row and step
    loss: str = "ce"  # "ce": the data's tokens; "kd": the target's distributions
    gamma: float | None = None  # slot k's loss weight exp(-(k-1)/gamma); null: by block size
    # "decay": the exp(-(k-1)/gamma) weights; "dpace": D-PACE weights (what a slot's error costs
    # the rest of the chain, from the draft's own chances; dpace_alpha smooths them)
    weighting: str = "decay"
    dpace_alpha: float = 0.5
    topk: int = 5

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"head.num_layers={self.num_layers}: use at least one draft layer.")
        if self.block_size < 2:
            raise ValueError(
                f"head.block_size={self.block_size}: a block is the anchor plus at least one "
                "drafted token (2 or more)."
            )
        if self.target_layer_ids is not None:
            self.target_layer_ids = [int(i) for i in self.target_layer_ids]
            if not self.target_layer_ids:
                raise ValueError("head.target_layer_ids is empty: give layer ids, or null.")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError("head.draft_vocab_size must be positive, or null for the full vocab.")
        if self.num_anchors < 1:
            raise ValueError(f"head.num_anchors={self.num_anchors}: use 1 or more.")
        if self.loss not in LOSSES:
            raise ValueError(f"head.loss={self.loss!r}: use one of {', '.join(LOSSES)}.")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(
                f"head.weighting={self.weighting!r}: use one of {', '.join(WEIGHTINGS)}."
            )
        if not 0 <= self.dpace_alpha <= 1:
            raise ValueError(f"head.dpace_alpha={self.dpace_alpha}: use a value in [0, 1].")
        if self.gamma is not None and self.gamma <= 0:
            raise ValueError(f"head.gamma={self.gamma}: use a positive decay, or null.")
        if self.topk < 1:
            raise ValueError(f"head.topk={self.topk}: use 1 or more.")

    @property
    def decay(self) -> float:
        """gamma: the DFlash paper's 7 / 5 / 4 for blocks of 16 / 10 / 8, else B / 2."""
        if self.gamma is not None:
            return float(self.gamma)
        return {16: 7.0, 10: 5.0, 8: 4.0}.get(self.block_size, self.block_size / 2)


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """One target layer per draft layer, evenly from layer 1 to N-3 (the middle one for a single
    draft layer), rounded, in the reference's convention; clamped into [0, N-2] so that every id
    names a residual-stream state (HF index id + 1 <= N - 1) on small targets too."""
    N = num_target_layers
    if N < 2:
        raise ValueError(f"a DFlash draft needs a target with 2 or more layers (it has {N}).")
    if num_draft_layers == 1:
        ids = [N // 2]
    else:
        start, end = 1, N - 3
        span = end - start
        ids = [
            int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)
        ]
    return [min(max(i, 0), N - 2) for i in ids]


def default_mask_token(tokenizer) -> int | None:
    """A special token the chat template never writes (SmolLM2: none of its rows is spare, but
    StarCoder's code-metadata tokens such as <filename> never occur in chat): the highest-id
    additional special token that is not BOS/EOS/PAD/UNK and does not appear in a rendered
    two-turn conversation. None when there is none."""
    if tokenizer is None:
        return None
    reserved = {
        getattr(tokenizer, name, None)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    }
    specials = set(getattr(tokenizer, "all_special_ids", []) or [])
    # tokens the tokenizer marks special without naming them a role (SmolLM2's StarCoder
    # metadata tokens <filename>, <empty_output>, ... are not in all_special_ids)
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    specials |= {int(i) for i, token in added.items() if getattr(token, "special", False)}
    specials = sorted(specials - reserved, reverse=True)
    if not specials:
        return None
    used: set[int] = set()
    if getattr(tokenizer, "chat_template", None):
        messages = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "v"},
        ]
        try:
            used = set(
                tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            )
        except Exception:  # a template that refuses a system turn: try without it
            try:
                used = set(
                    tokenizer.apply_chat_template(
                        messages[1:], add_generation_prompt=True, tokenize=True
                    )
                )
            except Exception:
                used = set()
        if isinstance(used, set) and used and not isinstance(next(iter(used)), int):
            used = set()  # a BatchEncoding-like answer: treat as unknown
    for token in specials:
        if token not in used:
            return int(token)
    return None


# ---- the draft layers ------------------------------------------------------------------------


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


def block_attention_mask(
    anchors: Tensor, length: int, block_size: int, segments: Tensor | None = None
) -> Tensor:
    """Which keys each block row may see in training: (B, 1, N*B, T + N*B) bool.

    anchors (B, N): the anchor positions (row indices) of N blocks per row; keys are the T context
    positions then the N blocks. A row of block j sees context positions p < anchors[j] (of the
    anchor's own conversation where `segments` (B, T) marks packed rows) and every row of block j.
    """
    Bt, N = anchors.shape
    device = anchors.device
    p = torch.arange(length, device=device)
    ctx = p[None, None, :] < anchors[:, :, None]  # (Bt, N, T)
    if segments is not None:
        own = torch.gather(segments, 1, anchors)  # (Bt, N)
        ctx = ctx & (segments[:, None, :] == own[:, :, None])
    ctx = ctx[:, :, None, :].expand(Bt, N, block_size, length).reshape(Bt, N * block_size, length)
    block = torch.arange(N, device=device).repeat_interleave(block_size)
    same = (block[:, None] == block[None, :])[None].expand(Bt, -1, -1)
    return torch.cat([ctx, same], dim=-1)[:, None]


def slot_stats(
    per_slot: Tensor, logits: Tensor, want: Tensor, ok: Tensor, topk: int, first_slot: int
) -> dict[str, Tensor]:
    """Per-slot loss, top-1 and top-k accuracy (`slot{i}/...`, i counted from `first_slot`), and
    the first drafted token's as `head0/...` (the same quantity as Medusa's head 0). logits (n,
    D) and want (n,) are the `ok` slots in order."""
    device = per_slot.device
    k = min(topk, logits.shape[-1])
    hit1 = torch.zeros(ok.shape, device=device)
    hitk = torch.zeros(ok.shape, device=device)
    if logits.shape[0]:
        top = logits.detach().topk(k, dim=-1).indices == want[:, None]
        hit1[ok] = top[:, 0].float()
        hitk[ok] = top.any(-1).float()
    stats: dict[str, Tensor] = {}
    for i in range(ok.shape[-1]):
        n = int(ok[..., i].sum())
        name = f"slot{i + first_slot}"
        stats[f"{name}/loss"] = stat_pair(per_slot[..., i].detach().sum(), n, device)
        stats[f"{name}/top1"] = stat_pair(hit1[..., i].sum(), n, device)
        stats[f"{name}/top{k}"] = stat_pair(hitk[..., i].sum(), n, device)
    stats["head0/top1"] = stats[f"slot{first_slot}/top1"]
    stats[f"head0/top{k}"] = stats[f"slot{first_slot}/top{k}"]
    return stats


# ---- the head --------------------------------------------------------------------------------


class DFlashHead(nn.Module):
    """DFlash: fused target context, a few block-attention layers, norm + (target) lm_head."""

    method = "dflash"
    config_class = DFlashConfig
    title = "DFlash block drafter"
    hub_tag = "dflash"
    # z-lab's layout (vLLM, SGLang, llama.cpp's converter; GGUF through it) and speculators'
    export_formats = ("native", "dflash", "speculators")
    export_note = ""
    drafting = BlockDrafter
    uses_target_features = True
    adapts_target = False
    target_dims = ("hidden_size", "vocab_size", "num_layers")

    def __init__(
        self,
        config: DFlashConfig,
        target_info: TargetInfo,
        spec: LayerSpec,
        embed_weight: Tensor,
        lm_head_weight: Tensor,
        draft_ids: Tensor | None = None,
    ):
        super().__init__()
        if config.target_layer_ids is None or config.mask_token_id is None:
            raise ValueError(
                "DFlashHead needs resolved target_layer_ids and mask_token_id (use for_target)."
            )
        self.config, self.target_info, self.spec = config, target_info, spec
        H, V = target_info.hidden_size, target_info.vocab_size
        check_shapes(target_info, embed_weight, lm_head_weight)
        if not 0 <= config.mask_token_id < V:
            raise ValueError(f"head.mask_token_id={config.mask_token_id} is outside [0, {V}).")
        full = draft_ids is None
        draft_ids = torch.arange(V) if full else draft_ids
        d2t, t2d = d2t_t2d(draft_ids, V)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        width = config.intermediate_size or spec.intermediate_size
        self.fc = nn.Linear(len(config.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, spec.rms_norm_eps)
        self.layers = nn.ModuleList([BlockLayer(spec, width) for _ in range(config.num_layers)])
        self.norm = RMSNorm(H, spec.rms_norm_eps)
        self.mask_embedding = None
        if config.learn_mask:
            start = embed_weight.detach()[config.mask_token_id].float().clone()
            self.mask_embedding = nn.Parameter(start)
        # a reduced vocabulary trains its own rows; the full one is the target's, frozen, unsaved
        self.lm_head = None
        if not full:
            self.lm_head = nn.Linear(H, draft_ids.numel(), bias=False)
            with torch.no_grad():
                self.lm_head.weight.copy_(lm_head_weight.detach()[draft_ids].float())
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("target_lm_head", lm_head_weight.detach(), persistent=False)

    @classmethod
    def for_target(cls, config: DFlashConfig, target, token_counts: Tensor | None = None):
        N = target.num_layers
        ids = config.target_layer_ids or build_target_layer_ids(N, config.num_layers)
        if any(not 0 <= i <= N - 2 for i in ids):
            raise ValueError(
                f"head.target_layer_ids={ids}: ids name decoder layers whose output is HF "
                f"hidden_states[id + 1], so they must lie in [0, {N - 2}] for this {N}-layer "
                "target."
            )
        mask = config.mask_token_id
        tokenizer = getattr(target, "tokenizer", None)
        if mask is None:
            mask = default_mask_token(tokenizer)
        if mask is None and config.learn_mask:
            # the learned vector replaces the row in drafting and in llama.cpp's export alike;
            # the id only seeds it: take the padding token, else the last id
            pad = getattr(tokenizer, "pad_token_id", None)
            mask = pad if pad is not None else target.vocab_size - 1
        if mask is None:
            raise ValueError(
                "head.mask_token_id is null and the target's tokenizer has no special token its "
                "chat template leaves unused: set head.mask_token_id to a token id the target "
                "never writes (with head.learn_mask=true only its row in exports depends on it)."
            )
        config = dataclasses.replace(config, target_layer_ids=list(ids), mask_token_id=int(mask))
        draft_ids = frequent_ids(target, config.draft_vocab_size, token_counts, "draft_vocab_size")
        head = cls(
            config,
            TargetInfo.of(target),
            LayerSpec.from_hf_config(target.model.config),
            target.embed_tokens.weight,
            target.lm_head.weight,
            draft_ids,
        )
        if config.init_from_target:
            init_from_target_layers(head, target)
        # The frozen lm_head was trained on the target's final norm: start the draft's norm
        # there, so that its first logits have the target's scale (all-ones gave a CE of 19).
        final = getattr(getattr(target.model, "base_model", None), "norm", None)
        weight = getattr(final, "weight", None)
        if isinstance(weight, Tensor) and weight.shape == head.norm.weight.shape:
            with torch.no_grad():
                head.norm.weight.copy_(weight.detach().float())
        return head

    # ---- facts ---------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return int(self.config.block_size)

    def feature_layers(self) -> list[int]:
        """HF hidden_states indices of the fused layers (reference id + 1)."""
        return [i + 1 for i in self.config.target_layer_ids]

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.numel())

    @property
    def max_draft_depth(self) -> int:
        return self.block_size - 1

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_to_target(draft_ids, self.d2t)

    def target_to_draft(self, target_ids: Tensor) -> Tensor:
        return target_to_draft(target_ids, self.t2d)

    @property
    def _dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    # ---- the forward pieces --------------------------------------------------------------

    def context(self, features: dict[str, Tensor]) -> Tensor:
        """Fused target context c = hidden_norm(fc(aux)): (..., kH) -> (..., H)."""
        aux = features["aux"].to(self.fc.weight.device, self._dtype)
        return self.hidden_norm(self.fc(aux))

    def context_keys_values(
        self, context: Tensor, position_ids: Tensor
    ) -> list[tuple[Tensor, Tensor]]:
        """Per draft layer, the keys/values the context rows (B, C, H) give at `position_ids`."""
        return [layer.self_attn.keys_values(context, position_ids) for layer in self.layers]

    def block_embeddings(self, anchors: Tensor) -> Tensor:
        """(...,) anchor ids -> (..., B, H): the anchor's embedding, then MASK B-1 times."""
        dtype = self._dtype
        first = F.embedding(anchors, self.embed_weight).to(dtype)[..., None, :]
        if self.mask_embedding is not None:
            mask = self.mask_embedding.to(dtype)
        else:
            mask = self.embed_weight[self.config.mask_token_id].to(dtype)
        rest = mask.expand(*anchors.shape, self.block_size - 1, mask.shape[-1])
        return torch.cat([first, rest], dim=-2)

    def run_layers(
        self,
        hidden: Tensor,
        position_ids: Tensor,
        context: list[tuple[Tensor, Tensor]],
        attn_mask: Tensor | None,
    ) -> Tensor:
        for layer, kv in zip(self.layers, context):
            hidden = layer(hidden, position_ids, kv, attn_mask)
        return self.norm(hidden)

    def logits(self, hidden: Tensor) -> Tensor:
        """Draft-vocabulary scores of normed draft outputs: (..., H) -> (..., D)."""
        if self.lm_head is not None:
            return self.lm_head(hidden.to(self.lm_head.weight.dtype))
        return F.linear(hidden.to(self.target_lm_head.dtype), self.target_lm_head)

    def forward(self, hidden: Tensor) -> Tensor:
        """The same as `logits`."""
        return self.logits(hidden)

    # ---- drafting interface (eval/block_proposer.py) -------------------------------------

    def new_cache(self) -> BlockCache:
        return BlockCache(len(self.layers))

    def extend_cache(self, cache: BlockCache, context: Tensor, position_ids: Tensor) -> None:
        """Append committed context rows (B, C, H) at `position_ids` (B, C) to every layer."""
        for layer_cache, (keys, values) in zip(
            cache.layers, self.context_keys_values(context, position_ids)
        ):
            layer_cache.append(keys, values)

    def block_hidden(self, anchor: Tensor, position: Tensor, cache: BlockCache) -> Tensor:
        """The block after the last layer's norm, (B, block_size, H): anchor (B,) ids at
        `position` (B,), against everything in `cache`."""
        embeds = self.block_embeddings(anchor)  # (B, Bk, H)
        offsets = torch.arange(self.block_size, device=embeds.device)
        positions = position.to(embeds.device)[:, None] + offsets  # (B, Bk)
        context = [(c.keys, c.values) for c in cache.layers]
        if cache.length == 0:
            empty = embeds.new_zeros(embeds.shape[0], self.spec.num_kv_heads, 0, self.spec.head_dim)
            context = [(empty, empty)] * len(self.layers)
        return self.run_layers(embeds, positions, context, None)

    def draft_block(self, anchor: Tensor, position: Tensor, cache: BlockCache) -> Tensor:
        """One draft forward: (B, block_size - 1, D) logits, row k-1 scoring the token k places
        after the anchor (draft vocabulary; map ids with draft_to_target). The cache is read,
        not changed."""
        return self.logits(self.block_hidden(anchor, position, cache)[:, 1:])

    # ---- training ------------------------------------------------------------------------

    def sample_anchors(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """Up to `num_anchors` anchor positions per row, uniformly among the positions whose
        next token is a label of their own conversation and that have context before them.
        Returns (anchors (B, N) long, valid (B, N) bool); unused slots hold position 0."""
        ids = batch["input_ids"]
        B, T = ids.shape
        allowed = label_mask(batch, 1) & (batch_positions(batch, T) >= 1)
        n = min(self.config.num_anchors, T)
        score = torch.rand(B, T, device=ids.device).masked_fill(~allowed, -1.0)
        top, anchors = score.topk(n, dim=1)
        valid = top >= 0
        anchors = torch.where(valid, anchors, torch.zeros_like(anchors))
        order = anchors.masked_fill(~valid, T).argsort(dim=1)  # ascending, unused last
        return torch.gather(anchors, 1, order), torch.gather(valid, 1, order)

    def train_blocks(
        self, batch: dict[str, Tensor], features: dict[str, Tensor], anchors: Tensor
    ) -> Tensor:
        """All blocks of a batch in one forward: (B, N, block_size, H) normed outputs for the
        anchors (B, N) (positions in the rows), with the training block mask."""
        ids = batch["input_ids"]
        Bt, T = ids.shape
        N, Bk = anchors.shape[1], self.block_size
        device = self.fc.weight.device
        positions = batch_positions(batch, T).to(device)  # (B, T)
        context = self.context_keys_values(self.context(features), positions)
        anchor_ids = torch.gather(ids.to(device), 1, anchors)  # (B, N)
        embeds = self.block_embeddings(anchor_ids).reshape(Bt, N * Bk, -1)
        offsets = torch.arange(Bk, device=device)
        block_pos = (torch.gather(positions, 1, anchors)[:, :, None] + offsets).reshape(Bt, N * Bk)
        segments = batch.get("segment_ids")
        mask = block_attention_mask(
            anchors, T, Bk, None if segments is None else segments.to(device)
        )
        hidden = self.run_layers(embeds, block_pos, context, mask)
        return hidden.reshape(Bt, N, Bk, -1)

    def block_labels(
        self, batch: dict[str, Tensor], anchors: Tensor, valid: Tensor, offsets: list[int]
    ) -> tuple[Tensor, Tensor]:
        """Labels of the scored slots: slot i of the block at anchor a predicts x_{a+offsets[i]}.

        Returns (labels (B, N, K) target ids, ok (B, N, K) bool): ok where that token is a label
        of the anchor's own conversation (and, for a reduced vocabulary, inside it)."""
        ids = batch["input_ids"]
        T = ids.shape[1]
        labels, ok = [], []
        for offset in offsets:
            has = torch.gather(label_mask(batch, offset), 1, anchors) & valid  # (B, N)
            token = torch.gather(ids, 1, (anchors + offset).clamp(max=T - 1))
            if self.draft_vocab_size < self.target_info.vocab_size:
                has = has & self.t2d[token]  # a label outside the draft vocab cannot be drafted
            labels.append(token)
            ok.append(has)
        return torch.stack(labels, -1), torch.stack(ok, -1)

    @torch.no_grad()
    def target_probs(
        self, features: dict[str, Tensor], anchors: Tensor, offsets: list[int], ok: Tensor
    ) -> Tensor:
        """The target's distributions (n, D) over the draft vocabulary for the `ok` slots: for
        the label x_{a+o}, softmax of its lm_head on its last hidden state at a+o-1."""
        hidden = features["hidden"].to(self.fc.weight.device)
        T = hidden.shape[1]
        where = torch.stack([(anchors + o - 1).clamp(max=T - 1) for o in offsets], -1)[ok]
        rows = hidden[ok.nonzero()[:, 0], where]  # (n, H)
        weight = self.target_lm_head
        if self.draft_vocab_size < self.target_info.vocab_size:
            # softmax over the draft vocabulary's rows only: the renormalised distribution,
            # without projecting onto the whole vocabulary
            weight = weight[
                self.draft_to_target(torch.arange(self.draft_vocab_size, device=rows.device))
            ]
        return F.linear(rows.to(weight.dtype), weight).float().softmax(-1)

    def position_weights(self, per_slot: Tensor, ok: Tensor, first: int) -> Tensor:
        """Loss weights (B, N, K) of the scored slots, without gradient. "decay": slot i (the
        token first + i places after the anchor's first draft) weighs exp(-(first + i)/gamma).
        "dpace": with q = exp(-loss) the draft's chance on the label and s = (1 - alpha) q +
        alpha, slot i weighs the sum over j >= i of prod_{l <= j} s_l (over ok slots): what a
        slot's error costs the rest of the chain."""
        K = ok.shape[-1]
        if self.config.weighting == "dpace":
            alpha = self.config.dpace_alpha
            smooth = ((1 - alpha) * torch.exp(-per_slot.detach()) + alpha) * ok
            smooth = torch.where(ok, smooth, torch.ones_like(smooth))
            prefix = torch.cumprod(smooth, dim=-1) * ok
            return prefix.flip(-1).cumsum(-1).flip(-1) * ok
        steps = torch.arange(K, device=ok.device, dtype=torch.float32) + first
        return torch.exp(-steps / self.config.decay).expand(ok.shape) * ok

    def loss(self, batch: dict[str, Tensor], features: dict[str, Tensor]) -> LossOutput:
        device = self.fc.weight.device
        batch = {k: v.to(device) for k, v in batch.items()}
        anchors, valid = self.sample_anchors(batch)
        hidden = self.train_blocks(batch, features, anchors)[:, :, 1:]  # slots 1..B-1
        offsets = list(range(1, self.block_size))
        labels, ok = self.block_labels(batch, anchors, valid, offsets)
        logits = self.logits(hidden[ok]).float()  # (n, D)
        want = self.target_to_draft(labels[ok])
        if self.config.loss == "kd":
            probs = self.target_probs(features, anchors, offsets, ok)
            flat = -(probs * logits.log_softmax(-1)).sum(-1)
        else:
            flat = F.cross_entropy(logits, want, reduction="none")
        per_slot = torch.zeros(ok.shape, device=device, dtype=flat.dtype)
        per_slot[ok] = flat
        weights = self.position_weights(per_slot, ok, 0)
        total = hidden.sum() * 0.0  # keeps every parameter in the graph (DDP) if nothing counts
        if bool(ok.any()):
            total = total + (per_slot * weights).sum() / weights.sum().clamp(min=1e-12)
        stats = slot_stats(per_slot, logits, want, ok, self.config.topk, first_slot=1)
        stats["loss"] = stat_pair(total.detach(), 1, device)
        return LossOutput(total, stats)

    # ---- checkpoints ---------------------------------------------------------------------

    def init_from(self, tensors: dict[str, Tensor], source: str) -> list[str]:
        return warm_start(self, tensors, source)

    def save_pretrained(self, path: str | os.PathLike) -> None:
        _save_head(path, self.method, self.config, self.target_info, dict(self.state_dict()))

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, target, doc: dict | None = None,
        allow_other_target: bool = False,
    ):  # fmt: skip
        config, info = open_head(cls, path, target, doc, allow_other_target)
        tensors = load_head_tensors(path)
        d2t = saved_tensor(tensors, "d2t", path)
        draft_ids = None if d2t.numel() == info.vocab_size else saved_draft_ids(d2t)
        head = cls(
            config,
            info,
            LayerSpec.from_hf_config(target.model.config),
            target.embed_tokens.weight,
            target.lm_head.weight,
            draft_ids,
        )
        load_weights(head, tensors, path)
        return head


def _projection_gain(weight: Tensor, input_gain: Tensor, head_dim: int) -> Tensor:
    """Per-dimension RMS (head_dim,) of a projection's heads for an input RMS-normed with gain
    `input_gain`: sqrt(sum_j W[r, j]^2 g_j^2), averaged over the heads. A q_norm / k_norm with
    this weight keeps the scale the target's un-normed queries/keys had."""
    rows = (weight.float().pow(2) * input_gain.float().pow(2)).sum(-1).sqrt()  # (heads * d,)
    return rows.view(-1, head_dim).mean(0)


@torch.no_grad()
def init_from_target_layers(head: DFlashHead, target) -> None:
    """Draft layer i starts as a copy of target layer L + 1 + i (clamped to the last), where L
    is the deepest fused layer id; fc starts as the selection of layer L's features and
    hidden_norm as layer L + 1's input norm, so the context keys/values are that layer's own
    (up to q_norm / k_norm, set to keep the target's query/key scale). Biases of the target's
    projections (Qwen2) are dropped: the draft has none."""
    layers = getattr(getattr(target.model, "base_model", None), "layers", None)
    if layers is None:
        raise ValueError(
            "head.init_from_target needs a target whose base model has decoder `layers` "
            "(Llama/Qwen-style); set head.init_from_target=false."
        )
    ids = head.config.target_layer_ids
    last = max(ids)
    H = head.target_info.hidden_size
    head.fc.weight.zero_()
    slot = ids.index(last)
    head.fc.weight[:, slot * H : (slot + 1) * H] = torch.eye(H)
    first = layers[min(last + 1, len(layers) - 1)]
    head.hidden_norm.weight.copy_(first.input_layernorm.weight.float())
    d = head.spec.head_dim
    for i, mine in enumerate(head.layers):
        src = layers[min(last + 1 + i, len(layers) - 1)]
        theirs = dict(src.named_parameters())
        for name, param in mine.named_parameters():
            if name in theirs and theirs[name].shape == param.shape:
                param.copy_(theirs[name].float())
        gain = src.input_layernorm.weight
        attn = src.self_attn
        mine.self_attn.q_norm.weight.copy_(_projection_gain(attn.q_proj.weight, gain, d))
        mine.self_attn.k_norm.weight.copy_(_projection_gain(attn.k_proj.weight, gain, d))


__all__ = [
    "BlockCache",
    "DFlashConfig",
    "DFlashHead",
    "block_attention_mask",
    "build_target_layer_ids",
    "default_mask_token",
]
