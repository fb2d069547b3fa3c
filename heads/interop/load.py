"""Reading a serving engine's draft folder back into draftsmith's heads (see
heads/interop/__init__.py for the formats)."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from heads.base import CONFIG_NAME, HeadMismatchError, TargetInfo
from heads.eagle import EagleConfig, EagleHead
from heads.eagle3 import Eagle3Config, Eagle3Head, default_aux_layers
from heads.folder import OWN_KEYS, HeadFolderError, check_target, read_json, read_safetensors
from heads.interop.checks import (
    check_geometry,
    check_size,
    drop_target_copy,
    head_config,
    load_strict,
    source_name,
)
from heads.interop.deepspec import DEEPSPEC_ARCHS, import_deepspec
from heads.interop.dflash import ZLAB_ARCH, import_speculators, import_zlab, speculators_kind
from heads.interop.eagle3 import flat_eagle3_doc, is_speculators_eagle3
from heads.interop.formats import READ_FORMATS, WEIGHT_FILES
from heads.medusa import MedusaConfig, MedusaHeads
from heads.registry import load_native
from heads.vocab import d2t_t2d, saved_draft_ids

# ---- reading folders -------------------------------------------------------------------------


def read_config(path) -> dict:
    cfg = Path(path) / CONFIG_NAME
    if not cfg.is_file():
        raise FileNotFoundError(f"{cfg} not found: a draft folder holds config.json and weights.")
    return read_json(cfg)


def weights_file(path) -> Path:
    for name in WEIGHT_FILES:
        if (Path(path) / name).is_file():
            return Path(path) / name
    raise FileNotFoundError(f"{path}: no weights file; expected one of {', '.join(WEIGHT_FILES)}.")


def load_tensors(path) -> dict[str, Tensor]:
    """The folder's tensors under our names: no `model.` / `medusa_heads.` prefix, `midlayer.`
    (SafeAILab / SpecForge EAGLE-3) read as `layers.0.`."""
    file = weights_file(path)
    raw = read_safetensors(file) if file.suffix == ".safetensors" else _read_pickled(file)
    return {_our_name(k): v for k, v in raw.items()}


def _read_pickled(file: Path) -> dict[str, Tensor]:
    try:
        return torch.load(str(file), map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise HeadFolderError(
            f"{file}: unreadable torch file ({type(e).__name__}): the file is damaged or was cut "
            "short while being written; download or export the draft again."
        ) from None


def _our_name(name: str) -> str:
    for prefix in ("model.", "medusa_heads."):
        name = name.removeprefix(prefix)
    return "layers.0." + name[len("midlayer.") :] if name.startswith("midlayer.") else name


def _tensor_names(path) -> set[str]:
    file = weights_file(path)
    if file.suffix != ".safetensors":
        return set(load_tensors(path))
    try:
        with safe_open(str(file), framework="pt") as f:
            return {_our_name(k) for k in f.keys()}
    except SafetensorError:
        return set(load_tensors(path))  # which raises the error that names the file


# DSpark layouts of other tools, which draftsmith does not read
DSPARK_ARCHS = ("DSparkDraftModel", "Lfm2DSparkDraftModel", "LingDSparkModel")


def detect_format(path) -> str:
    """Which of READ_FORMATS a folder holds, from its config.json (and tensor names if needed)."""
    doc = read_config(path)
    archs = doc.get("architectures") or []
    if doc.keys() & OWN_KEYS:
        return "native"
    if ZLAB_ARCH in archs:
        return "dflash"
    if is_speculators_eagle3(doc):
        return "speculators"
    if speculators_kind(doc):
        return speculators_kind(doc)
    if any(a in DEEPSPEC_ARCHS for a in archs):
        return "deepspec"
    if any(a in DSPARK_ARCHS for a in archs):
        raise HeadMismatchError(
            f"{path}: a DSpark draft in the {', '.join(archs)} layout, which draftsmith does not "
            "read (it reads speculators' DSparkSpeculator and DeepSpec's Qwen3DSparkModel); "
            "serve it in llama.cpp (--spec-type draft-dspark) or the tool that trained it."
        )
    if "medusa_num_heads" in doc:
        return "medusa_fd"
    if doc.get("model_type") == "medusa" or "MedusaModel" in archs:
        return "medusa"
    if any(a.startswith("Eagle3") or a.endswith("Eagle3") for a in archs):
        return "eagle3"
    if any(a in ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM") for a in archs):
        return "eagle"
    if not archs and not doc.get("model_type"):
        raise HeadFolderError(
            f"{Path(path) / CONFIG_NAME}: neither draftsmith's records ('method', 'target') nor "
            "a serving engine's ('architectures', 'model_type'): not a draft folder draftsmith "
            "can read; give the folder save_pretrained or an export wrote."
        )
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
        f"draftsmith reads {', '.join(READ_FORMATS)}."
    )


# ---- import ----------------------------------------------------------------------------------


def import_draft(path, target, allow_other_target: bool = False):
    """Load a folder in any of READ_FORMATS onto `target` as one of our heads (EagleHead,
    Eagle3Head, MedusaHeads, DFlashHead, DSparkHead), ready for decoding and for further
    training; its target_info is `target`'s. A folder draftsmith exported records its target's
    fingerprint, which must match unless `allow_other_target`."""
    fmt = detect_format(path)
    if fmt == "native":
        return load_native(path, target, allow_other_target=allow_other_target)
    doc = read_config(path)
    tensors = load_tensors(path)
    if fmt not in ("speculators", "deepspec"):  # these may keep a MASK row in embed_tokens
        drop_target_copy(tensors, "embed_tokens.weight", target.embed_tokens.weight, path)
    head = _IMPORTERS[fmt](doc, tensors, target, Path(path))  # refuses other sizes first
    _check_recorded_target(doc, target, path, allow_other_target)
    return head


def _check_recorded_target(doc: dict, target, path, allow_other_target: bool) -> None:
    """Refuse a draftsmith export whose recorded target is another model (check_target)."""
    recorded = (doc.get("draftsmith") or {}).get("target_fingerprint")
    if recorded:
        saved = TargetInfo(name_or_path=source_name(doc), fingerprint=str(recorded))
        check_target(saved, target, path, dims=(), allow_other_target=allow_other_target)


def _doc_int(doc: dict, key: str, path, fmt: str) -> int:
    if not isinstance(doc.get(key), int):
        raise HeadFolderError(
            f"{Path(path) / CONFIG_NAME}: this {fmt} draft's config has no integer {key!r}; "
            "the file is incomplete: download or export the draft again."
        )
    return doc[key]


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
            f"{target.name_or_path!r}: it is a draft for another model ({source_name(doc)})."
        )
    return [int(i) for i in layers]


def _import_eagle3(doc, tensors, target, path):
    H, V = target.hidden_size, target.vocab_size
    fc = _need(tensors, "fc.weight", path, "eagle3")
    check_size("hidden_size", fc.shape[0], target, path, doc)
    check_size("vocab_size", doc.get("vocab_size") or V, target, path, doc)
    spec = check_geometry(doc, target, path)
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
            f"{V} tokens: a draft for another vocabulary ({source_name(doc)})."
        )
    tensors["d2t"], tensors["t2d"] = d2t, t2d
    D = V if draft_ids is None else draft_ids.numel()
    if doc.get("norm_before_residual") or doc.get("norm_before_fc"):
        raise HeadMismatchError(
            f"{path}: norm_before_residual / norm_before_fc are set, variants draftsmith's EAGLE-3 "
            "head does not build (it has fc_norm and norm_output); serve it in vLLM or SGLang."
        )
    config = head_config(
        Eagle3Config,
        doc,
        aux_layers=aux,
        draft_vocab_size=D if D < V else None,
        fc_norm=bool(doc.get("fc_norm", False)),
        norm_output=bool(doc.get("norm_output", False)),
        num_layers=int(doc.get("num_hidden_layers") or 1),  # vLLM stacks more than one
    )
    head = Eagle3Head(
        config,
        TargetInfo.of(target),
        spec,
        target.embed_tokens.weight,
        target.lm_head.weight,
        draft_ids,
    )
    # a full-vocabulary draft without lm_head borrows the target's (Eagle3Head starts from it)
    load_strict(head, tensors, path, "eagle3", optional=("lm_head.weight",) if D == V else ())
    return head


def _import_eagle(doc, tensors, target, path):
    H = target.hidden_size
    fc = _need(tensors, "fc.weight", path, "eagle")
    check_size("hidden_size", fc.shape[0], target, path, doc)
    check_size("vocab_size", doc.get("vocab_size") or target.vocab_size, target, path, doc)
    spec = check_geometry(doc, target, path)
    drop_target_copy(tensors, "lm_head.weight", target.lm_head.weight, path)  # vLLM-converted
    tensors.setdefault("fc.bias", torch.zeros(H, dtype=fc.dtype))
    input_norm = "layers.0.input_layernorm.weight" in tensors
    config = head_config(EagleConfig, doc, input_norm=input_norm)
    head = EagleHead(
        config, TargetInfo.of(target), spec, target.embed_tokens.weight, target.lm_head.weight
    )
    load_strict(head, tensors, path, "eagle")
    return head


def _import_medusa(doc, tensors, target, path):
    V = target.vocab_size
    K, L = (
        _doc_int(doc, "num_heads", path, "medusa"),
        _doc_int(doc, "num_hidden_layers", path, "medusa"),
    )
    check_size("hidden_size", doc.get("hidden_size") or target.hidden_size, target, path, doc)
    check_size("vocab_size", doc.get("vocab_size") or V, target, path, doc)
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
    K = _doc_int(doc, "medusa_num_heads", path, "medusa_fd")
    L = _doc_int(doc, "medusa_num_layers", path, "medusa_fd")
    rows = {h: tensors.pop(f"{h}.{L}.weight") for h in range(K) if f"{h}.{L}.weight" in tensors}
    first = next(iter(rows.values()), None)
    if first is not None:
        check_size("hidden_size", first.shape[1], target, path, doc)
        check_size("vocab_size", first.shape[0], target, path, doc)
    elif "0.0.linear.weight" in tensors:
        check_size("hidden_size", tensors["0.0.linear.weight"].shape[0], target, path, doc)
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
    config = head_config(
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
    load_strict(head, tensors, path, fmt)
    return head


def _import_speculators(doc, tensors, target, path):
    """speculators' Eagle3Speculator, DFlashSpeculator or DSparkSpeculator folder."""
    if not is_speculators_eagle3(doc):
        return import_speculators(doc, tensors, target, path)
    drop_target_copy(tensors, "embed_tokens.weight", target.embed_tokens.weight, path)
    for name in ("verifier_lm_head.weight", "verifier_norm.weight"):
        tensors.pop(name, None)
    return _import_eagle3(flat_eagle3_doc(doc), tensors, target, path)


_IMPORTERS = {
    "eagle3": _import_eagle3,
    "eagle": _import_eagle,
    "medusa": _import_medusa,
    "medusa_fd": _import_medusa_fd,
    "dflash": import_zlab,
    "speculators": _import_speculators,
    "deepspec": import_deepspec,
}
