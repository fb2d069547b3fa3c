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

Validation calls `validate`: `loss`'s output plus what greedy chain decoding would accept
(`walk_stats`, the walk of heads/acceptance.py over a block at every anchor): `val/chain_tau_est`,
the tau of a chain of max_draft_depth, and `val/slot{i}/top1_all` / `val/slot{i}/accept`.

Drafting (eval/block_proposer.py) keeps, per draft layer, the keys/values of the committed context
(`new_cache`, `extend_cache`); a step appends the positions the target just committed and runs the
block against them (`draft_block`). Block keys are never stored, so only committed positions
survive a step.

Around the head: heads/block_layers.py (the draft layers and their cache), heads/block_training.py
(anchors, block mask, labels, slot weights and stats), heads/dflash_target.py (what it takes from
the target: fused layers, MASK token, starting weights).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from heads.acceptance import chain_stats, check_horizon
from heads.base import (
    BlockDrafter,
    HeadFolderMixin,
    LossOutput,
    TargetInfo,
    batch_positions,
    label_mask,
    lm_head_argmax,
    masked_shift,
    stat_pair,
    warm_start,
)
from heads.block_layers import BlockCache, BlockLayer
from heads.block_training import (
    block_attention_mask,
    block_labels,
    every_anchor,
    position_weights,
    sample_anchors,
    slot_stats,
)
from heads.dflash_target import init_from_target_layers, init_norm_from_target, with_target_settings
from heads.draft_layer import LayerSpec, RMSNorm
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
    # validation's chain_tau_est_horizon walks each turn's first N tokens (null: not logged)
    estimate_horizon: int | None = 48
    loss: str = "ce"  # "ce": the data's tokens; "kd": the target's distributions
    gamma: float | None = None  # slot k's loss weight exp(-(k-1)/gamma); null: by block size
    # "decay": the exp(-(k-1)/gamma) weights; "dpace": D-PACE weights (what a slot's error costs
    # the rest of the chain, from the draft's own chances; dpace_alpha smooths them)
    weighting: str = "decay"
    dpace_alpha: float = 0.5
    topk: int = 5

    def __post_init__(self) -> None:
        check_horizon(self.estimate_horizon)
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


