"""Export draft heads to the folders serving engines load, and import such folders back.

Formats (`FORMATS`), each a folder with `config.json` and one weights file:
- `native`: draftsmith's own folder (`save_pretrained`), any head.
- `eagle3`: an EAGLE-3 draft for vLLM (`--speculative-config '{"method":"eagle3","model":DIR,
  "num_speculative_tokens":K}'`) and SGLang (`--speculative-algorithm EAGLE3
  --speculative-draft-model-path DIR`): `LlamaForCausalLMEagle3`, unprefixed `fc`, `layers.0.*`,
  `norm`, `lm_head` [D, H], `d2t`, `t2d`; no `embed_tokens` (the engines use the target's).
- `eagle`: an EAGLE-1/2 draft for the engines' EAGLE-1 Llama classes: `fc` (with bias) and
  `layers.0.*` without input_layernorm (both engines replace it by the identity). Architectures
  `[LlamaForCausalLMEagle, LlamaForCausalLM]`: SGLang takes the first, and vLLM renames each to
  `Eagle{arch}` and takes the first it knows, `EagleLlamaForCausalLM`.
- `medusa`: vLLM's `MedusaModel` (vllm/model_executor/models/medusa.py, last in vLLM 0.32.x):
  `blocks.{h}.layers.{l}`, `lm_heads.{h}`, and `token_map` for a reduced vocabulary.
- `medusa_fd`: FasterDecoding/Medusa's `medusa_lm_head` layout (also what text-generation-inference
  and TensorRT-LLM read): `{h}.{l}.linear.*` residual blocks, `{h}.{num_layers}.weight`, in
  `medusa_lm_head.safetensors` (FasterDecoding's own MedusaModel.from_pretrained reads a torch.save
  of the same dict, `medusa_lm_head.pt`).

`import_draft` reads any of these (and SafeAILab / SpecForge EAGLE checkpoints: `midlayer.*`,
`pytorch_model.bin`, a `model.` prefix) into our head classes, onto a given target.
Medusa-2 heads adapt the target with LoRA, which no engine applies: only `native` is offered.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from heads.base import CONFIG_NAME, HeadMismatchError, TargetInfo, atomic_save_dir, check_target
from heads.draft_layer import LayerSpec
from heads.eagle import EagleConfig, EagleHead
from heads.eagle3 import Eagle3Config, Eagle3Head, default_aux_layers
from heads.medusa import MedusaConfig, MedusaHeads
from heads.medusa2 import Medusa2Head
from heads.vocab import d2t_t2d, saved_draft_ids

log = logging.getLogger(__name__)

FORMATS = ("native", "eagle3", "eagle", "medusa", "medusa_fd")
# The engine releases each layout was checked against (also written into config.json).
ENGINE_VERSIONS = {
    "eagle3": {"vllm": "0.33", "sglang": "0.5.23"},
    "eagle": {"vllm": "0.33", "sglang": "0.5.23"},
    "medusa": {"vllm": "0.32"},
    "medusa_fd": {"FasterDecoding/Medusa": "main"},
}
WEIGHTS_NAME = "model.safetensors"
MEDUSA_FD_WEIGHTS = "medusa_lm_head.safetensors"  # what FasterDecoding's train.py and TGI use
WEIGHT_FILES = (WEIGHTS_NAME, MEDUSA_FD_WEIGHTS, "pytorch_model.bin", "medusa_lm_head.pt")


# ---- export ----------------------------------------------------------------------------------


def formats_for(head) -> tuple[str, ...]:
    """The formats `head` can be written in."""
    if isinstance(head, Medusa2Head):  # not a MedusaHeads subclass, but checked first anyway
        return ("native",)
    if isinstance(head, Eagle3Head):
        return ("native", "eagle3")
    if isinstance(head, EagleHead):
        return ("native", "eagle")
    if isinstance(head, MedusaHeads):
        return ("native", "medusa", "medusa_fd")
    raise TypeError(f"no export for a {type(head).__name__}; known heads: Eagle, Eagle3, Medusa.")


def export_draft(head, target, fmt: str, out_dir) -> dict:
    """Write `head` (trained on `target`) as `fmt` into `out_dir` (replaced atomically);
    returns the config.json written."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}.")
    fits = formats_for(head)
    if fmt not in fits:
        if isinstance(head, Medusa2Head):
            raise ValueError(
                f"a Medusa-2 head cannot be exported as {fmt!r}: it trained a LoRA adapter into "
                "its target, and a serving engine would run the un-adapted target under these "
                "heads. Merge the adapter (head.merge_into_target()), save the merged target "
                "model and serve that, exporting head.medusa (plain Medusa heads) for it; or use "
                "--format native."
            )
        raise ValueError(
            f"a {type(head).__name__} cannot be exported as {fmt!r}; formats that fit it: "
            f"{', '.join(fits)}."
        )
    check_target(head.target_info, target, "the head being exported")
    if fmt == "native":
        head.save_pretrained(out_dir)
        return json.loads((Path(out_dir) / CONFIG_NAME).read_text())
    config, tensors, filename = _EXPORTERS[fmt](head, target)
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
        save_file(tensors, str(tmp / filename), metadata={"format": "pt"})

    atomic_save_dir(out_dir, write)
    return config


