"""`head.init_from_target` for EAGLE-3 (heads/eagle3.py): the draft layer starts as the target's
own decoder layer that reads the deepest fused feature, instead of from random weights.

With aux layers [a, b, c] (HF hidden_states indices; hidden_states[c] is what decoder layer c
reads), the starting draft is:
- fc selects hidden_states[c] (identity on its slot, zero on the others), so the draft's residual
  stream starts as that layer's real input;
- hidden_norm is layer c's input norm and the hidden half of q/k/v is layer c's q/k/v, so the
  context keys and values a draft attends to are, at step one, the ones layer c computes itself;
- the embedding half of q/k/v starts at zero (trained from there: the token just drafted enters
  attention as the draft learns to use it), and the embeddings' input norm as layer 0's;
- o_proj, the MLP and post_attention_layernorm are layer c's, and the final norm is the target's
  (lm_head's rows are the target's already), so the first logits have the target's scale.
- with `num_layers` > 1, draft layer i (a plain layer) is a whole copy of target layer c + i
  (the last target layer where c + i runs past it), so the stack starts as the target's own
  layers above c.

What the draft must learn is then the shift by one position (it predicts x_{t+2} from the state
at t and the token x_{t+1}) rather than attention and MLP weights from nothing. Biases of a
target's projections (Qwen2's q/k/v) are dropped: the draft layer has none.
"""

from __future__ import annotations

import torch


def _decoder_layers(target):
    layers = getattr(getattr(target.model, "base_model", None), "layers", None)
    if layers is None:
        raise ValueError(
            "head.init_from_target needs a target whose base model has decoder `layers` "
            "(Llama/Qwen-style); set head.init_from_target=false."
        )
    return layers


@torch.no_grad()
def init_eagle3_from_target(head, target) -> int:
    """Overwrite `head`'s fc, norms and draft layer as the module docstring says; returns the
    index of the target decoder layer copied."""
    layers = _decoder_layers(target)
    aux = list(head.config.aux_layers)
    deepest = max(aux)
    index = min(deepest, len(layers) - 1)
    src = layers[index]
    H = head.target_info.hidden_size
    head.fc.weight.zero_()
    slot = aux.index(deepest)
    head.fc.weight[:, slot * H : (slot + 1) * H] = torch.eye(H)
    mine = head.layers[0]
    mine.hidden_norm.weight.copy_(src.input_layernorm.weight.float())
    mine.input_layernorm.weight.copy_(layers[0].input_layernorm.weight.float())
    for name in ("q_proj", "k_proj", "v_proj"):
        weight = getattr(mine.self_attn, name).weight  # (out, 2H): [embeddings | hidden]
        weight.zero_()
        weight[:, H:] = getattr(src.self_attn, name).weight.float()
    mine.self_attn.o_proj.weight.copy_(src.self_attn.o_proj.weight.float())
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(mine.mlp, name).weight.copy_(getattr(src.mlp, name).weight.float())
    mine.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight.float())
    for offset, layer in enumerate(head.layers[1:], 1):  # num_layers > 1: the layers above c
        _copy_plain_layer(layer, layers[min(index + offset, len(layers) - 1)])
    final = getattr(target.model.base_model, "norm", None)
    if final is not None and final.weight.shape == head.norm.weight.shape:
        head.norm.weight.copy_(final.weight.float())
    return index


def _copy_plain_layer(mine, src) -> None:
    """A plain draft layer as a copy of target decoder layer `src` (biases dropped)."""
    mine.input_layernorm.weight.copy_(src.input_layernorm.weight.float())
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        getattr(mine.self_attn, name).weight.copy_(getattr(src.self_attn, name).weight.float())
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(mine.mlp, name).weight.copy_(getattr(src.mlp, name).weight.float())
    mine.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight.float())


__all__ = ["init_eagle3_from_target"]
