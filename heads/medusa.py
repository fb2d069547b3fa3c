"""Medusa-1 heads (Cai et al., 2024, "Medusa: Simple LLM Inference Acceleration Framework with
Multiple Decoding Heads").

K extra heads sit on the frozen target's last hidden state h_t (after the final norm). The target's
own lm_head already predicts x_{t+1}; head k (0-based) predicts x_{t+k+2}, so at decode time the
heads fill depths 1..K of a tree whose root is the target's own next token. Each head is
`num_layers` residual blocks x + SiLU(W x + b) (W, b zero-initialised, so an untrained head starts
as the target's next-token distribution) followed by a vocabulary projection that is either the
head's own (initialised from the target's lm_head rows) or the target's frozen lm_head, shared.
With `draft_vocab_size` the projection scores only the D most frequent training tokens (d2t/t2d
as in heads/vocab.py), which is what makes training and drafting cheap on a CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from heads.base import (
    HeadFolderMixin,
    LossOutput,
    ParallelDrafter,
    TargetInfo,
    label_mask,
    stat_pair,
    warm_start,
)
from heads.folder import load_head_tensors, load_weights, open_head, saved_tensor
from heads.vocab import d2t_t2d, draft_to_target, frequent_ids, saved_draft_ids, target_to_draft


@dataclass
class MedusaConfig:
    num_heads: int = 4
    num_layers: int = 1
    decay: float = 0.8  # head k's loss weight is decay**k
    share_lm_head: bool = False  # True: project with the target's frozen lm_head (small ckpt)
    draft_vocab_size: int | None = None  # None: the full target vocabulary
    topk: int = 5  # the "top-k" accuracy reported next to top-1
    # Train against the target's own next-token distribution instead of the data's tokens.
    soft_targets: bool = False

    def __post_init__(self) -> None:
        if self.num_heads < 1:
            raise ValueError(f"head.num_heads={self.num_heads}: need at least one head.")
        if self.num_layers < 0:
            raise ValueError(f"head.num_layers={self.num_layers}: use 0 or more residual blocks.")
        if not 0 < self.decay <= 1:
            raise ValueError(f"head.decay={self.decay}: use a weight in (0, 1].")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError("head.draft_vocab_size must be positive, or null for the full vocab.")


class ResBlock(nn.Module):
    """x + SiLU(W x + b), zero-initialised so the block starts as the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(HeadFolderMixin, nn.Module):
    """K Medusa heads over one target. forward: (..., H) -> logits (K, ..., D)."""

    method = "medusa"
    config_class = MedusaConfig
    title = "Medusa-1 heads"
    hub_tag = "medusa"
    export_formats = ("native", "medusa", "medusa_fd")
    export_note = ""
    drafting = ParallelDrafter
    uses_target_features = True
    adapts_target = False
    target_dims = ("hidden_size", "vocab_size")

    def __init__(
        self,
        config: MedusaConfig,
        target_info: TargetInfo,
        lm_head_weight: Tensor,
        draft_ids: Tensor | None = None,
    ):
        super().__init__()
        self.config = config
        self.target_info = target_info
        H, V = target_info.hidden_size, target_info.vocab_size
        if tuple(lm_head_weight.shape) != (V, H):
            raise ValueError(f"lm_head weight {tuple(lm_head_weight.shape)} != ({V}, {H})")
        if draft_ids is None:
            draft_ids = torch.arange(V)
        d2t, t2d = d2t_t2d(draft_ids, V)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(H) for _ in range(config.num_layers)])
            for _ in range(config.num_heads)
        )
        rows = lm_head_weight.detach()
        rows = rows if draft_ids.numel() == V else rows[draft_ids]
        if config.soft_targets:  # the teacher: the target's frozen rows, never saved
            self.register_buffer("teacher_proj", rows.clone(), persistent=False)
        if config.share_lm_head:
            # Frozen and not saved: rebuilt from the target's lm_head on load.
            self.register_buffer("shared_proj", rows.clone(), persistent=False)
            self.proj = None
        else:
            self.proj = nn.ParameterList(
                nn.Parameter(rows.clone().float()) for _ in range(config.num_heads)
            )

    @classmethod
    def for_target(cls, config: MedusaConfig, target, token_counts: Tensor | None = None):
        """New heads for `target`; a reduced vocab needs label counts from the training data."""
        draft_ids = frequent_ids(target, config.draft_vocab_size, token_counts, "draft_vocab_size")
        return cls(config, TargetInfo.of(target), target.lm_head.weight, draft_ids)

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.numel())

    @property
    def max_draft_depth(self) -> int:
        return self.config.num_heads  # head k drafts depth k + 1

    def feature_layers(self) -> list[int] | None:
        return None

    def init_from(self, tensors: dict[str, Tensor], source: str) -> list[str]:
        return warm_start(self, tensors, source)

    def projection(self, k: int) -> Tensor:
        return self.shared_proj if self.proj is None else self.proj[k]

    def head_logits(self, k: int, hidden: Tensor) -> Tensor:
        """Logits of head k over the draft vocab: (..., H) -> (..., D)."""
        return self.blocks[k](hidden) @ self.projection(k).t().to(hidden.dtype)

    def forward(self, hidden: Tensor) -> Tensor:
        dtype = self.blocks[0][0].linear.weight.dtype if self.config.num_layers else hidden.dtype
        hidden = hidden.to(dtype)
        return torch.stack([self.head_logits(k, hidden) for k in range(self.config.num_heads)])

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_to_target(draft_ids, self.d2t)

    def target_to_draft(self, target_ids: Tensor) -> Tensor:
        return target_to_draft(target_ids, self.t2d)

    def loss(self, batch: dict[str, Tensor], features: dict[str, Tensor]) -> LossOutput:
        """Weighted loss of every head over the positions whose label is an assistant token.

        Only those positions are projected onto the vocabulary, which is most of the cost.
        Hard targets: CE against the data's token t+k+2. Soft targets (`soft_targets`): CE
        against the target's own distribution for that token given the same prefix,
        softmax(lm_head(h_{t+k+1})) over the draft vocabulary, i.e. distillation of exactly what
        verification will check. In packed rows a label must lie in the position's own
        conversation (`label_mask`).
        """
        hidden = features["hidden"].to(self.d2t.device).float()  # (B, T, H)
        total = hidden.new_zeros(())
        stats: dict[str, Tensor] = {}
        for k in range(self.config.num_heads):
            valid = label_mask(batch, k + 2)  # (B, T): label x_{t+k+2} in the conversation
            loss_k, stats_k = self._head_loss(k, hidden, batch["input_ids"], valid)
            total = total + self.config.decay**k * loss_k
            stats.update(stats_k)
        stats["loss"] = stat_pair(total.detach(), 1, hidden.device)
        return LossOutput(total, stats)

    def _head_loss(self, k: int, hidden: Tensor, ids: Tensor, valid: Tensor):
        """valid (B, T): positions whose label t + k + 2 is an assistant token of their own
        conversation."""
        shift, T, dev = k + 2, ids.shape[1], hidden.device
        labels = torch.zeros_like(ids)
        labels[:, : T - shift] = ids[:, shift:]
        draft_labels = self.target_to_draft(labels[valid])  # (N,), -1 outside the draft vocab
        n, kk = int(valid.sum()), min(self.config.topk, self.draft_vocab_size)
        names = ["loss", "top1", f"top{kk}"] + (["agree"] if self.config.soft_targets else [])
        if n == 0:
            return hidden.new_zeros(()), {f"head{k}/{m}": stat_pair(0.0, 0, dev) for m in names}
        logits = self.head_logits(k, hidden[valid])  # (N, D)
        inside = draft_labels >= 0
        stats = {}
        if self.config.soft_targets:
            ahead = torch.zeros_like(hidden)
            ahead[:, : T - k - 1] = hidden[:, k + 1 :]  # h_{t+k+1}: what the target sees
            # detached: the teacher is a target, never pushed towards the heads (Medusa-2 adapts it)
            teacher = (ahead[valid] @ self.teacher_proj.t().float()).softmax(-1).detach()
            per_pos = -(teacher * logits.log_softmax(-1)).sum(-1)
            loss_sum, n_loss = per_pos.sum(), n
            agree = logits.argmax(-1) == teacher.argmax(-1)
            stats[f"head{k}/agree"] = stat_pair(agree.sum(), n, dev)
        else:
            ce = F.cross_entropy(logits, draft_labels.clamp(min=0), reduction="none")
            loss_sum, n_loss = (ce * inside).sum(), int(inside.sum())
        top = logits.topk(kk, dim=-1).indices
        hit = (top == draft_labels[:, None]) & inside[:, None]
        stats[f"head{k}/loss"] = stat_pair(loss_sum.detach(), n_loss, dev)
        stats[f"head{k}/top1"] = stat_pair(hit[:, 0].sum(), n, dev)
        stats[f"head{k}/top{kk}"] = stat_pair(hit.any(-1).sum(), n, dev)
        return (loss_sum / n_loss if n_loss else loss_sum * 0), stats

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, target, doc: dict | None = None,
        allow_other_target: bool = False,
    ):  # fmt: skip
        config, info = open_head(cls, path, target, doc, allow_other_target)
        tensors = load_head_tensors(path)
        draft_ids = saved_draft_ids(saved_tensor(tensors, "d2t", path))
        heads = cls(config, info, target.lm_head.weight, draft_ids)
        load_weights(heads, tensors, path)
        return heads
