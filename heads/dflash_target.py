"""What a DFlash draft takes from its target (heads/dflash.py): the target layers whose features
it fuses, the token that stands for MASK, the final norm its outputs start from, and with
`init_from_target` its draft layers' starting weights."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor


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


def with_target_settings(config, target):
    """`config` (a DFlashConfig) with its nulls resolved for `target`: target_layer_ids one per
    draft layer (build_target_layer_ids) and mask_token_id a spare special token
    (default_mask_token); ids outside the target, or no usable mask token, are refused."""
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
    return dataclasses.replace(config, target_layer_ids=list(ids), mask_token_id=int(mask))


@torch.no_grad()
def init_norm_from_target(head, target) -> None:
    """The frozen lm_head was trained on the target's final norm: start the draft's norm there,
    so that its first logits have the target's scale (all-ones gave a CE of 19)."""
    final = getattr(getattr(target.model, "base_model", None), "norm", None)
    weight = getattr(final, "weight", None)
    if isinstance(weight, Tensor) and weight.shape == head.norm.weight.shape:
        head.norm.weight.copy_(weight.detach().float())


def _projection_gain(weight: Tensor, input_gain: Tensor, head_dim: int) -> Tensor:
    """Per-dimension RMS (head_dim,) of a projection's heads for an input RMS-normed with gain
    `input_gain`: sqrt(sum_j W[r, j]^2 g_j^2), averaged over the heads. A q_norm / k_norm with
    this weight keeps the scale the target's un-normed queries/keys had."""
    rows = (weight.float().pow(2) * input_gain.float().pow(2)).sum(-1).sqrt()  # (heads * d,)
    return rows.view(-1, head_dim).mean(0)


@torch.no_grad()
def init_from_target_layers(head, target) -> None:
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
    "build_target_layer_ids",
    "default_mask_token",
    "init_from_target_layers",
    "init_norm_from_target",
    "with_target_settings",
]
