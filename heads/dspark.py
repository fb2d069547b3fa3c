"""DSpark block drafter (DeepSeek's DeepSpec; also trained by SpecForge and speculators): the DFlash
backbone (heads/dflash.py) with three changes.

- Sample from the anchor. The block is still [anchor, MASK x (B-1)] at positions a .. a+B-1, but
  slot k (0 <= k < B) scores x_{a+k+1}: every slot drafts, so one forward proposes B tokens.
- A low-rank Markov head ("vanilla"): slot k's logits get a bias that depends only on the token
  before it, b(prev_k) = markov_w2(markov_w1(prev_k)) with markov_w1 = Embedding(V, r) over the
  target vocabulary and markov_w2 = Linear(r, D) onto the draft vocabulary. prev_0 is the anchor;
  prev_k is x_{a+k} in training (the data's token) and the token drafted at slot k-1 in drafting.
  So the backbone runs once per block and only this rank-r bias is applied slot by slot: the
  block's tokens are no longer independent of each other, at almost no cost. markov_rank=0
  drops it (and the confidence head): DeepSpec's DFlash, an anchor-sampled DFlash backbone.
- A confidence head: sigmoid(proj([h_k; markov_w1(prev_k)])), h_k the block's normed output at
  slot k, estimates the chance that slot k's token is accepted given that the slots before it
  were. Drafting stops before the first slot whose confidence is below `confidence_threshold`
  (0, the default: never), so a step proposes 0..B tokens.

Loss (DeepSpec `deepspec/modeling/dspark/loss.py`, SpecForge's `OnlineDSparkModel`): per scored
slot, ce_weight * CE(label) + l1_weight * sum_v |q(v) - p(v)| + confidence_weight *
BCE(confidence logit, 1 - TV(q, p)), q the draft's distribution (Markov bias included) and p the
target's distribution for the same token, TV = half the L1 distance (the chance that speculative
sampling rejects the draft token), taken without gradient as the confidence head's target. Slot k
weighs exp(-k / gamma) (or D-PACE weights from the CE), and the sum is divided by the sum of the
weights. Only the contiguous run of labelled slots from the anchor counts: a chain cannot step over
a token that is not a label.

`loss` reports `tau_estimate` (each block's 1 + sum_k prod_{j<=k} (1 - TV_j): what speculative
sampling at temperature 1 would accept, not greedy decoding); validation (`validate`, as DFlash's)
adds `chain_tau_est`: the tau greedy chain decoding measures on the target's own greedy text
(docs/reports/2026-12-03-dspark-gap/README.md).

Drafting (eval/engine/block_proposer.py) goes through `draft_chain`: one backbone forward, then the
Markov walk (greedy or sampled, reporting the exact distribution each token was drawn from, so
that verification stays lossless). Verification is a chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from heads.base import BlockDrafter, LossOutput, TargetInfo, stat_pair
from heads.block_training import block_labels, position_weights, sample_anchors, slot_stats
from heads.dflash import DFlashConfig, DFlashHead
from heads.draft_layer import LayerSpec

MARKOV_HEAD_TYPES = ("vanilla",)


@dataclass
class DSparkConfig(DFlashConfig):
    # B: the anchor plus B-1 MASK slots; every slot drafts, so a forward proposes B tokens
    # (DeepSpec's released drafts use 7, the same depth as a DFlash block of 8).
    block_size: int = 7
    # r: rank of the Markov bias. DeepSpec uses 256 on 4B-14B targets (V = 151k); its tables hold
    # 2 V r weights, so on SmolLM2-135M (V = 49k, a 2-layer backbone of ~7M weights) 64 keeps them
    # (6.3M) the backbone's size instead of 3.5 times it, within what a short run can fit.
    # 0: no Markov head, the anchor-sampled DFlash of DeepSpec's config/dflash/*.py (needs
    # enable_confidence_head=false: the confidence head reads the Markov embedding).
    markov_rank: int = 64
    markov_head_type: str = "vanilla"  # the only type here (and the only one llama.cpp reads)
    enable_confidence_head: bool = True
    # Stop a block before its first slot whose confidence is below this (0: never cut).
    confidence_threshold: float = 0.0
    ce_weight: float = 0.1  # hard-label cross-entropy
    l1_weight: float = 0.9  # sum_v |q - p| = 2 TV (DeepSpec's "l1" term and scale)
    confidence_weight: float = 1.0  # BCE of the confidence head against 1 - TV
    gamma: float | None = 4.0  # slot k (0-based) weighs exp(-k / gamma)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.loss != "ce":
            raise ValueError(
                f"head.loss={self.loss!r} is DFlash's option; DSpark's loss is ce_weight * CE + "
                "l1_weight * L1(draft, target) + confidence_weight * BCE: set those weights "
                "(and leave head.loss at ce)."
            )
        if self.markov_rank < 0:
            raise ValueError(
                f"head.markov_rank={self.markov_rank}: use 1 or more (64 suits a 135M target), "
                "or 0 for no Markov head."
            )
        if self.markov_rank == 0 and self.enable_confidence_head:
            raise ValueError(
                "head.markov_rank=0 (no Markov head) with the confidence head, which reads "
                "[h; markov_w1(prev)]: set head.enable_confidence_head=false, or a rank of 1 or "
                "more."
            )
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(
                f"head.markov_head_type={self.markov_head_type!r}: only "
                f"{', '.join(MARKOV_HEAD_TYPES)} is implemented."
            )
        if not 0.0 <= self.confidence_threshold <= 1.0:
            raise ValueError(
                f"head.confidence_threshold={self.confidence_threshold}: it is a probability; "
                "use a value in [0, 1] (0: never cut a block)."
            )
        if self.confidence_threshold > 0 and not self.enable_confidence_head:
            raise ValueError(
                "head.confidence_threshold > 0 needs the confidence head: set "
                "head.enable_confidence_head=true, or the threshold to 0."
            )
        weights = {
            "ce_weight": self.ce_weight,
            "l1_weight": self.l1_weight,
            "confidence_weight": self.confidence_weight,
        }
        if any(w < 0 for w in weights.values()) or self.ce_weight + self.l1_weight <= 0:
            raise ValueError(
                f"head loss weights {weights}: use non-negative weights, with ce_weight + "
                "l1_weight > 0 (DeepSpec: 0.1, 0.9, 1.0)."
            )


class MarkovHead(nn.Module):
    """The vanilla low-rank bigram bias: prev ids (...,) -> (..., r) -> (..., D).

    markov_w2 starts at zero, so an untrained head drafts exactly like its backbone (and
    markov_w1 still gets gradients once markov_w2 moves, as in LoRA)."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        nn.init.zeros_(self.markov_w2.weight)

    def embed(self, prev: Tensor) -> Tensor:
        """Target-vocabulary ids (...,) -> (..., r)."""
        return self.markov_w1(prev)

    def bias(self, embedding: Tensor) -> Tensor:
        """(..., r) -> (..., D) float logit bias."""
        return self.markov_w2(embedding).float()


