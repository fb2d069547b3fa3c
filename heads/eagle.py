"""EAGLE-1 draft head (Li et al., 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty").

The draft autoregresses over the target's features, not its tokens. Row t reads f_t (the target's
last hidden state after the final norm, what its lm_head sees) and the token x_{t+1} that
followed it, fuses them with fc([embed(x_{t+1}); f_t]) (2H -> H, with bias), runs one decoder
layer (heads/draft_layer.py) and outputs the predicted feature at t+1; the target's frozen
lm_head turns it into scores for x_{t+2}. The target's embeddings and lm_head are used frozen and
are never saved with the head (config.json records the target; loading re-attaches them).

Training is teacher-forced in one causal pass. At position t the loss is
    SmoothL1(pred_t, f_{t+1})  +  ce_weight * CE(lm_head(pred_t), softmax(lm_head(f_{t+1})))
averaged over the positions whose label x_{t+2} is an assistant token (loss_mask[t+2] == 1).
Uniform noise on the input features (EAGLE's augmentation) teaches the draft to cope with its
own imperfect features at depth > 1.

CPU cost: the vocabulary projection dominates (on SmolLM2, 28 M multiply-adds per position and
per projection against about 4 M for the whole draft layer), so only loss positions are projected,
and `loss_vocab_size=K` computes the CE, and the training accuracies, over the K most frequent
training labels only (renormalised on both sides). Validation (eval mode) always uses the full
vocabulary, so val/top1 is the honest number.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from heads.base import (
    FeatureDrafter,
    HeadFolderMixin,
    LossOutput,
    TargetInfo,
    batch_positions,
    label_mask,
    segment_causal_mask,
    stat_pair,
    warm_start,
)
from heads.draft_layer import DraftCache, DraftDecoderLayer, LayerSpec
from heads.folder import load_head_tensors, load_weights, open_head
from heads.vocab import frequent_ids


@dataclass
class EagleConfig:
    ce_weight: float = 0.1  # weight of the token CE next to the feature regression
    # Input features get U(-a/2, a/2) noise while training (a = feature_noise; EAGLE: 0.2).
    feature_noise: float = 0.2
    # False: no norm before attention (original EAGLE-1; vLLM/SGLang load layer 0 this way).
    input_norm: bool = False
    # CE over the K most frequent training labels only (null: the full vocabulary).
    loss_vocab_size: int | None = None
    topk: int = 5

    def __post_init__(self) -> None:
        if self.ce_weight < 0:
            raise ValueError(f"head.ce_weight={self.ce_weight}: use a weight >= 0.")
        if self.feature_noise < 0:
            raise ValueError(f"head.feature_noise={self.feature_noise}: use >= 0 (0 disables).")
        if self.loss_vocab_size is not None and self.loss_vocab_size < 1:
            raise ValueError("head.loss_vocab_size must be positive, or null for the full vocab.")
        if self.topk < 1:
            raise ValueError(f"head.topk={self.topk}: use 1 or more.")


class EagleHead(HeadFolderMixin, nn.Module):
    """EAGLE-1: fc + one decoder layer; step(tokens, hidden, ...) -> (next feature, logits)."""

    method = "eagle"
    config_class = EagleConfig
    title = "EAGLE-1 draft layer (EAGLE-2 dynamic trees at decode time)"
    hub_tag = "eagle"
    export_formats = ("native", "eagle")
    export_note = ""
    drafting = FeatureDrafter
    uses_target_features = True
    adapts_target = False
    target_dims = ("hidden_size", "vocab_size")

    def __init__(
        self,
        config: EagleConfig,
        target_info: TargetInfo,
        spec: LayerSpec,
        embed_weight: Tensor,
        lm_head_weight: Tensor,
        loss_ids: Tensor | None = None,
    ):
        super().__init__()
        self.config, self.target_info, self.spec = config, target_info, spec
        H = target_info.hidden_size
        check_shapes(target_info, embed_weight, lm_head_weight)
        self.fc = nn.Linear(2 * H, H, bias=True)
        self.layers = nn.ModuleList([DraftDecoderLayer(spec, input_norm=config.input_norm)])
        # The target's own tensors (no copy on the CPU), frozen, never saved.
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("lm_head_weight", lm_head_weight.detach(), persistent=False)
        self.register_buffer("loss_ids", loss_ids, persistent=False)

    @classmethod
    def for_target(cls, config: EagleConfig, target, token_counts: Tensor | None = None):
        """A new head for `target`; `loss_vocab_size` needs label counts of the training data."""
        loss_ids = frequent_ids(target, config.loss_vocab_size, token_counts, "loss_vocab_size")
        spec = LayerSpec.from_hf_config(target.model.config)
        return cls(
            config,
            TargetInfo.of(target),
            spec,
            target.embed_tokens.weight,
            target.lm_head.weight,
            loss_ids,
        )

    # ---- drafting interface (eval/engine/eagle_proposer.py) -------------------------------------

    def feature_layers(self) -> list[int] | None:
        return None

    @property
    def draft_vocab_size(self) -> int:
        return self.target_info.vocab_size

    @property
    def max_draft_depth(self) -> None:
        return None  # it drafts as deep as the tree asks

    def target_hidden(self, features: dict[str, Tensor]) -> Tensor:
        """The feature rows the draft reads from the target: its last hidden state, (..., H)."""
        return features["hidden"]

    def draft_hidden(
        self,
        tokens: Tensor,
        hidden: Tensor,
        position_ids: Tensor,
        cache: DraftCache,
        attn_mask: Tensor | None = None,
    ) -> Tensor:
        """Predicted features (B, q, H) for rows (tokens = x_{t+1}, hidden = f_t)."""
        dtype = self.fc.weight.dtype
        embeds = F.embedding(tokens, self.embed_weight).to(dtype)  # (B, q, H)
        x = self.fc(torch.cat([embeds, hidden.to(dtype)], dim=-1))  # (B, q, H)
        return self.layers[0](x, position_ids, cache, attn_mask)

    def step(
        self,
        tokens: Tensor,
        hidden: Tensor,
        position_ids: Tensor,
        cache: DraftCache,
        attn_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """One draft forward over q rows: (out_hidden (B, q, H), logits (B, q, V)).

        Row t: hidden = the feature at position t (the target's, or the draft's own out_hidden
        of the parent node), tokens = x_{t+1}. out_hidden[t] predicts the feature at t+1 and
        logits[t] score x_{t+2}. The cache gains the q rows' keys and values.
        """
        out = self.draft_hidden(tokens, hidden, position_ids, cache, attn_mask)
        return out, self.logits(out)

    def logits(self, hidden: Tensor, vocab_ids: Tensor | None = None) -> Tensor:
        """The frozen lm_head over the full vocab (or `vocab_ids`): (..., H) -> (..., V)."""
        weight = self.lm_head_weight if vocab_ids is None else self.lm_head_weight[vocab_ids]
        return F.linear(hidden.to(weight.dtype), weight).float()

    def forward(self, hidden: Tensor) -> Tensor:
        """Token scores of a (predicted) feature: the same as `logits`."""
        return self.logits(hidden)

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_ids  # EAGLE-1 drafts over the target's own vocabulary

    # ---- training ------------------------------------------------------------------------

    def loss(self, batch: dict[str, Tensor], features: dict[str, Tensor]) -> LossOutput:
        """Feature regression + weighted soft CE, teacher-forced in one causal pass.

        Packed rows (`segment_ids` in the batch): row t attends only to rows of its own
        conversation, positions restart per conversation, and a row counts only when its label
        x_{t+2} is in its conversation.
        """
        dtype = self.fc.weight.dtype
        feats = features["hidden"].to(self.fc.weight.device, dtype)  # (B, T, H)
        ids = batch["input_ids"]
        B, T = ids.shape
        inputs = feats[:, :-1]  # f_t, t = 0 .. T-2
        if self.training and self.config.feature_noise > 0:
            inputs = inputs + (torch.rand_like(inputs) - 0.5) * self.config.feature_noise
        positions = batch_positions(batch, T - 1)  # (B, T-1)
        segments = batch.get("segment_ids")
        attn = segment_causal_mask(None if segments is None else segments[:, :-1])
        pred = self.draft_hidden(ids[:, 1:], inputs, positions, DraftCache(), attn)  # (B, T-1, H)
        valid = label_mask(batch, 2)[:, : T - 1]  # label x_{t+2}
        pred, want = pred[valid], feats[:, 1:][valid]  # (N, H) each
        n, device = pred.shape[0], pred.device
        feat = F.smooth_l1_loss(pred, want, reduction="none").mean(-1)  # (N,)
        vocab_ids = self.loss_ids if self.training else None
        with torch.no_grad():
            target_logits = self.logits(want, vocab_ids)  # (N, V')
        draft_logits = self.logits(pred, vocab_ids)
        ce = -(target_logits.softmax(-1) * draft_logits.log_softmax(-1)).sum(-1)  # (N,)
        if n:
            total = feat.mean() + self.config.ce_weight * ce.mean()
        else:  # keeps every parameter in the graph (DDP) without adding anything
            total = pred.sum() * 0.0
        k = min(self.config.topk, draft_logits.shape[-1])
        top1, topk = topk_hits(draft_logits, target_logits.argmax(-1), k)
        stats = {
            "loss": stat_pair(total.detach(), 1, device),
            "feat_loss": stat_pair(feat.detach().sum(), n, device),
            "ce": stat_pair(ce.detach().sum(), n, device),
            "top1": stat_pair(top1, n, device),
            f"top{k}": stat_pair(topk, n, device),
            # the first drafted token's accuracy, the same quantity as Medusa's head0
            "head0/top1": stat_pair(top1, n, device),
            f"head0/top{k}": stat_pair(topk, n, device),
        }
        return LossOutput(total, stats)

    # ---- checkpoints ---------------------------------------------------------------------

    def init_from(self, tensors: dict[str, Tensor], source: str) -> list[str]:
        return warm_start(self, tensors, source)

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, target, doc: dict | None = None,
        allow_other_target: bool = False,
    ):  # fmt: skip
        """Load onto `target` (the one it was trained on); the CE then uses the full vocab."""
        config, info = open_head(cls, path, target, doc, allow_other_target)
        head = cls(
            config,
            info,
            LayerSpec.from_hf_config(target.model.config),
            target.embed_tokens.weight,
            target.lm_head.weight,
        )
        load_weights(head, load_head_tensors(path), path)
        return head


# ---- helpers shared with heads/eagle3.py ---------------------------------------------------


def check_shapes(info: TargetInfo, embed_weight: Tensor, lm_head_weight: Tensor) -> None:
    want = (info.vocab_size, info.hidden_size)
    for name, w in (("embedding", embed_weight), ("lm_head", lm_head_weight)):
        if tuple(w.shape) != want:
            raise ValueError(f"target {name} weight {tuple(w.shape)} != (vocab, hidden) {want}")


def topk_hits(logits: Tensor, labels: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """How many rows have `labels` as their argmax, and within their top k: (hits@1, hits@k)."""
    if logits.shape[0] == 0:
        zero = logits.new_zeros(())
        return zero, zero
    top = logits.topk(k, dim=-1).indices  # (N, k)
    hit = top == labels[:, None]
    return hit[:, 0].sum().float(), hit.any(-1).sum().float()
