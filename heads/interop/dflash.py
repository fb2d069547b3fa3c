"""DFlash drafts in the layouts other tools read and write (see heads/interop/__init__.py).

- `dflash` (z-lab/dflash `DFlashDraftModel`; also what llama.cpp's converter and SGLang/vLLM's
  DFlash drafts load): a Qwen3-style config.json with `block_size`, `num_target_layers` and
  `dflash_config {mask_token_id, target_layer_ids}`; unprefixed `layers.*`, `fc`, `hidden_norm`,
  `norm`; no embedding and no lm_head (the runtime borrows the target's). A learned MASK vector
  goes into `mask_embedding.pt` ({"mask_token_id", "embedding" [H]}), which llama.cpp's
  converter writes into the draft GGUF's token embedding; z-lab's, vLLM's and SGLang's runtimes
  have no such file and embed the mask token itself.
- `speculators` (vllm-project/speculators `DFlashSpeculator`): the same body, the Qwen3 keys
  nested in `transformer_layer_config`, layer ids as HF `hidden_states` indices
  (`aux_hidden_state_layer_ids` = z-lab id + 1), and its own saved `embed_tokens` and `lm_head`
  (plus `d2t`/`t2d` for a reduced vocabulary). speculators embeds the block with its saved
  `embed_tokens`, so a learned MASK vector is written into that table's `mask_token_id` row: exact
  in speculators' own model.
- DeepSpec (`Qwen3DSparkModel`, its DSpark and its DFlash checkpoints) is anchor-sampled (slot k
  predicts the token k+1 places after the anchor, all B slots draft): heads/interop/deepspec.py
  reads it as a DSparkHead (markov_rank=0 for its DFlash ones).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from heads.base import CONFIG_NAME, HeadMismatchError, TargetInfo
from heads.dflash import DFlashConfig, DFlashHead
from heads.dflash_target import build_target_layer_ids
from heads.draft_layer import LayerSpec
from heads.dspark import DSparkConfig, DSparkHead
from heads.folder import HeadFolderError
from heads.interop.checks import (
    check_geometry,
    check_size,
    drop_target_copy,
    head_config,
    load_strict,
)
from heads.vocab import d2t_t2d, saved_draft_ids

ZLAB_ARCH = "DFlashDraftModel"
SPECULATORS_ARCH = "DFlashSpeculator"
DSPARK_SPECULATORS_ARCH = "DSparkSpeculator"
MASK_EMBEDDING = "mask_embedding.pt"  # read by llama.cpp's DFlashModel.generate_extra_tensors
ZLAB_AUTO_MAP = {"AutoModel": "dflash.DFlashDraftModel"}  # what SpecForge checks
# the speculators release whose schema the layout follows (source read at c05b95b, Aug 2026)
SPECULATORS_VERSION = "0.9.0"
# keys of a z-lab config.json that are not the Qwen3 layer config (speculators' converter)
NON_TRANSFORMER_KEYS = frozenset(
    {"architectures", "auto_map", "block_size", "dflash_config", "num_target_layers"}
)


# ---- export ----------------------------------------------------------------------------------


def _dtype_name(head) -> str:
    return str(head.fc.weight.dtype).removeprefix("torch.")


def qwen3_keys(head: DFlashHead, target) -> dict:
    """The Qwen3 config of the draft layers, sized from the target as the head was built."""
    spec: LayerSpec = head.spec
    hf = target.model.config
    hf = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    rope = dict(spec.rope_parameters)
    rope.setdefault("rope_theta", float(getattr(hf, "rope_theta", 10000.0)))
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    n = head.config.num_layers
    keys = {
        "model_type": "qwen3",
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": n,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": head.config.intermediate_size or spec.intermediate_size,
        "hidden_act": "silu",
        "vocab_size": target.vocab_size,
        "rms_norm_eps": spec.rms_norm_eps,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": None if scaling.get("rope_type", "default") == "default" else scaling,
        "rope_parameters": rope,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "layer_types": ["full_attention"] * n,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": n,
        "tie_word_embeddings": False,
        "initializer_range": float(getattr(hf, "initializer_range", 0.02)),
        "use_cache": True,
        "dtype": _dtype_name(head),
    }
    for name in ("bos_token_id", "eos_token_id"):
        if getattr(hf, name, None) is not None:
            keys[name] = getattr(hf, name)
    return keys


def _body(head: DFlashHead) -> dict[str, Tensor]:
    """The draft body both layouts share: layers.*, fc, hidden_norm, norm."""
    skip = ("d2t", "t2d", "mask_embedding", "lm_head.weight")
    return {k: v for k, v in head.state_dict().items() if k not in skip}


def export_zlab(head: DFlashHead, target):
    """(config, tensors, weights file, extra files) of the z-lab layout."""
    V = target.vocab_size
    if head.draft_vocab_size < V:
        raise ValueError(
            f"this DFlash head scores a reduced vocabulary ({head.draft_vocab_size} of {V} "
            "tokens, with its own lm_head and d2t), but the z-lab layout always uses the "
            "target's lm_head. Use --format speculators (vLLM) or --format gguf (llama.cpp), "
            "or train with head.draft_vocab_size=null."
        )
    c = head.config
    config = {
        "architectures": [ZLAB_ARCH],
        "auto_map": dict(ZLAB_AUTO_MAP),
        "block_size": c.block_size,
        "dflash_config": {
            "mask_token_id": c.mask_token_id,
            "target_layer_ids": list(c.target_layer_ids),
            "block_size": c.block_size,
        },
        "num_target_layers": target.num_layers,
        **qwen3_keys(head, target),
    }
    extra = {}
    if head.mask_embedding is not None:
        vector = head.mask_embedding.detach().cpu().clone()
        extra[MASK_EMBEDDING] = {"mask_token_id": int(c.mask_token_id), "embedding": vector}
    return config, _body(head), extra


def export_speculators(head: DFlashHead, target):
    """(config, tensors, extra files) of speculators' DFlashSpeculator layout."""
    c, V, D = head.config, target.vocab_size, head.draft_vocab_size
    hf = target.model.config
    layer = qwen3_keys(head, target)
    # DSpark (models/dspark/config.py): every slot drafts, from the anchor on
    dspark = isinstance(head, DSparkHead)
    if dspark and head.markov_head is None:
        raise ValueError(
            "this DSpark head has no Markov head (markov_rank=0, e.g. a DeepSpec DFlash import), "
            "which speculators' DSpark layout (and llama.cpp's DSpark converter after it) "
            "always has: use --format native, or train with head.markov_rank of 1 or more."
        )
    kind = DSparkHead.method if dspark else DFlashHead.method
    config = {
        "architectures": [DSPARK_SPECULATORS_ARCH if dspark else SPECULATORS_ARCH],
        "speculators_model_type": kind,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": D,
        "block_size": c.block_size,
        "target_hidden_size": target.hidden_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in c.target_layer_ids],
        "mask_token_id": c.mask_token_id,
        "sliding_window_non_causal": False,
        "sample_from_anchor": dspark,
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": head.max_draft_depth,
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
        "dtype": layer["dtype"],
    }
    if dspark:
        config |= {
            "markov_rank": c.markov_rank,
            "markov_head_type": c.markov_head_type,
            "enable_confidence_head": head.confidence_head is not None,
            "confidence_head_with_markov": True,  # ours reads [h; markov_w1(prev)]
        }
    tensors = _body(head)
    embed = target.embed_tokens.weight.detach().cpu().clone()
    if head.mask_embedding is not None:  # speculators embeds the block with this very table
        embed[c.mask_token_id] = head.mask_embedding.detach().cpu().to(embed.dtype)
    tensors["embed_tokens.weight"] = embed
    if D < V:
        tensors["lm_head.weight"] = head.lm_head.weight
        tensors["d2t"], tensors["t2d"] = head.d2t, head.t2d
    else:
        tensors["lm_head.weight"] = target.lm_head.weight.detach()
    return config, tensors, {}


