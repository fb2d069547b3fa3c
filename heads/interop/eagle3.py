"""An EAGLE-3 draft in vllm-project/speculators' layout (`Eagle3Speculator`), which speculators
trains and vLLM serves (`vllm serve DIR`: the config names the verifier).

The config (speculators src/speculators/models/eagle3/config.py, read at c05b95b) holds the
draft layer's HF config under `transformer_layer_config` and beside it `draft_vocab_size`,
`norm_before_residual`, `norm_before_fc`, EAGLE-3.1's `fc_norm` and `norm_output`,
`target_hidden_size`, `eagle_aux_hidden_state_layer_ids` (HF hidden_states indices, vLLM's
convention) and `speculators_config` (algorithm, greedy proposal, verifier). The tensors are the
engines' eagle3 layout's: unprefixed `fc`, `fc_norm.{i}`, `layers.0.*`, `norm`, `lm_head`, `d2t`,
`t2d` (no maps for a full-vocabulary draft). The verifier is what `vllm serve DIR` loads as the
target: the exporter may name the local folder the target came from. speculators also saves
`embed_tokens` (the verifier's, frozen); we leave it out, as its loader allows, and drop it on
import after checking it is the target's. vLLM's speculators reader takes a missing
`norm_before_residual` as true, so the export always writes it.
"""

from __future__ import annotations

from heads.eagle3 import Eagle3Head

SPECULATORS_EAGLE3_ARCH = "Eagle3Speculator"
# speculators' own fields beside the layer config (what the flat engine layout keeps top-level)
EAGLE3_FIELDS = (
    "draft_vocab_size",
    "norm_before_residual",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
    "target_hidden_size",
    "eagle_aux_hidden_state_layer_ids",
)


def speculators_eagle3_config(head: Eagle3Head, target, layer_keys: dict, version: str) -> dict:
    """The config.json of speculators' Eagle3Speculator layout (its tensors are the eagle3
    layout's, export.py `eagle3_tensors`); `layer_keys` is the draft layer's Llama config
    (export.py `_llama_keys`)."""
    hf = target.model.config
    layer = {k: v for k, v in layer_keys.items() if k != "torch_dtype"}
    config = {
        "architectures": [SPECULATORS_EAGLE3_ARCH],
        "speculators_model_type": "eagle3",
        "speculators_version": version,
        "transformer_layer_config": layer,
        "draft_vocab_size": head.draft_vocab_size,
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": bool(head.config.fc_norm),
        "norm_output": bool(head.config.norm_output),
        "target_hidden_size": target.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(head.config.aux_layers),
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": head.config.ttt_steps,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": target.name_or_path,
                # a model built in memory has no architectures recorded: its class is it
                "architectures": list(
                    getattr(hf, "architectures", None) or [type(target.model).__name__]
                ),
            },
        },
        "torch_dtype": layer_keys["torch_dtype"],
    }
    return config


def is_speculators_eagle3(doc: dict) -> bool:
    archs = doc.get("architectures") or []
    return doc.get("speculators_model_type") == "eagle3" or SPECULATORS_EAGLE3_ARCH in archs


def flat_eagle3_doc(doc: dict) -> dict:
    """A speculators Eagle3 config as the flat engine layout's config (the layer config's keys
    top-level, then speculators' EAGLE-3 fields), which the eagle3 importer reads."""
    flat = dict(doc.get("transformer_layer_config") or {})
    flat |= {k: doc[k] for k in EAGLE3_FIELDS if k in doc}
    flat.setdefault("norm_before_residual", False)  # speculators' default (vLLM's is true)
    if "draftsmith" in doc:
        flat["draftsmith"] = doc["draftsmith"]
    return flat
