"""Medusa-2: Medusa heads trained jointly with a LoRA adapter on the target (Cai et al., 2024,
section 2.3.2, "Medusa-2").

Medusa-1 keeps the target frozen, so its heads can only read what the target's last hidden state
already says about tokens further ahead. Medusa-2 lets the backbone move a little: a PEFT LoRA
adapter on the target is trained together with the heads, and a quality term keeps the adapted
target close to the original:

- `quality="kl"` (default, for self-distilled data): KL(original || adapted) between the frozen
  original's next-token distribution (the adapter switched off) and the adapted one, at the
  positions whose next token is an assistant token;
- `quality="lm"`: the usual next-token cross-entropy on the data's tokens (human-written data).

loss = lm_weight * quality + head_weight * (Medusa-1 head losses on the adapted hidden states).

What this changes for the rest of the system:
- the head *adapts the target it is built for or loaded onto*: LoRA layers are injected into
  `target.model` in place (PEFT), so decoding with the head uses the adapted target, as Medusa-2
  intends, and every method benchmarked next to it (plain, HF generate) runs the adapted target;
- the head computes its own features (with gradients through the adapter), so it declares
  `uses_target_features = False` and the loop feeds it plain token batches;
- its folder holds the heads and the adapter tensors in model.safetensors, plus `adapter/`, the
  same adapter in PEFT's own layout (`PeftModel.from_pretrained(base, DIR/adapter)`).
  `merge_into_target()` folds the adapter into the target's weights (faster decoding).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from heads.base import (
    HeadFolderMixin,
    HeadMismatchError,
    LossOutput,
    ParallelDrafter,
    TargetInfo,
    label_mask,
    segment_causal_mask,
    stat_pair,
    warm_start,
)
from heads.folder import load_head_tensors, load_weights, open_head, saved_tensor
from heads.medusa import MedusaConfig, MedusaHeads
from heads.vocab import frequent_ids, saved_draft_ids

ADAPTER_PREFIX = "adapter."
QUALITY = ("kl", "lm")


@dataclass
class Medusa2Config(MedusaConfig):
    lora_rank: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    quality: str = "kl"  # "kl": stay close to the frozen original; "lm": data's next token
    lm_weight: float = 1.0
    head_weight: float = 0.2  # Medusa-2's paper weights the heads' loss down against the LM's
    adapter_lr: float | None = None  # null: trainer.lr; usually lower than the heads'

    def __post_init__(self) -> None:
        super().__post_init__()
        self.lora_target_modules = [str(m) for m in self.lora_target_modules]  # from Hydra too
        if self.quality not in QUALITY:
            raise ValueError(f"head.quality={self.quality!r}: use one of {list(QUALITY)}.")
        if self.lora_rank < 1 or self.lora_alpha <= 0:
            raise ValueError(
                f"head.lora_rank={self.lora_rank}, head.lora_alpha={self.lora_alpha}: need a "
                "rank >= 1 and alpha > 0."
            )
        if not self.lora_target_modules:
            raise ValueError("head.lora_target_modules is empty: name the target's linear layers.")
        if self.lm_weight < 0 or self.head_weight <= 0:
            raise ValueError("head.lm_weight must be >= 0 and head.head_weight > 0.")
        if self.adapter_lr is not None and self.adapter_lr <= 0:
            raise ValueError(f"head.adapter_lr={self.adapter_lr}: use a positive lr or null.")


class Medusa2Head(HeadFolderMixin, nn.Module):
    """Medusa heads + a LoRA adapter on `target.model` (injected in place; see module doc)."""

    method = "medusa2"
    config_class = Medusa2Config
    title = "Medusa-2 heads (with a LoRA adapter on the target)"
    hub_tag = "medusa"
    export_formats = ("native",)
    export_note = (
        "it trained a LoRA adapter into its target, and a serving engine would run the "
        "un-adapted target under these heads. Merge the adapter (head.merge_into_target()), save "
        "the merged target model and serve that, exporting head.medusa (plain Medusa heads) for "
        "it; or use --format native"
    )
    drafting = ParallelDrafter
    uses_target_features = False  # it runs the adapted target itself, with gradients
    adapts_target = True  # loading it injects LoRA into the target's model
    target_dims = ("hidden_size", "vocab_size")

    def __init__(self, config: Medusa2Config, target, draft_ids: Tensor | None = None):
        super().__init__()
        self.config = config
        self.target_info = TargetInfo.of(target)
        self.medusa = MedusaHeads(config, self.target_info, target.lm_head.weight, draft_ids)
        self.adapted = _inject_lora(target, config)  # a submodule: holds the target's model
        self.lm_head = target.lm_head  # frozen (the target's)

    @classmethod
    def for_target(cls, config: Medusa2Config, target, token_counts: Tensor | None = None):
        draft_ids = frequent_ids(target, config.draft_vocab_size, token_counts, "draft_vocab_size")
        return cls(config, target, draft_ids)

    # ---- what the proposer and the loop read -------------------------------------------------

    @property
    def draft_vocab_size(self) -> int:
        return self.medusa.draft_vocab_size

    @property
    def max_draft_depth(self) -> int:
        return self.medusa.max_draft_depth

    def feature_layers(self) -> list[int] | None:
        return None

    def forward(self, hidden: Tensor) -> Tensor:
        return self.medusa(hidden)

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        return self.medusa.draft_to_target(draft_ids)

    def init_from(self, tensors: dict[str, Tensor], source: str) -> list[str]:
        """Warm-start the heads from a saved Medusa-1 (or Medusa-2) head's tensors: the Medusa-2
        recipe trains the heads alone first, then joins the adapter. A Medusa-2 head's adapter
        tensors are not taken: the adapter starts fresh (the target unchanged)."""
        tensors = {k: v for k, v in tensors.items() if not _is_adapter(k)}
        return warm_start(self.medusa, tensors, source)

    def param_lr(self, name: str) -> float | None:
        """The adapter's own learning rate (train/optim.py groups parameters by it)."""
        return self.config.adapter_lr if "lora_" in name else None

    # ---- training ----------------------------------------------------------------------------

    def _backbone(self) -> nn.Module:
        return self.adapted.get_base_model().base_model  # the decoder stack, without lm_head

    def loss(self, batch: dict[str, Tensor], features: dict[str, Tensor]) -> LossOutput:
        ids = batch["input_ids"]
        # packed rows: a block-diagonal causal 4-D mask and positions restarting per conversation
        packed = segment_causal_mask(batch.get("segment_ids"))
        inputs = dict(input_ids=ids, use_cache=False)
        if packed is None:
            inputs["attention_mask"] = batch.get("attention_mask", torch.ones_like(ids))
        else:
            inputs.update(attention_mask=packed, position_ids=batch["position_ids"])
        backbone = self._backbone()
        hidden = backbone(**inputs).last_hidden_state
        heads = self.medusa.loss(batch, {"hidden": hidden})
        valid = label_mask(batch, 1)  # position t: x_{t+1} is an assistant token
        n = int(valid.sum())
        stats = dict(heads.stats)
        quality = hidden.new_zeros(())
        lm_head = self.lm_head
        if n:
            logp = lm_head(hidden[valid]).float().log_softmax(-1)  # (N, V)
            if self.config.quality == "kl":
                with torch.no_grad(), self.adapted.disable_adapter():
                    ref = backbone(**inputs)
                    ref_logp = lm_head(ref.last_hidden_state[valid]).float().log_softmax(-1)
                per_pos = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
                agree = (logp.argmax(-1) == ref_logp.argmax(-1)).sum()
                stats["lm/agree_original"] = stat_pair(agree, n, ids.device)
            else:
                labels = torch.zeros_like(ids)
                labels[:, :-1] = ids[:, 1:]
                per_pos = -logp.gather(-1, labels[valid][:, None])[:, 0]
            quality = per_pos.mean()
            stats[f"lm/{self.config.quality}"] = stat_pair(per_pos.sum().detach(), n, ids.device)
        total = self.config.lm_weight * quality + self.config.head_weight * heads.loss
        stats["loss"] = stat_pair(total.detach(), 1, ids.device)
        return LossOutput(total, stats)

    # ---- files -------------------------------------------------------------------------------

    def adapter_state(self) -> dict[str, Tensor]:
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(self.adapted)

    def folder_tensors(self) -> dict[str, Tensor]:
        tensors = dict(self.medusa.state_dict())
        return tensors | {ADAPTER_PREFIX + k: v for k, v in self.adapter_state().items()}

    def write_beside(self, folder: Path) -> None:
        self.adapted.save_pretrained(str(folder / "adapter"))  # PEFT's own layout too

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, target, doc: dict | None = None,
        allow_other_target: bool = False,
    ):  # fmt: skip
        """Load the heads and adapt `target` with the saved adapter (in place)."""
        from peft import set_peft_model_state_dict

        config, _ = open_head(cls, path, target, doc, allow_other_target)
        tensors = load_head_tensors(path)
        draft_ids = saved_draft_ids(saved_tensor(tensors, "d2t", path))
        head = cls(config, target, draft_ids)
        adapter = {k[len(ADAPTER_PREFIX) :]: v for k, v in tensors.items() if _is_adapter(k)}
        load_weights(head.medusa, {k: v for k, v in tensors.items() if not _is_adapter(k)}, path)
        result = set_peft_model_state_dict(head.adapted, adapter)
        missing = [k for k in result.missing_keys if "lora_" in k]
        if missing or result.unexpected_keys:
            raise HeadMismatchError(
                f"{path}: the adapter does not fit this target (missing {missing[:3]}, "
                f"unexpected {list(result.unexpected_keys)[:3]}); load it onto the model it was "
                "trained on."
            )
        return head

    def merge_into_target(self) -> None:
        """Fold the adapter into the target's weights: decoding then costs what plain does.
        After this the original cannot be recovered from this process's target."""
        self.adapted.merge_adapter()


def _is_adapter(key: str) -> bool:
    return key.startswith(ADAPTER_PREFIX)


def _inject_lora(target, config: Medusa2Config):
    from peft import LoraConfig, get_peft_model

    if is_adapted(target):
        raise ValueError(
            f"the target {target.name_or_path!r} already carries a Medusa-2 adapter: load a "
            "fresh target for a second Medusa-2 head."
        )
    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=list(config.lora_target_modules),
        bias="none",
    )
    try:
        adapted = get_peft_model(target.model, lora)
    except ValueError as err:
        raise ValueError(
            f"LoRA could not attach to {target.name_or_path!r} ({err}); set "
            "head.lora_target_modules to linear layer names of this model."
        ) from None
    adapted.eval()
    # A plain attribute (not a registered submodule: that would make a cycle), so a second
    # Medusa-2 head on the same target finds it and refuses.
    target.model.__dict__[_MARK] = True
    return adapted


_MARK = "_draftsmith_medusa2_adapted"


def is_adapted(target) -> bool:
    """Whether a Medusa-2 head has put its adapter into this target's model."""
    return bool(target.model.__dict__.get(_MARK))


__all__ = ["Medusa2Config", "Medusa2Head", "is_adapted"]
