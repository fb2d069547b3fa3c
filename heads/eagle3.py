"""EAGLE-3 draft head (Li et al., 2025, "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test").

Differences from EAGLE-1 (heads/eagle.py):
- The draft reads a fusion of low, mid and high target layers, h_t = fc([a_t; b_t; c_t]) (3H -> H,
  no bias; HF hidden_states indices `aux_layers`, default [2, N//2, N-3]), not the last feature.
- Its decoder layer's q/k/v read [input_layernorm(embed(x_{t+1})); hidden_norm(h_t)] (2H); the
  residual stream is h_t. The output is not regressed onto any target feature: a final `norm` and
  the draft's own `lm_head` [D, H] score a reduced vocabulary (the D most frequent training
  labels, heads/vocab.py d2t/t2d; rows initialised from the target's lm_head, then trained).
- `num_layers` > 1 stacks plain pre-norm decoder layers on that layer's residual stream before
  the final norm (vLLM's llama_eagle3 builds the same; SGLang, llama.cpp and OpenVINO GenAI serve
  one layer, and the GGUF and OpenVINO exports refuse more). Each layer keeps its own keys and
  values in the one DraftCache (`DraftCache.layer`), so drafting code is the same for any depth.
- Training-time test (TTT): the draft is unrolled for `ttt_steps` steps. Step 0 reads the fused
  target features; step i > 0 reads the draft's own outputs of step i-1, exactly as at decoding
  time. Loss = sum_i decay**i * CE(draft, softmax of the target's logits over the draft vocab).

Unrolled rows. At step i, row t is the node drafted i levels below the prefix that ends at t:
hidden = the step-(i-1) output of row t (the predicted feature at t+i), token = x_{t+i+1} (ground
truth), position t+i; it predicts x_{t+i+2}. Every step appends T keys to one DraftCache, and
`ttt_attention_mask(T, i)` lets row t see the step-0 keys of positions <= t (the prefix, computed
from target features) and, for j = 1..i, the step-j key of row t itself (its own ancestors in the
draft chain) -- what a chain drafted with `step` and a cache sees at inference.

EAGLE-3.1 options (vllm-project/speculators PR #610, both off by default, so heads saved before
them load unchanged): `fc_norm` gives each fused target layer an RMSNorm of its own before fc,
h_t = fc([n_a(a_t); n_b(b_t); n_c(c_t)]), which evens out the layers' very different scales; and
`norm_output` feeds the post-norm state norm(out) (the one lm_head reads) to the next step instead
of the layer's residual output, in training-time test and when drafting alike, so the state fed
back keeps one scale however deep the draft goes. Eagle3Config (heads/eagle3_config.py)
describes the training-only regularisers (`feature_noise`, `dropout`), the loss variants
(`mask_after_miss`, GRIFFIN; `hass_topk`, HASS) and `init_from_target` (heads/eagle3_target.py).

Loss positions: row t at step i counts when x_{t+i+2} is an assistant token and (as in
SpecForge) the target's own greedy token there lies inside the draft vocabulary: where it does
not, the renormalised distribution would teach the draft to prefer a token the target would not
pick. That needs the target's greedy token over its whole vocabulary: computed once per example
from its cached features (`example_targets`) and kept for later epochs, or per batch with online
features. `mask_outside_vocab=False` keeps those positions and needs no full-vocabulary projection.

`validate` (validation's call, in eval mode) runs the same unroll and also reports what a chain
of `ttt_steps` tokens would be worth when decoding (heads/acceptance.py): `step{i}/top1_all`
(tokens outside the draft vocab count as misses), `step{i}/accept` (conditional on the earlier
steps being right) and `chain_tau_est`; `loss` leaves them out.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from heads.acceptance import chain_stats
from heads.base import (
    FeatureDrafter,
    HeadFolderMixin,
    LossOutput,
    TargetInfo,
    batch_positions,
    label_mask,
    lm_head_argmax,
    masked_shift,
    segment_causal_mask,
    stat_pair,
    warm_start,
)
from heads.draft_layer import DraftCache, DraftDecoderLayer, LayerSpec, RMSNorm
from heads.eagle import check_shapes, topk_hits
from heads.eagle3_config import Eagle3Config
from heads.eagle3_target import init_eagle3_from_target
from heads.folder import load_head_tensors, load_weights, open_head, saved_tensor
from heads.vocab import d2t_t2d, draft_to_target, frequent_ids, saved_draft_ids, target_to_draft


def default_aux_layers(num_layers: int) -> list[int]:
    """[2, N//2, N-3] (low, mid, high residual-stream states), clamped into [0, N-1]."""
    top = num_layers - 1
    return [min(2, top), min(num_layers // 2, top), max(num_layers - 3, 0)]


def ttt_attention_mask(
    length: int, step: int, device=None, segments: Tensor | None = None
) -> Tensor:
    """Which keys row t may attend to at unroll step `step`: `[T, (step + 1) * T]` bool, or
    `[B, 1, T, (step + 1) * T]` for packed rows (`segments` (B, T), see heads/base.py).

    Keys are laid out step by step, T per step (the DraftCache order). Row t sees the step-0
    keys of rows <= t (of its own conversation, in a packed row) and the step-j key of row t
    for j = 1..step.
    """
    rows = torch.arange(length, device=device)
    causal = rows[None, :] <= rows[:, None]  # (T, T)
    diagonal = torch.eye(length, dtype=torch.bool, device=device)
    if segments is None:
        return torch.cat([causal] + [diagonal] * step, dim=1)
    prefix = segment_causal_mask(segments)  # (B, 1, T, T)
    own = diagonal.expand(*prefix.shape[:2], length, length)
    return torch.cat([prefix] + [own] * step, dim=-1)


class Eagle3Head(HeadFolderMixin, nn.Module):
    """EAGLE-3: fc over aux features, a fused-input decoder layer (and `num_layers - 1` plain
    ones), norm + reduced lm_head."""

    method = "eagle3"
    config_class = Eagle3Config
    title = "EAGLE-3 draft layer"
    hub_tag = "eagle3"
    export_formats = ("native", "eagle3", "speculators")
    export_note = ""
    drafting = FeatureDrafter
    uses_target_features = True
    adapts_target = False
    # it fuses given layers of the target: the same layer count keeps their meaning
    target_dims = ("hidden_size", "vocab_size", "num_layers")

    def __init__(
        self,
        config: Eagle3Config,
        target_info: TargetInfo,
        spec: LayerSpec,
        embed_weight: Tensor,
        lm_head_weight: Tensor,
        draft_ids: Tensor | None = None,
    ):
        super().__init__()
        if config.aux_layers is None:
            raise ValueError("Eagle3Head needs resolved aux_layers (use Eagle3Head.for_target).")
        self.config, self.target_info, self.spec = config, target_info, spec
        H, V = target_info.hidden_size, target_info.vocab_size
        check_shapes(target_info, embed_weight, lm_head_weight)
        draft_ids = torch.arange(V) if draft_ids is None else draft_ids
        d2t, t2d = d2t_t2d(draft_ids, V)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        self.fc = nn.Linear(len(config.aux_layers) * H, H, bias=False)
        if config.fc_norm:  # one per fused layer, in aux_layers order
            self.fc_norm = nn.ModuleList(RMSNorm(H, spec.rms_norm_eps) for _ in config.aux_layers)
        deeper = [DraftDecoderLayer(spec) for _ in range(config.num_layers - 1)]
        self.layers = nn.ModuleList([DraftDecoderLayer(spec, fused_input=True), *deeper])
        self.norm = RMSNorm(H, spec.rms_norm_eps)
        self.lm_head = nn.Linear(H, draft_ids.numel(), bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head_weight.detach()[draft_ids].float())
        # The target's own tensors, frozen, never saved: embeddings, and its lm_head for the
        # soft targets while training.
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("target_lm_head", lm_head_weight.detach(), persistent=False)

    @classmethod
    def for_target(cls, config: Eagle3Config, target, token_counts: Tensor | None = None):
        """A new head for `target`; a reduced vocab needs label counts from the training data."""
        N = target.num_layers
        layers = config.aux_layers or default_aux_layers(N)
        if any(not 0 <= i < N for i in layers):
            raise ValueError(
                f"head.aux_layers={layers}: HF hidden_states indices must lie in [0, {N - 1}] "
                f"(index {N} is the post-norm output)."
            )
        config = dataclasses.replace(config, aux_layers=list(layers))
        draft_ids = frequent_ids(target, config.draft_vocab_size, token_counts, "draft_vocab_size")
        spec = LayerSpec.from_hf_config(target.model.config)
        head = cls(config, TargetInfo.of(target), spec, target.embed_tokens.weight,
                   target.lm_head.weight, draft_ids)  # fmt: skip
        if config.init_from_target:
            init_eagle3_from_target(head, target)
        return head

    # ---- drafting interface (eval/engine/eagle_proposer.py) -------------------------------------

    def feature_layers(self) -> list[int] | None:
        return list(self.config.aux_layers)

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.numel())

    @property
    def max_draft_depth(self) -> None:
        return None  # it drafts as deep as the tree asks

    def target_hidden(self, features: dict[str, Tensor]) -> Tensor:
        """Fused target features h = fc(aux): (..., kH) -> (..., H)."""
        return self.fuse(features["aux"].to(self.fc.weight.device, self.fc.weight.dtype))

    def fuse(self, aux: Tensor) -> Tensor:
        """fc over the k target layers (..., kH) -> (..., H), each layer normalised on its own
        first with `fc_norm`."""
        if self.config.fc_norm:
            parts = aux.chunk(len(self.fc_norm), dim=-1)  # k x (..., H)
            aux = torch.cat([norm(x) for norm, x in zip(self.fc_norm, parts, strict=True)], -1)
        return self.fc(aux)

    def noisy(self, aux: Tensor) -> Tensor:
        """`aux` with the training noise (`feature_noise`, `feature_noise_type`) added."""
        scale = self.config.feature_noise
        if not scale:
            return aux
        if self.config.feature_noise_type == "gaussian":
            return aux + torch.randn_like(aux) * scale
        return aux + (torch.rand_like(aux) - 0.5) * scale

    def dropped(self, x: Tensor) -> Tensor:  # `dropout` while training; x itself otherwise
        p = self.config.dropout
        return F.dropout(x, p, training=True) if p and self.training else x

    def draft_hidden(
        self,
        tokens: Tensor,
        hidden: Tensor,
        position_ids: Tensor,
        cache: DraftCache,
        attn_mask: Tensor | None = None,
    ) -> Tensor:
        """The state fed back as `hidden` one level deeper (B, q, H): the layer's output, or
        with `norm_output` that output after the final norm."""
        dtype = self.fc.weight.dtype
        embeds = F.embedding(tokens, self.embed_weight).to(dtype)  # (B, q, H)
        out = self.layers[0](hidden.to(dtype), position_ids, cache, attn_mask, embeds=embeds)
        for i, layer in enumerate(self.layers[1:], 1):  # num_layers > 1: plain layers on top
            out = layer(out, position_ids, cache.layer(i), attn_mask)
        return self.norm(out) if self.config.norm_output else out

    def step(
        self,
        tokens: Tensor,
        hidden: Tensor,
        position_ids: Tensor,
        cache: DraftCache,
        attn_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """One draft forward over q rows: (out_hidden (B, q, H), logits (B, q, D)).

        Row t: hidden = the fused feature at position t (target_hidden) or the draft's own
        out_hidden of the parent node, tokens = x_{t+1}; logits[t] score x_{t+2} over the draft
        vocabulary (map ids with draft_to_target). The cache gains the q rows' keys and values.
        """
        out = self.draft_hidden(tokens, hidden, position_ids, cache, attn_mask)
        return out, self.logits(out)

    def logits(self, hidden: Tensor) -> Tensor:
        """Draft-vocabulary scores of a draft output (what `draft_hidden` returns): (..., H) ->
        (..., D). lm_head always reads the post-norm state: with `norm_output` the output is
        normalised already."""
        hidden = hidden.to(self.lm_head.weight.dtype)
        return self.lm_head(hidden if self.config.norm_output else self.norm(hidden))

    def forward(self, hidden: Tensor) -> Tensor:
        """The same as `logits`."""
        return self.logits(hidden)

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_to_target(draft_ids, self.d2t)

    def target_to_draft(self, target_ids: Tensor) -> Tensor:
        return target_to_draft(target_ids, self.t2d)

    # ---- training ------------------------------------------------------------------------

    def _masks_outside_vocab(self) -> bool:
        full = self.draft_vocab_size >= self.target_info.vocab_size
        return self.config.mask_outside_vocab and not full

    @torch.no_grad()
    def target_argmax(self, hidden: Tensor) -> Tensor:
        """The target's greedy token over its full vocabulary for hidden (..., H)."""
        return lm_head_argmax(self.target_lm_head, hidden)

    def example_targets(self, example: dict[str, Tensor]) -> dict[str, Tensor]:
        """{"target_argmax": (T,) int32}, the target's greedy token at each position of one
        example with cached features, so that a training step need not project onto the whole
        vocabulary again (train.features.ExampleTargets keeps it for every epoch); {} when the
        loss does not use it (mask_outside_vocab off, or the full vocabulary drafted) or the
        example has no cached features."""
        if not self._masks_outside_vocab() or "hidden" not in example:
            return {}
        hidden = example["hidden"].to(self.target_lm_head.device)
        return {"target_argmax": self.target_argmax(hidden).to("cpu", torch.int32)}

    @torch.no_grad()
    def soft_targets(
        self, hidden: Tensor, label_mask: Tensor, argmax: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The target's next-token distributions over the draft vocab, where they are needed.

        hidden (B, T, H): the target's last hidden state; label_mask (B, T): rows t whose next
        token x_{t+1} is a label; argmax (B, T): the target's greedy tokens when the batch
        carries them (`example_targets`), else computed here. Returns probs (N, D) for those
        rows, index (B, T) (row of `probs`, -1 where none) and usable (B, T): the target's
        argmax there is in the vocab.
        """
        h = hidden[label_mask]  # (N, H)
        weight = self.target_lm_head
        draft_ids = self.draft_to_target(torch.arange(self.draft_vocab_size, device=h.device))
        logits = F.linear(h.to(weight.dtype), weight[draft_ids]).float()  # (N, D)
        usable = torch.ones(h.shape[0], dtype=torch.bool, device=h.device)
        if self._masks_outside_vocab():
            if argmax is not None:
                best = argmax.to(h.device)[label_mask].long()
            else:
                best = self.target_argmax(h)
            usable = self.t2d[best]
        index = torch.full(label_mask.shape, -1, dtype=torch.long, device=h.device)
        index[label_mask] = torch.arange(h.shape[0], device=h.device)
        usable_bt = torch.zeros(label_mask.shape, dtype=torch.bool, device=h.device)
        usable_bt[label_mask] = usable
        return logits.softmax(-1), index, usable_bt

    def loss(self, batch: dict[str, Tensor], features: dict[str, Tensor]) -> LossOutput:
        """Training-time test: `ttt_steps` unrolled steps, decayed soft CE per step.

        Packed rows (`segment_ids` in the batch): the step-0 prefix a row sees, its positions
        and its labels all stay inside its own conversation (heads/base.py `label_mask`).
        """
        return self._unroll(batch, features)[0]

    @torch.no_grad()
    def validate(self, batch: dict[str, Tensor], features: dict[str, Tensor]) -> LossOutput:
        """`loss`'s output plus the chain estimates of heads/acceptance.py (`chain_stats`):
        each unrolled step's top-1 against the target's greedy token over its whole vocabulary.
        Call it in eval mode (no feature noise, no dropout)."""
        labelled = label_mask(batch, 1)
        greedy = self.greedy_tokens(features["hidden"], labelled, batch.get("target_argmax"))
        out, chain = self._unroll(batch, features, greedy)
        hits, labels = (torch.stack(x) for x in zip(*chain))  # (S, B, T) each
        mask, horizon = batch["loss_mask"], self.config.estimate_horizon
        found = chain_stats(hits, labels, mask, batch.get("segment_ids"), horizon)
        device = self.fc.weight.device
        out.stats.update({key: stat_pair(s, c, device) for key, (s, c) in found.items()})
        return out

    def _unroll(
        self, batch: dict[str, Tensor], features: dict[str, Tensor], greedy: Tensor | None = None
    ) -> tuple[LossOutput, list[tuple[Tensor, Tensor]]]:
        """`loss`'s unroll; with `greedy` (B, T), the target's greedy tokens (`greedy_tokens`),
        also each step's `chain_hits` (hits, labels), for `validate`."""
        ids = batch["input_ids"]
        B, T = ids.shape
        device = self.fc.weight.device
        labelled = label_mask(batch, 1)  # rows t whose next token x_{t+1} is a label
        argmax = batch.get("target_argmax")
        probs, index, usable = self.soft_targets(features["hidden"].to(device), labelled, argmax)
        aux = features["aux"].to(device, self.fc.weight.dtype)
        hidden = self.dropped(self.fuse(self.noisy(aux) if self.training else aux))  # (B, T, H)
        cache = DraftCache()
        positions = batch_positions(batch, T)  # (B, T)
        segments = batch.get("segment_ids")
        total = hidden.sum() * 0.0  # keeps every parameter in the graph (DDP) if nothing counts
        stats: dict[str, Tensor] = {}
        k = min(self.config.topk, self.draft_vocab_size)
        # row t at step i lies on a drafted chain a greedy verifier would still be following:
        # steps 0..i-1 of row t all predicted the target's top-1
        on_chain = torch.ones(B, T, dtype=torch.bool, device=device)
        chain: list[tuple[Tensor, Tensor]] = []
        for i in range(self.config.ttt_steps):
            tokens = shift_left(ids, i + 1)  # row t: x_{t+i+1}
            mask = ttt_attention_mask(T, i, device, segments)
            mask = mask if segments is not None else mask[None, None]
            hidden = self.dropped(self.draft_hidden(tokens, hidden, positions + i, cache, mask))
            if greedy is not None:
                chain.append(self.chain_hits(hidden, greedy, batch, i))
            # row t predicts x_{t+i+2}: the target's distribution at position t+i+1
            valid = label_mask(batch, i + 2) & shift_left(usable, i + 1)
            want = probs[shift_left(index, i + 1)[valid]]  # (N, D)
            logits = self.logits(hidden[valid]).float()  # (N, D)
            logp = logits.log_softmax(-1)
            ce = -(want * logp).sum(-1)  # (N,)
            reached = on_chain[valid]  # (N,)
            counted = reached if self.config.mask_after_miss else torch.ones_like(reached)
            if counted.any():
                step_loss = ce[counted].mean() + self._topk_term(want[counted], logp[counted])
                total = total + self.config.decay**i * step_loss
            top1, topk = topk_hits(logits, want.argmax(-1), k)
            hit = logits.argmax(-1) == want.argmax(-1)  # (N,)
            n = ce.shape[0]
            stats[f"step{i}/loss"] = stat_pair(ce.detach().sum(), n, device)
            stats[f"step{i}/top1"] = stat_pair(top1, n, device)
            stats[f"step{i}/top{k}"] = stat_pair(topk, n, device)
            # accuracy where the chain got this far: a chain's acceptance at depth i+1
            stats[f"step{i}/chain_top1"] = stat_pair(
                (hit & reached).sum().float(), int(reached.sum()), device
            )
            on_chain = torch.zeros_like(on_chain).masked_scatter(valid, reached & hit)
        # the first drafted token's accuracy, the same quantity as Medusa's head0
        stats["head0/top1"] = stats["step0/top1"]
        stats[f"head0/top{k}"] = stats[f"step0/top{k}"]
        stats["loss"] = stat_pair(total.detach(), 1, device)
        return LossOutput(total, stats), chain

    def _topk_term(self, want: Tensor, logp: Tensor) -> Tensor:
        """HASS's top-K distillation term (Zhang et al., 2024, "Learning Harmonized
        Representations for Speculative Sampling"): hass_weight * mean over rows of
        -sum over the target's K likeliest tokens of p log q, which weighs the tokens a verifier
        is likely to accept above the tail. Zero when hass_topk is 0."""
        K = min(self.config.hass_topk, want.shape[-1])
        if not K or not want.shape[0]:
            return logp.new_zeros(())
        top = want.topk(K, dim=-1)  # (N, K)
        term = -(top.values * logp.gather(-1, top.indices)).sum(-1)  # (N,)
        return self.config.hass_weight * term.mean()

    @torch.no_grad()
    def greedy_tokens(
        self, hidden: Tensor, labelled: Tensor, argmax: Tensor | None = None
    ) -> Tensor:
        """(B, T) long: the target's greedy token over its whole vocabulary at each labelled
        row (the batch's `target_argmax` when it carries them), -1 elsewhere."""
        best = torch.full(labelled.shape, -1, dtype=torch.long, device=labelled.device)
        if argmax is not None:
            best[labelled] = argmax.to(best.device)[labelled].long()
        else:
            best[labelled] = self.target_argmax(hidden.to(best.device)[labelled])
        return best

    @torch.no_grad()
    def chain_hits(
        self, out: Tensor, greedy: Tensor, batch: dict[str, Tensor], step: int
    ) -> tuple[Tensor, Tensor]:
        """Unroll step `step`'s top-1 against the target: (hits, labels), (B, T) bool each.
        labels[t]: x_{t+step+2} is a label; hits[t]: there, the draft's best token (mapped to
        target ids) is the target's greedy token `greedy[t+step+1]` (a token outside the draft
        vocabulary is always a miss)."""
        labels = label_mask(batch, step + 2)
        drafted = torch.full_like(greedy, -2)
        drafted[labels] = self.draft_to_target(self.logits(out[labels]).argmax(-1))
        return drafted == shift_left(greedy, step + 1), labels

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
        draft_ids = saved_draft_ids(saved_tensor(tensors, "d2t", path))
        spec = LayerSpec.from_hf_config(target.model.config)
        head = cls(config, info, spec, target.embed_tokens.weight, target.lm_head.weight,
                   draft_ids)  # fmt: skip
        load_weights(head, tensors, path)
        return head


def shift_left(x: Tensor, n: int) -> Tensor:
    """`out[:, t] = x[:, t + n]`, zeros (False) past the end."""
    return masked_shift(x, n)