def _head_dtype(head) -> torch.dtype:
    floats = [t for t in list(head.parameters()) + list(head.buffers()) if t.is_floating_point()]
    return floats[0].dtype if floats else torch.float32


def _llama_keys(head, target) -> dict:
    """The Llama config keys of the one draft layer (geometry and rope as the head was built)."""
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
        "num_hidden_layers": 1,
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


def _export_eagle3(head: Eagle3Head, target):
    aux = list(head.config.aux_layers)
    if len(aux) != 3:
        raise ValueError(
            f"head.aux_layers={aux}: vLLM's and SGLang's EAGLE-3 drafts fuse exactly 3 target "
            "layers (fc is 3H wide); train with 3 aux_layers, or use --format native."
        )
    config = {"architectures": ["LlamaForCausalLMEagle3"], **_llama_keys(head, target)}
    config["draft_vocab_size"] = head.draft_vocab_size
    config["norm_before_residual"] = False
    if aux != engine_default_aux_layers(target.num_layers):
        # vLLM reads HF hidden_states indices; SGLang captures layer id + 1, hence the - 1.
        config["eagle_aux_hidden_state_layer_ids"] = aux
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux]}
    return config, dict(head.state_dict()), WEIGHTS_NAME


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
    return config, tensors, WEIGHTS_NAME


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
    return config, tensors, WEIGHTS_NAME


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
    return config, tensors, MEDUSA_FD_WEIGHTS


_EXPORTERS = {
    "eagle3": _export_eagle3,
    "eagle": _export_eagle,
    "medusa": _export_medusa,
    "medusa_fd": _export_medusa_fd,
}


# ---- reading folders -------------------------------------------------------------------------


def read_config(path) -> dict:
    cfg = Path(path) / CONFIG_NAME
    if not cfg.is_file():
        raise FileNotFoundError(f"{cfg} not found: a draft folder holds config.json and weights.")
    return json.loads(cfg.read_text())


def weights_file(path) -> Path:
    for name in WEIGHT_FILES:
        if (Path(path) / name).is_file():
            return Path(path) / name
    raise FileNotFoundError(f"{path}: no weights file; expected one of {', '.join(WEIGHT_FILES)}.")


def load_tensors(path) -> dict[str, Tensor]:
    """The folder's tensors under our names: no `model.` / `medusa_heads.` prefix, `midlayer.`
    (SafeAILab / SpecForge EAGLE-3) read as `layers.0.`."""
    file = weights_file(path)
    if file.suffix == ".safetensors":
        raw = load_file(str(file))
    else:
        raw = torch.load(str(file), map_location="cpu", weights_only=True)
    return {_our_name(k): v for k, v in raw.items()}


def _our_name(name: str) -> str:
    for prefix in ("model.", "medusa_heads."):
        name = name.removeprefix(prefix)
    return "layers.0." + name[len("midlayer.") :] if name.startswith("midlayer.") else name


def _tensor_names(path) -> set[str]:
    file = weights_file(path)
    if file.suffix == ".safetensors":
        with safe_open(str(file), framework="pt") as f:
            return {_our_name(k) for k in f.keys()}
    return set(load_tensors(path))