class DFlashHead(HeadFolderMixin, nn.Module):
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
        config = with_target_settings(config, target)
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
        init_norm_from_target(head, target)
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

    @torch.no_grad()
    def target_argmax(self, hidden: Tensor) -> Tensor:
        """The target's greedy token over its full vocabulary for hidden (..., H)."""
        return lm_head_argmax(self.target_lm_head, hidden)

    @torch.no_grad()
    def drafted_chains(
        self,
        batch: dict[str, Tensor],
        features: dict[str, Tensor],
        anchors: Tensor,
        valid: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """The greedy chain a block at each anchor (B, N) drafts where the tokens before each
        slot are the data's: (tokens (B, N, K) target ids, -1 where not drafted; run (B, N, K):
        x_{a+1} .. x_{a+i+1} are all labels of the anchor's conversation), slot i drafting
        x_{a+i+1}, K = max_draft_depth. A DFlash slot does not see the tokens before it, so
        this is each slot's best token."""
        hidden = self.train_blocks(batch, features, anchors)[:, :, 1:]
        offsets = list(range(1, self.block_size))
        labels, run = block_labels(batch, anchors, valid, offsets, torch.ones_like(self.t2d))
        run = run.long().cumprod(-1).bool()
        tokens = torch.full_like(labels, -1)
        tokens[run] = self.draft_to_target(self.logits(hidden[run]).argmax(-1))
        return tokens, run

    @torch.no_grad()
    def every_chain(
        self, batch: dict[str, Tensor], features: dict[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        """`drafted_chains` at every anchor (`num_anchors` blocks per forward), by the row
        decoding queries for them: row t has the root x_{t+1}, the anchor of the block. Returns
        (drafted (K, B, T) target ids, -1 where none; labels (K, B, T) bool: row t's block
        drafted depth i+1, x_{t+2} .. x_{t+i+2} being labels)."""
        device = self.fc.weight.device
        B, T = batch["input_ids"].shape
        K = self.max_draft_depth
        drafted = torch.full((K, B, T), -1, dtype=torch.long, device=device)
        labels = torch.zeros(K, B, T, dtype=torch.bool, device=device)
        anchors, valid = every_anchor(batch)
        step = self.config.num_anchors
        for a, v in zip(anchors.split(step, dim=1), valid.split(step, dim=1)):
            tokens, run = self.drafted_chains(batch, features, a, v)
            rows = torch.arange(B, device=device)[:, None].expand_as(a)[v]
            drafted[:, rows, a[v] - 1] = tokens[v].T
            labels[:, rows, a[v] - 1] = run[v].T
        return drafted, labels

    @torch.no_grad()
    def walk_stats(self, batch: dict[str, Tensor], features: dict[str, Tensor]) -> dict:
        """Validation: what greedy chain decoding (a chain of max_draft_depth) would accept on
        this batch (heads/acceptance.py), from `every_chain` against the target's greedy tokens
        (full vocabulary, from features["hidden"]). Returns `slot{i+1}/top1_all` (a target
        token outside the draft vocabulary is a miss), `slot{i+1}/accept` (given depths 1..i
        right) and `chain_tau_est` (the walk's tokens over rounds) as [sum, count] pairs."""
        device = self.fc.weight.device
        labelled = label_mask(batch, 1)  # rows whose next token is a label
        greedy = torch.full(labelled.shape, -1, dtype=torch.long, device=device)
        greedy[labelled] = self.target_argmax(features["hidden"].to(device)[labelled])
        drafted, labels = self.every_chain(batch, features)
        want = torch.stack([masked_shift(greedy, i + 1) for i in range(len(drafted))])
        mask, segments = batch["loss_mask"], batch.get("segment_ids")
        found = chain_stats(drafted == want, labels, mask, segments, self.config.estimate_horizon)
        out = {}
        for key, (total, count) in found.items():
            if key.startswith("step"):  # step i is depth i + 1: slot{i+1}, as slot_stats
                i, name = key[len("step") :].split("/")
                key = f"slot{int(i) + 1}/{name}"
            out[key] = stat_pair(total, count, device)
        return out

    def loss(self, batch: dict[str, Tensor], features: dict[str, Tensor]) -> LossOutput:
        device = self.fc.weight.device
        batch = {k: v.to(device) for k, v in batch.items()}
        anchors, valid = sample_anchors(batch, self.config.num_anchors)
        hidden = self.train_blocks(batch, features, anchors)[:, :, 1:]  # slots 1..B-1
        offsets = list(range(1, self.block_size))
        labels, ok = block_labels(batch, anchors, valid, offsets, self.t2d)
        logits = self.logits(hidden[ok]).float()  # (n, D)
        want = self.target_to_draft(labels[ok])
        if self.config.loss == "kd":
            probs = self.target_probs(features, anchors, offsets, ok)
            flat = -(probs * logits.log_softmax(-1)).sum(-1)
        else:
            flat = F.cross_entropy(logits, want, reduction="none")
        per_slot = torch.zeros(ok.shape, device=device, dtype=flat.dtype)
        per_slot[ok] = flat
        weights = position_weights(per_slot, ok, 0, self.config)
        total = hidden.sum() * 0.0  # keeps every parameter in the graph (DDP) if nothing counts
        if bool(ok.any()):
            total = total + (per_slot * weights).sum() / weights.sum().clamp(min=1e-12)
        stats = slot_stats(per_slot, logits, want, ok, self.config.topk, first_slot=1)
        stats["loss"] = stat_pair(total.detach(), 1, device)
        return LossOutput(total, stats)

    @torch.no_grad()
    def validate(self, batch: dict[str, Tensor], features: dict[str, Tensor]) -> LossOutput:
        """`loss`'s output plus `walk_stats` (a block at every anchor); call it in eval mode."""
        device = self.fc.weight.device
        batch = {k: v.to(device) for k, v in batch.items()}
        out = self.loss(batch, features)
        out.stats.update(self.walk_stats(batch, features))
        return out

    # ---- checkpoints ---------------------------------------------------------------------

    def init_from(self, tensors: dict[str, Tensor], source: str) -> list[str]:
        return warm_start(self, tensors, source)

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


__all__ = ["DFlashConfig", "DFlashHead"]
