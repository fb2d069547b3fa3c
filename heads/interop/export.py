"""Writing a head in a serving engine's layout (see heads/interop/__init__.py for the formats)."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
from torch import Tensor

from heads.base import CONFIG_NAME, atomic_save_dir, save_safetensors
from heads.dflash import DFlashHead
from heads.draft_layer import LayerSpec
from heads.eagle import EagleHead
from heads.eagle3 import Eagle3Head
from heads.folder import check_target
from heads.interop.dflash import SPECULATORS_VERSION, export_speculators, export_zlab, mask_note
from heads.interop.eagle3 import speculators_eagle3_config
from heads.interop.formats import ENGINE_VERSIONS, FORMATS, MEDUSA_FD_WEIGHTS, WEIGHTS_NAME
from heads.medusa import MedusaHeads

log = logging.getLogger(__name__)

# ---- export ----------------------------------------------------------------------------------


def formats_for(head) -> tuple[str, ...]:
    """The formats `head` can be written in (its class's `export_formats`)."""
    return tuple(type(head).export_formats)


def export_draft(head, target, fmt: str, out_dir, verifier: str | None = None) -> dict:
    """Write `head` (trained on `target`) as `fmt` into `out_dir` (replaced atomically);
    returns the config.json written.

    verifier: speculators only, what its config names as the verifier
    (`speculators_config.verifier.name_or_path`, which `vllm serve DIR` loads as the target):
    the local folder the target was loaded from, so the export serves offline (the Hub id a
    shipped or GGUF target records needs the network); None: the target's recorded name (a Hub
    id, for an export pushed to the Hub)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}.")
    fits = formats_for(head)
    if fmt not in fits:
        why = type(head).export_note or f"the formats that fit it: {', '.join(fits)}"
        raise ValueError(f"a {head.method!r} head cannot be exported as {fmt!r}: {why}.")
    check_target(head.target_info, target, "the head being exported", type(head).target_dims)
    if fmt == "native":
        head.save_pretrained(out_dir)
        return json.loads((Path(out_dir) / CONFIG_NAME).read_text())
    config, tensors, filename, extra = _EXPORTERS[fmt](head, target)
    if fmt == "speculators" and verifier is not None:
        config["speculators_config"]["verifier"]["name_or_path"] = str(verifier)
    config["draftsmith"] = {
        "format": fmt,
        "targets": ENGINE_VERSIONS[fmt],
        "base_model": target.name_or_path,
        "target_fingerprint": target.fingerprint,
        "method": head.method,
        "head_config": dataclasses.asdict(head.config),
    }
    dtype = _head_dtype(head)
    # own contiguous copies: safetensors refuses tensors that share memory
    tensors = {
        k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous().clone()
        for k, v in tensors.items()
    }

    def write(tmp: Path) -> None:
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        save_safetensors(tensors, tmp / filename, {"format": "pt"})
        for name, obj in extra.items():  # e.g. DFlash's mask_embedding.pt, a torch.save'd dict
            torch.save(obj, tmp / name)

    atomic_save_dir(out_dir, write)
    return config


def serve_commands(fmt: str, base: str, repo: str, config: dict) -> list[str]:
    """Shell commands that serve `base` with the draft at `repo` exported as `fmt`."""
    if fmt in ("eagle3", "eagle"):  # vLLM's method name, SGLang's algorithm name
        spec = json.dumps({"method": fmt, "model": repo, "num_speculative_tokens": 4})
        return [
            f"vllm serve {base} --speculative-config '{spec}'",
            f"python -m sglang.launch_server --model-path {base} --speculative-algorithm "
            f"{fmt.upper()} --speculative-draft-model-path {repo} --speculative-num-steps 4 "
            "--speculative-eagle-topk 4 --speculative-num-draft-tokens 16",
        ]
    if fmt == "medusa":
        k = int(config.get("num_heads", 4))
        spec = json.dumps({"method": "medusa", "model": repo, "num_speculative_tokens": k})
        return [f"vllm serve {base} --speculative-config '{spec}'   # vLLM <= 0.32.x"]
    if fmt == "medusa_fd":
        return [f"python -m medusa.inference.cli --model {repo}   # FasterDecoding/Medusa"]
    if fmt == "dflash":
        block = int(config.get("block_size", 8))
        spec = json.dumps({"method": "dflash", "model": repo, "num_speculative_tokens": block - 1})
        return [
            f"vllm serve {base} --speculative-config '{spec}'",
            f"python -m sglang.launch_server --model-path {base} --speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {repo} --speculative-num-draft-tokens {block}",
            f"python convert_hf_to_gguf.py {repo} --target-model-dir TARGET_DIR --outfile "
            "draft.gguf   # llama.cpp's converter, then:",
            f"llama-server -m TARGET.gguf -md draft.gguf --spec-type draft-dflash "
            f"--spec-draft-n-max {block - 1}",
        ]
    if fmt == "speculators":
        return [f"vllm serve {repo}   # speculators format: the config names the verifier"]
    return [
        f"python evaluate.py head_path={repo} bench=mt_bench   # draftsmith's harness",
        f"python train.py +experiment=... init_from={repo}   # continue training",
    ]


def export_notes(head, fmt: str) -> list[str]:
    """Caveats of `head` exported as `fmt` that a user of the export must read (model card)."""
    note = mask_note(head, fmt)
    return [note] if note else []


def _head_dtype(head) -> torch.dtype:
    floats = [t for t in list(head.parameters()) + list(head.buffers()) if t.is_floating_point()]
    return floats[0].dtype if floats else torch.float32


def _llama_keys(head, target) -> dict:
    """The Llama config keys of the draft's layers (geometry and rope as the head was built);
    an EAGLE-3 draft may stack more than one (vLLM builds them; SGLang refuses more than one)."""
    spec: LayerSpec = head.spec
    hf = target.model.config
    hf = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    rope = dict(spec.rope_parameters)
    rope.setdefault("rope_theta", float(getattr(hf, "rope_theta", 10000.0)))
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    keys = {
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",  # the draft layer's MLP is SwiGLU whatever the target uses
        "rms_norm_eps": spec.rms_norm_eps,
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": float(getattr(hf, "initializer_range", 0.02)),
        "num_hidden_layers": len(head.layers),
        "vocab_size": target.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": None if scaling.get("rope_type", "default") == "default" else scaling,
        "rope_parameters": rope,
        "torch_dtype": str(_head_dtype(head)).removeprefix("torch."),
    }
    for name in ("bos_token_id", "eos_token_id"):
        if getattr(hf, name, None) is not None:
            keys[name] = getattr(hf, name)
    return keys


def engine_default_aux_layers(num_layers: int) -> list[int]:
    """vLLM's and SGLang's EAGLE-3 capture layers when the draft config names none."""
    return [2, num_layers // 2, num_layers - 3]


def _check_three_aux_layers(head: Eagle3Head) -> None:
    aux = list(head.config.aux_layers)
    if len(aux) != 3:
        raise ValueError(
            f"head.aux_layers={aux}: vLLM's and SGLang's EAGLE-3 drafts fuse exactly 3 target "
            "layers (fc is 3H wide); train with 3 aux_layers, or use --format native."
        )


def _export_eagle3(head: Eagle3Head, target):
    _check_three_aux_layers(head)
    aux = list(head.config.aux_layers)
    config = {"architectures": ["LlamaForCausalLMEagle3"], **_llama_keys(head, target)}
    config["draft_vocab_size"] = head.draft_vocab_size
    config["norm_before_residual"] = False
    # EAGLE-3.1 switches, read by vLLM's and SGLang's llama_eagle3 (fc_norm.{i}.weight tensors)
    config["fc_norm"] = bool(head.config.fc_norm)
    config["norm_output"] = bool(head.config.norm_output)
    if aux != engine_default_aux_layers(target.num_layers):
        # vLLM reads HF hidden_states indices; SGLang captures layer id + 1, hence the - 1.
        config["eagle_aux_hidden_state_layer_ids"] = aux
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux]}
    return config, eagle3_tensors(head), WEIGHTS_NAME, {}


def eagle3_tensors(head: Eagle3Head) -> dict[str, Tensor]:
    """The head's tensors as the engines' eagle3 layouts hold them. A draft over the whole target
    vocabulary writes no d2t / t2d: its mapping is the identity, and vLLM builds no
    draft_id_to_target_id for it, so it refuses a checkpoint that has one (the importers and
    llama.cpp's converter take a missing d2t as the identity)."""
    tensors = dict(head.state_dict())
    if head.draft_vocab_size >= head.target_info.vocab_size:
        tensors.pop("d2t", None)
        tensors.pop("t2d", None)
    return tensors


def _export_eagle(head: EagleHead, target):
    if head.config.input_norm:
        raise ValueError(
            "this EAGLE head normalises its layer input (head.input_norm=true), but vLLM and "
            "SGLang drop layer 0's input_layernorm: it would propose differently there. Train "
            "with head.input_norm=false to export as 'eagle', or use --format native."
        )
    # vLLM's llama_eagle lists LlamaForCausalLM (mapped to EagleLlamaForCausalLM); SGLang takes
    # the first architecture it knows, LlamaForCausalLMEagle.
    config = {"architectures": ["LlamaForCausalLMEagle", "LlamaForCausalLM"]}
    config |= _llama_keys(head, target)
    tensors = dict(head.state_dict())
    tensors.setdefault("fc.bias", torch.zeros(head.target_info.hidden_size))
    if bool(tensors["fc.bias"].any()):
        log.warning(
            "eagle export: SGLang applies fc.bias; vLLM's EagleLlamaForCausalLM builds fc without "
            "a bias and skips it, so vLLM's proposals differ slightly from this head's."
        )
    return config, tensors, WEIGHTS_NAME, {}


def _medusa_blocks(head: MedusaHeads, name) -> dict[str, Tensor]:
    out = {}
    for h in range(head.config.num_heads):
        for i in range(head.config.num_layers):
            linear = head.blocks[h][i].linear
            out[name(h, i, "weight")] = linear.weight
            out[name(h, i, "bias")] = linear.bias
    return out


def _export_medusa(head: MedusaHeads, target):
    c, V, D = head.config, target.vocab_size, head.draft_vocab_size
    tensors = _medusa_blocks(head, lambda h, i, p: f"blocks.{h}.layers.{i}.{p}")
    if c.share_lm_head:  # vLLM's original_lm_head reads lm_heads.0 only, for every head
        tensors["lm_heads.0.weight"] = head.shared_proj
    else:
        tensors |= {f"lm_heads.{h}.weight": head.proj[h] for h in range(c.num_heads)}
    if D < V:  # vLLM scatters the D logits onto the target vocab at token_map
        tensors["token_map"] = head.draft_to_target(torch.arange(D, device=head.d2t.device))
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": head.target_info.hidden_size,
        "vocab_size": V,
        "num_heads": c.num_heads,
        "num_hidden_layers": c.num_layers,
        "truncated_vocab_size": D,
        "original_lm_head": bool(c.share_lm_head),
        "medusa_fc_bias": True,
    }
    return config, tensors, WEIGHTS_NAME, {}


def _export_medusa_fd(head: MedusaHeads, target):
    c = head.config
    if head.draft_vocab_size < target.vocab_size:
        raise ValueError(
            f"FasterDecoding's Medusa heads project onto the full vocabulary, but this head "
            f"scores {head.draft_vocab_size} of {target.vocab_size} tokens. Use --format medusa "
            "(vLLM, with a token_map), or train with head.draft_vocab_size=null."
        )
    if c.num_layers > 1:
        log.warning(
            "medusa_fd: FasterDecoding's own MedusaModel builds [ResBlock] * n (one shared "
            "block); text-generation-inference and TensorRT-LLM load the %d blocks apart.",
            c.num_layers,
        )
    tensors = _medusa_blocks(head, lambda h, i, p: f"{h}.{i}.linear.{p}")
    for h in range(c.num_heads):  # shared heads get their own copy of the target's rows
        tensors[f"{h}.{c.num_layers}.weight"] = head.projection(h)
    config = {
        "medusa_num_heads": c.num_heads,
        "medusa_num_layers": c.num_layers,
        "base_model_name_or_path": target.name_or_path,
    }
    return config, tensors, MEDUSA_FD_WEIGHTS, {}


def _export_dflash(head: DFlashHead, target):
    config, tensors, extra = export_zlab(head, target)
    return config, tensors, WEIGHTS_NAME, extra


def _export_speculators(head: DFlashHead | Eagle3Head, target):
    if isinstance(head, Eagle3Head):
        _check_three_aux_layers(head)
        keys = _llama_keys(head, target)
        config = speculators_eagle3_config(head, target, keys, SPECULATORS_VERSION)
        return config, eagle3_tensors(head), WEIGHTS_NAME, {}
    config, tensors, extra = export_speculators(head, target)
    return config, tensors, WEIGHTS_NAME, extra


_EXPORTERS = {
    "eagle3": _export_eagle3,
    "eagle": _export_eagle,
    "medusa": _export_medusa,
    "medusa_fd": _export_medusa_fd,
    "dflash": _export_dflash,
    "speculators": _export_speculators,
}