def detect_format(path) -> str:
    """Which of FORMATS a folder holds, from its config.json (and tensor names if needed)."""
    doc = read_config(path)
    archs = doc.get("architectures") or []
    if "method" in doc:
        return "native"
    if "medusa_num_heads" in doc:
        return "medusa_fd"
    if doc.get("model_type") == "medusa" or "MedusaModel" in archs:
        return "medusa"
    if any(a.startswith("Eagle3") or a.endswith("Eagle3") for a in archs):
        return "eagle3"
    if any(a in ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM") for a in archs):
        return "eagle"
    names = _tensor_names(path)  # checkpoints listed as plain LlamaForCausalLM (SafeAILab)
    if {"d2t", "layers.0.hidden_norm.weight"} & names:
        return "eagle3"
    if "fc.weight" in names:
        return "eagle"
    if any(n.startswith("blocks.") for n in names):
        return "medusa"
    if any(re.fullmatch(r"\d+\.\d+\.(linear\.)?weight", n) for n in names):
        return "medusa_fd"
    raise ValueError(
        f"{path}: unknown draft format (architectures {archs}, tensors like {sorted(names)[:4]}); "
        f"draftsmith reads {', '.join(FORMATS)}."
    )


# ---- import ----------------------------------------------------------------------------------


def import_draft(path, target):
    """Load a folder in any of FORMATS onto `target` as one of our heads (EagleHead,
    Eagle3Head, MedusaHeads), ready for decoding and for further training; its target_info is
    `target`'s."""
    fmt = detect_format(path)
    if fmt == "native":
        import heads

        return heads.from_pretrained(path, target)
    doc, tensors = read_config(path), load_tensors(path)
    _drop_target_copy(tensors, "embed_tokens.weight", target.embed_tokens.weight, path)
    return _IMPORTERS[fmt](doc, tensors, target, Path(path))


def _source(doc: dict) -> str:
    info = doc.get("draftsmith") or {}
    return str(info.get("base_model") or doc.get("base_model_name_or_path") or "its base model")


def _check_size(what: str, have: int, target, path, doc) -> None:
    want = getattr(target, what)
    if int(have) != want:
        raise HeadMismatchError(
            f"{path}: the draft has {what}={have} but the target {target.name_or_path!r} has "
            f"{want}: it is a draft for another model ({_source(doc)}). Load it onto the model "
            "it was trained for, or train a draft for this target."
        )


def _drop_target_copy(tensors: dict, name: str, ours: Tensor, path) -> None:
    """Drop a saved copy of a target tensor (our heads use the target's own); refuse a copy
    that differs (the draft was trained with another embedding / lm_head)."""
    if name not in tensors:
        return
    saved, ours = tensors.pop(name).float(), ours.detach().float().cpu()
    if saved.shape != ours.shape or not torch.allclose(saved, ours, rtol=1e-2, atol=1e-3):
        raise HeadMismatchError(
            f"{path}: its {name} differs from the target's: draftsmith's heads always use the "
            "target's own, so this draft was trained for another target (or trained that "
            "tensor). Load it onto the model it was trained for."
        )


def _load_strict(module, tensors: dict, path, fmt: str, optional=()) -> None:
    """Copy `tensors` into `module`: every tensor named and shaped as the module's."""
    own = module.state_dict()
    missing = sorted(k for k in own if k not in tensors and k not in optional)
    unexpected = sorted(k for k in tensors if k not in own)
    shapes = [
        f"{k}: file {tuple(tensors[k].shape)}, head {tuple(own[k].shape)}"
        for k in sorted(own)
        if k in tensors and tensors[k].shape != own[k].shape
    ]
    if missing:
        raise HeadMismatchError(
            f"{path}: this {fmt} draft lacks {len(missing)} tensors, e.g. {missing[:4]}; "
            "the file is incomplete or from another layout: export it again."
        )
    if unexpected or shapes:
        raise HeadMismatchError(
            f"{path}: tensors that do not fit a draftsmith {fmt} head (unknown: {unexpected[:4]}; "
            f"other shapes: {shapes[:4]}): the draft's architecture differs from ours."
        )
    module.load_state_dict(tensors, strict=False)


def _config(cls, doc: dict, **fields):
    """Our config: the exporter's head_config when recorded, with `fields` taken from the file."""
    known = {f.name for f in dataclasses.fields(cls)}
    saved = ((doc.get("draftsmith") or {}).get("head_config")) or {}
    return cls(**({k: v for k, v in saved.items() if k in known} | fields))


def _check_geometry(doc: dict, target, path) -> LayerSpec:
    """The target's draft-layer spec, after refusing a file whose layer is shaped otherwise."""
    spec = LayerSpec.from_hf_config(target.model.config)
    want = {
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "rope_theta": spec.rope_parameters.get("rope_theta"),
    }
    rope = doc.get("rope_parameters") or {}
    have = dict(doc, rope_theta=doc.get("rope_theta", rope.get("rope_theta")))
    bad = {k: (have[k], v) for k, v in want.items() if have.get(k) is not None and have[k] != v}
    if bad:
        raise HeadMismatchError(
            f"{path}: the draft layer differs from the target's {bad} (file, target): draftsmith "
            "builds the draft layer from the target's config. Load it onto its own target."
        )
    return spec


def _need(tensors: dict, name: str, path, fmt: str) -> Tensor:
    if name not in tensors:
        raise HeadMismatchError(f"{path}: this {fmt} draft has no {name}; export it again.")
    return tensors[name]


def _aux_layers(doc: dict, target, path) -> list[int]:
    ids = doc.get("eagle_aux_hidden_state_layer_ids")  # vLLM: HF hidden_states indices
    sglang = (doc.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = ids or ([i + 1 for i in sglang] if sglang else default_aux_layers(target.num_layers))
    if any(not 0 <= i < target.num_layers for i in layers):
        raise HeadMismatchError(
            f"{path}: aux layers {layers} do not exist in the {target.num_layers}-layer target "
            f"{target.name_or_path!r}: it is a draft for another model ({_source(doc)})."
        )
    return [int(i) for i in layers]


def _import_eagle3(doc, tensors, target, path):
    H, V = target.hidden_size, target.vocab_size
    fc = _need(tensors, "fc.weight", path, "eagle3")
    _check_size("hidden_size", fc.shape[0], target, path, doc)
    _check_size("vocab_size", doc.get("vocab_size") or V, target, path, doc)
    spec = _check_geometry(doc, target, path)
    aux = _aux_layers(doc, target, path)
    if fc.shape[1] != len(aux) * H:
        raise HeadMismatchError(
            f"{path}: fc.weight {tuple(fc.shape)} does not fuse the aux layers {aux} of width {H}."
        )
    if "d2t" in tensors:
        draft_ids = saved_draft_ids(tensors["d2t"].to(torch.int64))
    elif (doc.get("draft_vocab_size") or V) == V:  # full-vocabulary drafts may omit the maps
        draft_ids = None
    else:
        raise HeadMismatchError(f"{path}: a reduced-vocabulary eagle3 draft without d2t.")
    d2t, t2d = d2t_t2d(torch.arange(V) if draft_ids is None else draft_ids, V)
    if "t2d" in tensors and not torch.equal(tensors["t2d"].to(torch.bool).reshape(-1), t2d):
        raise HeadMismatchError(
            f"{path}: t2d {tuple(tensors['t2d'].shape)} does not match d2t over the target's "
            f"{V} tokens: a draft for another vocabulary ({_source(doc)})."
        )
    tensors["d2t"], tensors["t2d"] = d2t, t2d
    D = V if draft_ids is None else draft_ids.numel()
    config = _config(Eagle3Config, doc, aux_layers=aux, draft_vocab_size=D if D < V else None)
    head = Eagle3Head(
        config,
        TargetInfo.of(target),
        spec,
        target.embed_tokens.weight,
        target.lm_head.weight,
        draft_ids,
    )
    # a full-vocabulary draft without lm_head borrows the target's (Eagle3Head starts from it)
    _load_strict(head, tensors, path, "eagle3", optional=("lm_head.weight",) if D == V else ())
    return head


def _import_eagle(doc, tensors, target, path):
    H = target.hidden_size
    fc = _need(tensors, "fc.weight", path, "eagle")
    _check_size("hidden_size", fc.shape[0], target, path, doc)
    _check_size("vocab_size", doc.get("vocab_size") or target.vocab_size, target, path, doc)
    spec = _check_geometry(doc, target, path)
    _drop_target_copy(tensors, "lm_head.weight", target.lm_head.weight, path)  # vLLM-converted
    tensors.setdefault("fc.bias", torch.zeros(H, dtype=fc.dtype))
    input_norm = "layers.0.input_layernorm.weight" in tensors
    config = _config(EagleConfig, doc, input_norm=input_norm)
    head = EagleHead(
        config, TargetInfo.of(target), spec, target.embed_tokens.weight, target.lm_head.weight
    )
    _load_strict(head, tensors, path, "eagle")
    return head


def _import_medusa(doc, tensors, target, path):
    V, K, L = target.vocab_size, int(doc["num_heads"]), int(doc["num_hidden_layers"])
    _check_size("hidden_size", doc.get("hidden_size") or target.hidden_size, target, path, doc)
    _check_size("vocab_size", doc.get("vocab_size") or V, target, path, doc)
    D = int(doc.get("truncated_vocab_size") or V)
    token_map = tensors.pop("token_map", None)
    draft_ids = order = None
    if D < V:
        if token_map is None:
            raise HeadMismatchError(
                f"{path}: truncated_vocab_size={D} < vocab_size={V} but no token_map tensor "
                "says which target tokens the heads score; export it again."
            )
        order = torch.argsort(token_map.to(torch.int64))  # our vocabularies are sorted ascending
        draft_ids = token_map.to(torch.int64)[order]
    ours = {}
    for name in list(tensors):
        if match := re.fullmatch(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)", name):
            h, i, param = match.groups()
            ours[f"blocks.{h}.{i}.linear.{param}"] = tensors.pop(name)
    if "lm_head.weight" in tensors:  # vLLM's shared head may also be saved under this name
        tensors["lm_heads.0.weight"] = tensors.pop("lm_head.weight")
    rows = {}
    for name in [k for k in tensors if re.fullmatch(r"lm_heads\.\d+\.weight", k)]:
        w = tensors.pop(name)
        if order is not None:  # a full-vocabulary lm_head under a token_map: keep the D rows
            w = w[draft_ids] if w.shape[0] == V else w[order]
        rows[int(name.split(".")[1])] = w
    if doc.get("original_lm_head"):  # vLLM reads lm_heads.0 only and uses it for every head
        rows = {h: rows[0] for h in range(K)} if 0 in rows else {}
    return _medusa_head(doc, target, path, "medusa", ours | tensors, rows, draft_ids, K, L)


def _import_medusa_fd(doc, tensors, target, path):
    K, L = int(doc["medusa_num_heads"]), int(doc["medusa_num_layers"])
    rows = {h: tensors.pop(f"{h}.{L}.weight") for h in range(K) if f"{h}.{L}.weight" in tensors}
    first = next(iter(rows.values()), None)
    if first is not None:
        _check_size("hidden_size", first.shape[1], target, path, doc)
        _check_size("vocab_size", first.shape[0], target, path, doc)
    elif "0.0.linear.weight" in tensors:
        _check_size("hidden_size", tensors["0.0.linear.weight"].shape[0], target, path, doc)
    ours = {f"blocks.{k}": v for k, v in tensors.items()}
    return _medusa_head(doc, target, path, "medusa_fd", ours, rows, None, K, L)


def _medusa_head(doc, target, path, fmt, tensors, rows, draft_ids, K, L):
    """MedusaHeads from renamed block tensors and per-head projection rows (none: the draft
    uses the target's lm_head, as TGI's Medusa v2 heads do)."""
    ref = target.lm_head.weight.detach()
    ref = ref if draft_ids is None else ref[draft_ids]
    same = bool(rows) and all(torch.allclose(w.float(), ref.float().cpu()) for w in rows.values())
    recorded = ((doc.get("draftsmith") or {}).get("head_config") or {}).get("share_lm_head")
    share = not rows or (same and bool(doc.get("original_lm_head") or recorded))
    if rows and len(rows) != K:
        missing = sorted(set(range(K)) - set(rows))
        raise HeadMismatchError(
            f"{path}: this {fmt} draft lacks the projection of heads {missing}."
        )
    D = target.vocab_size if draft_ids is None else draft_ids.numel()
    config = _config(
        MedusaConfig,
        doc,
        num_heads=K,
        num_layers=L,
        share_lm_head=bool(share),
        draft_vocab_size=D if D < target.vocab_size else None,
    )
    head = MedusaHeads(config, TargetInfo.of(target), target.lm_head.weight, draft_ids)
    if not share:
        tensors |= {f"proj.{h}": w for h, w in rows.items()}
    tensors |= {"d2t": head.d2t, "t2d": head.t2d}
    _load_strict(head, tensors, path, fmt)
    return head


_IMPORTERS = {
    "eagle3": _import_eagle3,
    "eagle": _import_eagle,
    "medusa": _import_medusa,
    "medusa_fd": _import_medusa_fd,
}