class ConfidenceHead(nn.Module):
    """Logit of the chance a slot is accepted, from [h_k; markov_w1(prev_k)] (H + r)."""

    def __init__(self, hidden_size: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1)

    def forward(self, hidden: Tensor, embedding: Tensor) -> Tensor:
        """hidden (..., H), embedding (..., r) -> (...,) float logits."""
        features = torch.cat([hidden, embedding.to(hidden.dtype)], dim=-1)
        return self.proj(features.to(self.proj.weight.dtype)).float()[..., 0]


class DSparkHead(DFlashHead):
    """DSpark: DFlash's backbone sampled from the anchor, plus a Markov bias and a confidence
    head."""

    method = "dspark"
    runtime_settings = ("confidence_threshold",)
    config_class = DSparkConfig
    title = "DSpark block drafter"
    hub_tag = "dspark"
    export_formats = ("native", "speculators")
    export_note = ""
    drafting = BlockDrafter

    def __init__(
        self,
        config: DSparkConfig,
        target_info: TargetInfo,
        spec: LayerSpec,
        embed_weight: Tensor,
        lm_head_weight: Tensor,
        draft_ids: Tensor | None = None,
    ):
        super().__init__(config, target_info, spec, embed_weight, lm_head_weight, draft_ids)
        r = config.markov_rank
        self.markov_head = None  # rank 0: the backbone's logits alone (DeepSpec's DFlash)
        if r > 0:
            self.markov_head = MarkovHead(target_info.vocab_size, self.draft_vocab_size, r)
        self.confidence_head = None
        if config.enable_confidence_head:
            self.confidence_head = ConfidenceHead(target_info.hidden_size, r)

    @property
    def max_draft_depth(self) -> int:
        return self.block_size  # every slot drafts

    # ---- the pieces shared by training and drafting --------------------------------------

    def markov_embed(self, prev: Tensor) -> Tensor | None:
        """Previous tokens' Markov embeddings (...,) -> (..., r); None without a Markov head."""
        return None if self.markov_head is None else self.markov_head.embed(prev)

    def slot_logits(self, hidden: Tensor, embedding: Tensor | None) -> Tensor:
        """Float draft-vocabulary logits of block slots: normed outputs (..., H) plus the Markov
        bias of their previous tokens' embeddings (..., r) (none at rank 0) -> (..., D)."""
        logits = self.logits(hidden).float()
        if embedding is None:
            return logits
        return logits + self.markov_head.bias(embedding)

    def confidence(self, hidden: Tensor, embedding: Tensor) -> Tensor:
        """The confidence logits (...,) of block slots (needs the confidence head)."""
        return self.confidence_head(hidden, embedding)

    # ---- drafting (eval/engine/block_proposer.py) -----------------------------------------------

    def draft_block(self, anchor: Tensor, position: Tensor, cache) -> Tensor:
        """The block's logits along its own greedy chain: (B, block_size, D) float, row d-1
        scoring the token d places after the anchor, with the Markov bias of the argmax token
        before it (the anchor for row 0). The cache is read, not changed."""
        hidden = self.block_hidden(anchor, position, cache)  # (B, Bk, H)
        prev = anchor.to(hidden.device)
        rows = []
        for k in range(self.block_size):
            z = self.slot_logits(hidden[:, k], self.markov_embed(prev))  # (B, D)
            rows.append(z)
            prev = self.draft_to_target(z.argmax(-1))
        return torch.stack(rows, dim=1)

    def draft_chain(
        self,
        root: Tensor,
        position: Tensor,
        cache,
        depth: int,
        draft_temperature: float | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Draft a chain of at most `depth` tokens after `root` (1,) at `position` (1,).

        One backbone forward over the block, then slot by slot: add the Markov bias of the
        previous token (the root, then each drafted token), stop before the first slot whose
        confidence is below `confidence_threshold`, take the argmax (draft_temperature None) or
        sample from softmax(logits / T) with `generator` (CPU).
        Returns (tokens (L,) target ids, probs (L, V) or None), L <= min(depth, block_size);
        probs row i is the distribution (over the target vocabulary) token i was drawn from.
        """
        if root.numel() != 1:
            raise ValueError(f"draft_chain drafts one sequence; got {root.numel()} roots.")
        depth = min(int(depth), self.block_size)
        hidden = self.block_hidden(root.reshape(1), position.reshape(1), cache)[0]  # (Bk, H)
        threshold = self.config.confidence_threshold
        V = self.target_info.vocab_size
        prev = root.reshape(()).to(hidden.device)
        tokens: list[Tensor] = []
        dists: list[Tensor] = []
        for k in range(depth):
            embedding = self.markov_embed(prev)  # (r,) or None
            if threshold > 0:
                chance = torch.sigmoid(self.confidence(hidden[k], embedding))
                if float(chance) < threshold:
                    break  # this slot and every later one are cut
            z = self.slot_logits(hidden[k], embedding)  # (D,)
            if draft_temperature is None:
                pick = z.argmax()
            else:
                q = torch.softmax(z / draft_temperature, dim=-1).cpu()
                pick = torch.multinomial(q, 1, generator=generator)[0].to(z.device)
                dists.append(q)
            prev = self.draft_to_target(pick)
            tokens.append(prev)
        out = torch.stack(tokens) if tokens else torch.zeros(0, dtype=torch.long)
        out = out.to(hidden.device)
        if draft_temperature is None:
            return out, None
        probs = torch.zeros(len(dists), V)
        if dists:
            ids = self.draft_to_target(torch.arange(self.draft_vocab_size, device=hidden.device))
            probs[:, ids.cpu()] = torch.stack(dists)
        return out, probs

    # ---- training ------------------------------------------------------------------------

    def teacher_forced(
        self,
        batch: dict[str, Tensor],
        features: dict[str, Tensor],
        anchors: Tensor,
        valid: Tensor,
        in_vocab: bool = True,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """The scored slots of the blocks at `anchors` (B, N) (`valid` (B, N)), each slot's
        Markov bias taken from the data's previous token (the anchor for slot 0).

        Returns (ok (B, N, Bk) bool: the slots scored, the labelled run from each anchor, cut
        at the first label outside the draft vocabulary unless `in_vocab` is False;
        labels (B, N, Bk) target ids, x_{a+k+1}; logits (n, D) float and confidence logits (n,)
        (None without the confidence head) of the ok slots in order)."""
        hidden = self.train_blocks(batch, features, anchors)  # (B, N, Bk, H): every slot drafts
        offsets = list(range(1, self.block_size + 1))  # slot k predicts x_{a+k+1}
        vocab = self.t2d if in_vocab else torch.ones_like(self.t2d)
        labels, ok = block_labels(batch, anchors, valid, offsets, vocab)
        ok = ok.long().cumprod(-1).bool()  # a chain cannot step over a token that is no label
        anchor_ids = torch.gather(batch["input_ids"].to(anchors.device), 1, anchors)  # (B, N)
        prev = torch.cat([anchor_ids[..., None], labels[..., :-1]], dim=-1)  # (B, N, Bk)
        rows = hidden[ok]  # (n, H)
        embedding = self.markov_embed(prev[ok])  # (n, r) or None
        logits = self.slot_logits(rows, embedding)
        conf = None if self.confidence_head is None else self.confidence(rows, embedding)
        return ok, labels, logits, conf

    @torch.no_grad()
    def drafted_chains(
        self,
        batch: dict[str, Tensor],
        features: dict[str, Tensor],
        anchors: Tensor,
        valid: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """The Markov walk `draft_chain` takes from each block where the tokens before each slot
        are the data's (its own drafted ones wherever the slots before were right), cut before
        the first slot whose confidence is below `confidence_threshold` as drafting cuts it:
        (tokens (B, N, Bk) target ids, -1 where not drafted; run (B, N, Bk), as DFlash's)."""
        run, labels, logits, conf = self.teacher_forced(batch, features, anchors, valid, False)
        tokens = torch.full_like(labels, -1)
        tokens[run] = self.draft_to_target(logits.argmax(-1))
        threshold = self.config.confidence_threshold
        if threshold > 0:
            low = torch.zeros_like(run)
            low[run] = torch.sigmoid(conf) < threshold
            tokens[low.long().cumsum(-1) > 0] = -1  # this slot and every later one are cut
        return tokens, run

    def loss(self, batch: dict[str, Tensor], features: dict[str, Tensor]) -> LossOutput:
        device = self.fc.weight.device
        batch = {k: v.to(device) for k, v in batch.items()}
        cfg = self.config
        anchors, valid = sample_anchors(batch, cfg.num_anchors)
        ok, labels, logits, conf = self.teacher_forced(batch, features, anchors, valid)
        want = self.target_to_draft(labels[ok])
        offsets = list(range(1, self.block_size + 1))
        target = self.target_probs(features, anchors, offsets, ok)  # (n, D), no gradient
        terms = dspark_terms(logits, want, target, conf, cfg)
        per_slot = torch.zeros(ok.shape, device=device, dtype=terms.total.dtype)
        per_slot[ok] = terms.total
        ce_slot = torch.zeros(ok.shape, device=device, dtype=terms.ce.dtype)
        ce_slot[ok] = terms.ce.detach()
        weights = position_weights(ce_slot, ok, 0, cfg)  # exp(-k/gamma), or D-PACE from the CE
        # every parameter stays in the graph (DDP) even when nothing counts
        total = sum(p.sum() for p in self.parameters() if p.requires_grad) * 0.0
        if bool(ok.any()):
            total = total + (per_slot * weights).sum() / weights.sum().clamp(min=1e-12)
        stats = slot_stats(per_slot, logits, want, ok, cfg.topk, first_slot=1)  # by depth
        stats.update(_term_stats(terms, ok, device))
        stats["loss"] = stat_pair(total.detach(), 1, device)
        return LossOutput(total, stats)


@dataclass
class SlotTerms:
    """DSpark's loss terms per scored slot, (n,) each."""

    total: Tensor  # ce_weight * ce + l1_weight * l1 + confidence_weight * bce
    ce: Tensor
    l1: Tensor  # sum_v |q(v) - p(v)| = 2 TV
    accept: Tensor  # 1 - TV, clamped to [0, 1], without gradient
    bce: Tensor | None


def dspark_terms(
    logits: Tensor, want: Tensor, target: Tensor, conf: Tensor | None, config: DSparkConfig
) -> SlotTerms:
    """logits (n, D) float, want (n,) draft ids, target (n, D) the target's distributions,
    conf (n,) confidence logits or None -> the per-slot terms."""
    ce = F.cross_entropy(logits, want, reduction="none")
    l1 = (logits.softmax(-1) - target).abs().sum(-1)
    accept = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)
    total = config.ce_weight * ce + config.l1_weight * l1
    bce = None
    if conf is not None:
        bce = F.binary_cross_entropy_with_logits(conf, accept, reduction="none")
        total = total + config.confidence_weight * bce
    return SlotTerms(total, ce, l1, accept, bce)


def _term_stats(terms: SlotTerms, ok: Tensor, device) -> dict[str, Tensor]:
    """Means of the terms over scored slots, and each block's expected accept length under its
    own estimate (`tau_estimate`: 1 + sum_k prod_{j<=k} (1 - TV_j), the bonus token included).

    `tau_estimate` is not what greedy decoding measures (`chain_tau_est` is, heads/acceptance.py):
    1 - TV is the chance speculative *sampling* at temperature 1 accepts a sampled token, against
    the target renormalised over the draft vocabulary (its mass outside is ignored); blocks whose
    first label is outside the draft vocabulary are left out (decoding rejects there); and every
    anchor counts once, where decoding queries only after each round's bonus token."""
    n = int(ok.sum())
    stats = {
        "ce": stat_pair(terms.ce.detach().sum(), n, device),
        "tv": stat_pair(0.5 * terms.l1.detach().sum(), n, device),
    }
    chance = torch.zeros(ok.shape, device=device)
    chance[ok] = terms.accept.float()
    blocks = ok[..., 0]
    expected = 1.0 + chance.cumprod(-1).sum(-1)  # zero past the scored run
    stats["tau_estimate"] = stat_pair(expected[blocks].sum(), int(blocks.sum()), device)
    if terms.bce is not None:
        stats["confidence/bce"] = stat_pair(terms.bce.detach().sum(), n, device)
    return stats


__all__ = [
    "ConfidenceHead",
    "DSparkConfig",
    "DSparkHead",
    "MarkovHead",
    "SlotTerms",
    "dspark_terms",
]