def mask_note(head, fmt: str) -> str | None:
    """What a reader of an export must know about a learned MASK vector in `fmt`."""
    if getattr(head, "mask_embedding", None) is None:
        return None
    if fmt == "dflash":
        return (
            f"This draft learned its MASK vector ({MASK_EMBEDDING}, token id "
            f"{head.config.mask_token_id}). draftsmith and llama.cpp (whose converter writes it "
            "into the draft GGUF) draft with it exactly; z-lab's, vLLM's and SGLang's DFlash "
            "runtimes ignore the file and embed the mask token itself, so they propose slightly "
            "differently (still lossless)."
        )
    if fmt == "speculators":
        return (
            f"This draft learned its MASK vector: it is row {head.config.mask_token_id} of the "
            "saved embed_tokens, which speculators' DFlash model embeds the block with (exact "
            "there); a runtime that embeds with the target's table instead uses the mask "
            "token's own embedding."
        )
    return None


# ---- import ----------------------------------------------------------------------------------


def _refuse(path, text: str):
    raise HeadMismatchError(f"{path}: {text}")


def _spec_for(doc: dict, target, path) -> tuple[LayerSpec, int | None]:
    """The target's layer spec after checking the file's Qwen3 keys against it; and the MLP
    width when it is not the target's (head.intermediate_size)."""
    spec = check_geometry({k: v for k, v in doc.items() if k != "intermediate_size"}, target, path)
    if doc.get("attention_bias"):
        _refuse(path, "its attention has biases (attention_bias=true); DFlashHead's has none.")
    kinds = set(doc.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        _refuse(
            path,
            f"its draft layers are {sorted(kinds)}; DFlashHead has full (non-causal) attention "
            "only, so a sliding-window draft would propose differently.",
        )
    width = doc.get("intermediate_size")
    return spec, (int(width) if width and int(width) != spec.intermediate_size else None)


def _check_sizes(layer: dict, tensors: dict, target, path, doc: dict) -> None:
    """Refuse a draft for a target of another hidden or vocabulary size (`layer`: the Qwen3
    keys, `doc`: the whole config.json, which names the draft's own target)."""
    fc = tensors.get("fc.weight")
    if fc is None:
        _refuse(path, "no fc.weight: not a complete DFlash draft; export or download it again.")
    check_size("hidden_size", fc.shape[0], target, path, doc)
    check_size("vocab_size", layer.get("vocab_size") or target.vocab_size, target, path, doc)


def _layer_ids(ids, target, path, what: str) -> list[int]:
    N = target.num_layers
    ids = [int(i) for i in ids]
    if not ids or any(not 0 <= i <= N - 2 for i in ids):
        _refuse(
            path,
            f"{what} {ids} do not name layers of the {N}-layer target {target.name_or_path!r} "
            f"(z-lab ids must lie in [0, {N - 2}]): it is a draft for another model.",
        )
    return ids


def _build(doc, tensors, target, path, fmt, spec, **fields) -> DFlashHead:
    """A DFlashHead from `fields` (plus the exporter's recorded head_config) with `tensors`."""
    draft_ids = fields.pop("draft_ids", None)
    mask_vector = fields.pop("mask_vector", None)
    config_class = fields.pop("config_class", DFlashConfig)
    head_class = DSparkHead if config_class is DSparkConfig else DFlashHead
    V = target.vocab_size
    D = V if draft_ids is None else draft_ids.numel()
    config = head_config(config_class, doc, draft_vocab_size=D if D < V else None, **fields)
    fc = tensors["fc.weight"]
    if fc.shape[1] != len(config.target_layer_ids) * target.hidden_size:
        _refuse(
            path,
            f"fc.weight {tuple(fc.shape)} does not fuse the {len(config.target_layer_ids)} "
            f"layers {config.target_layer_ids} of width {target.hidden_size}.",
        )
    head = head_class(
        config,
        TargetInfo.of(target),
        spec,
        target.embed_tokens.weight,
        target.lm_head.weight,
        draft_ids,
    )
    tensors["d2t"], tensors["t2d"] = head.d2t, head.t2d
    if head.mask_embedding is not None:  # the file's vector, else the mask token's row
        tensors["mask_embedding"] = (
            head.mask_embedding.detach()
            if mask_vector is None
            else (mask_vector.to(head.mask_embedding.dtype))
        )
    load_strict(head, tensors, path, fmt)
    return head


def _block_size(doc: dict, path) -> int:
    nested = (doc.get("dflash_config") or {}).get("block_size")
    size = doc.get("block_size") or nested
    if not isinstance(size, int):
        raise HeadFolderError(
            f"{Path(path) / CONFIG_NAME}: no integer block_size (top level or in dflash_config); "
            "the config is incomplete: download or export the draft again."
        )
    return size


def import_zlab(doc, tensors, target, path) -> DFlashHead:
    """A z-lab DFlash folder (with or without mask_embedding.pt) as a DFlashHead."""
    _check_sizes(doc, tensors, target, path, doc)
    drop_target_copy(tensors, "lm_head.weight", target.lm_head.weight, path)
    spec, width = _spec_for(doc, target, path)
    dflash = doc.get("dflash_config") or {}
    recorded = doc.get("num_target_layers")
    if recorded is not None and int(recorded) != target.num_layers:
        _refuse(
            path,
            f"it was made for a {recorded}-layer target, and {target.name_or_path!r} has "
            f"{target.num_layers}: load it onto the model it was trained for.",
        )
    n = int(doc.get("num_hidden_layers") or 1)
    ids = dflash.get("target_layer_ids") or build_target_layer_ids(target.num_layers, n)
    ids = _layer_ids(ids, target, path, "dflash_config.target_layer_ids")
    mask_id = dflash.get("mask_token_id")
    if not isinstance(mask_id, int):
        _refuse(path, "no dflash_config.mask_token_id: the draft does not say which token is MASK.")
    vector = _read_mask_file(Path(path), mask_id, target.hidden_size)
    head = _build(
        doc, tensors, target, path, "dflash", spec,
        num_layers=n, block_size=_block_size(doc, path), target_layer_ids=ids,
        mask_token_id=mask_id, learn_mask=vector is not None, intermediate_size=width,
        mask_vector=vector,
    )  # fmt: skip
    return head


def _read_mask_file(folder: Path, mask_id: int, hidden: int) -> Tensor | None:
    file = folder / MASK_EMBEDDING
    if not file.is_file():
        return None
    try:
        doc = torch.load(str(file), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  (any unreadable file gets the same answer)
        raise HeadFolderError(
            f"{file}: unreadable ({type(e).__name__}); it should be a torch.save of "
            '{"mask_token_id": int, "embedding": tensor[H]}: export the draft again.'
        ) from None
    vector = doc.get("embedding") if isinstance(doc, dict) else None
    if not isinstance(vector, Tensor) or tuple(vector.shape) != (hidden,):
        raise HeadFolderError(
            f"{file}: 'embedding' is not a vector of the target's width {hidden}."
        )
    if doc.get("mask_token_id") != mask_id:
        raise HeadFolderError(
            f"{file}: mask_token_id {doc.get('mask_token_id')} differs from dflash_config's "
            f"{mask_id}; the file belongs to another draft."
        )
    return vector


def import_speculators(doc, tensors, target, path) -> DFlashHead:
    """A speculators DFlashSpeculator (or DSparkSpeculator) folder as our head."""
    layer = dict(doc.get("transformer_layer_config") or {})
    if doc.get("speculators_model_type") == DSparkHead.method:
        return _import_dspark_speculators(doc, tensors, target, path, layer)
    if doc.get("sample_from_anchor"):
        _refuse(
            path,
            "sample_from_anchor=true: its slot k predicts the token k+1 places after the anchor "
            "(all B slots draft), and DFlashHead's slot k predicts the token k places after it; "
            "it cannot be loaded as a DFlash head.",
        )
    return _import_speculators_body(doc, tensors, target, path, layer, DFlashConfig, {})


def _import_dspark_speculators(doc, tensors, target, path, layer):
    """A speculators DSparkSpeculator folder as a DSparkHead (vanilla Markov head, confidence
    head on [h; markov_w1(prev)], blocks sampled from the anchor)."""
    if doc.get("sample_from_anchor") is False:
        _refuse(
            path,
            "a DSpark draft with sample_from_anchor=false (slot 0 undrafted): DSparkHead drafts "
            "every slot from the anchor on, so it cannot represent it.",
        )
    if doc.get("markov_head_type", "vanilla") != "vanilla":
        _refuse(path, f"markov_head_type {doc['markov_head_type']!r}: only 'vanilla' is read.")
    conf = bool(doc.get("enable_confidence_head", True))
    if conf and doc.get("confidence_head_with_markov") is False:
        _refuse(path, "its confidence head reads h only; DSparkHead's reads [h; markov_w1(prev)].")
    w1 = tensors.get("markov_head.markov_w1.weight")
    if w1 is None:
        _refuse(path, "no markov_head.markov_w1.weight: not a complete DSpark draft.")
    fields = {"markov_rank": int(w1.shape[1]), "enable_confidence_head": conf}
    return _import_speculators_body(doc, tensors, target, path, layer, DSparkConfig, fields)


def _import_speculators_body(doc, tensors, target, path, layer, config_class, extra: dict):
    _check_sizes(layer, tensors, target, path, doc)
    spec, width = _spec_for(layer, target, path)
    for name in ("verifier_lm_head.weight", "verifier_norm.weight"):
        tensors.pop(name, None)
    aux = doc.get("aux_hidden_state_layer_ids") or []
    ids = _layer_ids([i - 1 for i in aux], target, path, "aux_hidden_state_layer_ids - 1")
    mask_id = doc.get("mask_token_id")
    if not isinstance(mask_id, int):
        _refuse(path, "no mask_token_id in config.json: it does not say which token is MASK.")
    vector = _mask_row(tensors, target, mask_id, doc, path)
    V = target.vocab_size
    D = int(doc.get("draft_vocab_size") or V)
    draft_ids = None
    if D < V:
        if "d2t" not in tensors:
            _refuse(path, f"draft_vocab_size={D} < {V} but no d2t tensor maps it to the target.")
        draft_ids = saved_draft_ids(tensors["d2t"].to(torch.int64))
        _, t2d = d2t_t2d(draft_ids, V)
        if "t2d" in tensors and not torch.equal(tensors["t2d"].to(torch.bool).reshape(-1), t2d):
            _refuse(path, "t2d does not match d2t over the target's vocabulary.")
    else:
        drop_target_copy(tensors, "lm_head.weight", target.lm_head.weight, path)
        for name in ("d2t", "t2d"):
            tensors.pop(name, None)
    recorded = ((doc.get("draftsmith") or {}).get("head_config") or {}).get("learn_mask")
    head = _build(
        doc, tensors, target, path, "speculators", spec,
        num_layers=int(layer.get("num_hidden_layers") or 1), block_size=_block_size(doc, path),
        target_layer_ids=ids, mask_token_id=mask_id, draft_ids=draft_ids,
        learn_mask=vector is not None or bool(recorded), intermediate_size=width,
        mask_vector=vector, config_class=config_class, **extra,
    )  # fmt: skip
    return head


def _verifier(doc: dict) -> str:
    verifier = ((doc.get("speculators_config") or {}).get("verifier")) or {}
    return str(verifier.get("name_or_path") or "its verifier")


def _mask_row(tensors: dict, target, mask_id: int, doc, path) -> Tensor | None:
    """Pop the saved embed_tokens: equal to the target's except perhaps at row `mask_id` (a
    learned MASK vector, returned) or refused as a draft for another target."""
    saved = tensors.pop("embed_tokens.weight", None)
    if saved is None:
        return None
    ours = target.embed_tokens.weight.detach().float().cpu()
    saved = saved.float()
    if saved.shape != ours.shape:
        _refuse(path, f"embed_tokens {tuple(saved.shape)} is not the target's {tuple(ours.shape)}.")
    close = torch.isclose(saved, ours, rtol=1e-2, atol=1e-3).all(-1)
    close[mask_id] = True
    if not bool(close.all()):
        rows = close.logical_not().nonzero()[:4, 0].tolist()
        _refuse(
            path,
            f"its embed_tokens differs from the target's (rows {rows}...): a draft for another "
            f"model ({_verifier(doc)}). Load it onto its own target.",
        )
    row = saved[mask_id]
    return None if torch.equal(row, ours[mask_id]) else row


def speculators_kind(doc: dict) -> str | None:
    """'speculators' for a DFlashSpeculator config, else None."""
    archs = doc.get("architectures") or []
    if {SPECULATORS_ARCH, DSPARK_SPECULATORS_ARCH} & set(archs):
        return "speculators"
    if doc.get("speculators_model_type") in (DFlashHead.method, DSparkHead.method):
        return "speculators"
    return None


__all__ = [
    "MASK_EMBEDDING",
    "export_speculators",
    "export_zlab",
    "import_speculators",
    "import_zlab",
    "mask_note",
    "qwen3_keys",
]
