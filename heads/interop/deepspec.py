"""Reading DeepSpec's draft checkpoints (deepseek-ai/DeepSpec `Qwen3DSparkModel`) as DSparkHeads.

DeepSpec trains DSpark and its DFlash with one model class, and both are anchor-sampled: the block
is [anchor, MASK x (B-1)] at positions a .. a+B-1 and slot k predicts x_{a+k+1}, so all B slots
draft. That is our DSparkHead; a DFlash checkpoint (`markov_rank` 0, no confidence head) is a
DSparkHead with markov_rank=0.

The folder (`deepspec/modeling/dspark/qwen3/config.py` `build_draft_config`, and
`deepspec/trainer/ckpt_manager.py`, which saves the whole state dict):
- config.json: a deep copy of the target's Qwen3 config with `architectures
  ["Qwen3DSparkModel"]`, `num_target_layers`, `num_hidden_layers` (draft layers), `block_size`,
  `mask_token_id`, `target_layer_ids` (top level; id i = HF hidden_states[i + 1], ours too),
  `num_anchors`, `enable_confidence_head`, `confidence_head_with_markov` (only with the
  confidence head), `markov_rank`, `markov_head_type` (only when the rank is above 0).
- tensors: `embed_tokens` and `lm_head` (frozen copies of the target's), `layers.*`, `fc`,
  `hidden_norm`, `norm` (z-lab's names), `markov_head.markov_w1 [V, r]`, `markov_head.markov_w2
  [V, r]` (Linear(r, V): the full vocabulary), `confidence_head.proj.{weight [1, H + r], bias}`.

MASK: DeepSpec embeds the block with its own embed_tokens, a frozen copy of the target's, so
its MASK is the mask token's row of the target's table: learn_mask=false reproduces it exactly.
If that row differs from the target's (a checkpoint whose mask row was changed), the row is taken
as a learned MASK vector (learn_mask=true), exact for the MASK slots (an anchor that is itself
the mask token is still embedded with the target's row); every other row must equal the
target's.
"""

from __future__ import annotations

from heads.base import HeadMismatchError
from heads.dspark import MARKOV_HEAD_TYPES, DSparkConfig, DSparkHead
from heads.interop.checks import drop_target_copy
from heads.interop.dflash import _block_size, _build, _check_sizes, _layer_ids, _mask_row, _spec_for

DEEPSPEC_ARCHS = ("Qwen3DSparkModel",)
FORMAT = "deepspec"


def _refuse(path, text: str):
    raise HeadMismatchError(f"{path}: a DeepSpec draft ({DEEPSPEC_ARCHS[0]}): {text}")


def _int(doc: dict, key: str, path) -> int:
    value = doc.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        _refuse(path, f"config.json has no integer {key!r}; download or save the draft again.")
    return value


def _heads(doc: dict, path) -> tuple[int, bool]:
    """(markov_rank, enable_confidence_head) after refusing what DSparkHead cannot represent."""
    rank = int(doc.get("markov_rank") or 0)
    if rank < 0:
        _refuse(path, f"markov_rank={rank} is negative; the config is damaged.")
    kind = doc.get("markov_head_type", "vanilla") if rank > 0 else "vanilla"
    if kind not in MARKOV_HEAD_TYPES:
        _refuse(
            path,
            f"markov_head_type={kind!r}: DSparkHead implements {', '.join(MARKOV_HEAD_TYPES)} "
            "only (the bias from the previous token alone); serve this draft in DeepSpec itself.",
        )
    confidence = bool(doc.get("enable_confidence_head", False))
    if confidence and rank == 0:
        _refuse(
            path,
            "a confidence head without a Markov head (markov_rank=0): DSparkHead's confidence "
            "head reads [h; markov_w1(prev)]; serve this draft in DeepSpec itself.",
        )
    if confidence and doc.get("confidence_head_with_markov") is False:
        _refuse(
            path,
            "its confidence head reads the hidden state only (confidence_head_with_markov="
            "false), while DSparkHead's reads [h; markov_w1(prev)]; serve it in DeepSpec itself.",
        )
    return rank, confidence


def _layers(doc: dict, target, path) -> list[int]:
    ids = doc.get("target_layer_ids")
    if not isinstance(ids, list) or not ids:
        _refuse(path, "config.json has no target_layer_ids list; download or save it again.")
    if -1 in ids:  # DeepSpec's common.py: id -1 is the embedding output
        _refuse(
            path,
            f"target_layer_ids {ids} include -1 (the target's embeddings), which draftsmith's "
            "context does not read (ids name decoder-layer outputs).",
        )
    return _layer_ids(ids, target, path, "target_layer_ids")


def import_deepspec(doc, tensors, target, path) -> DSparkHead:
    """A DeepSpec `Qwen3DSparkModel` folder as a DSparkHead on `target` (full vocabulary; the
    target's embedding and lm_head, whose copies in the file must equal the target's)."""
    _check_sizes(doc, tensors, target, path, doc)  # hidden and vocabulary sizes
    recorded = doc.get("num_target_layers")
    if recorded is not None and int(recorded) != target.num_layers:
        _refuse(
            path,
            f"it was made for a {recorded}-layer target, and {target.name_or_path!r} has "
            f"{target.num_layers}: load it onto the model it was trained for.",
        )
    spec, width = _spec_for(doc, target, path)  # the layer geometry, no biases, full attention
    rank, confidence = _heads(doc, path)
    mask_id = _int(doc, "mask_token_id", path)
    if not 0 <= mask_id < target.vocab_size:
        _refuse(path, f"mask_token_id {mask_id} is outside the target's {target.vocab_size} ids.")
    drop_target_copy(tensors, "lm_head.weight", target.lm_head.weight, path)
    vector = _mask_row(tensors, target, mask_id, doc, path)  # pops embed_tokens
    fields = {
        "num_layers": _int(doc, "num_hidden_layers", path),
        "block_size": _block_size(doc, path),
        "target_layer_ids": _layers(doc, target, path),
        "mask_token_id": mask_id,
        "learn_mask": vector is not None,
        "mask_vector": vector,
        "intermediate_size": width,
        "markov_rank": rank,
        "enable_confidence_head": confidence,
    }
    if isinstance(doc.get("num_anchors"), int):
        fields["num_anchors"] = doc["num_anchors"]
    if rank == 0:  # DeepSpec's DFlash configs (config/dflash/*.py): CE only
        fields |= {"ce_weight": 1.0, "l1_weight": 0.0}
    return _build(doc, tensors, target, path, FORMAT, spec, config_class=DSparkConfig, **fields)


__all__ = ["DEEPSPEC_ARCHS", "import_deepspec"]
