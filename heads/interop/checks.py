"""The refusals every importer of another tool's draft shares (heads/interop/load.py, dflash.py,
deepspec.py): a draft made for a target of other sizes, geometry or embedding is refused with a
line that names it, before any of its tensors is copied into one of our heads."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from heads.base import HeadMismatchError
from heads.draft_layer import LayerSpec


def source_name(doc: dict) -> str:
    info = doc.get("draftsmith") or {}
    return str(info.get("base_model") or doc.get("base_model_name_or_path") or "its base model")


def check_size(what: str, have: int, target, path, doc) -> None:
    want = getattr(target, what)
    if int(have) != want:
        raise HeadMismatchError(
            f"{path}: the draft has {what}={have} but the target {target.name_or_path!r} has "
            f"{want}: it is a draft for another model ({source_name(doc)}). Load it onto the model "
            "it was trained for, or train a draft for this target."
        )


def drop_target_copy(tensors: dict, name: str, ours: Tensor, path) -> None:
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


def load_strict(module, tensors: dict, path, fmt: str, optional=()) -> None:
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


def head_config(cls, doc: dict, **fields):
    """Our config: the exporter's head_config when recorded, with `fields` taken from the file."""
    known = {f.name for f in dataclasses.fields(cls)}
    saved = ((doc.get("draftsmith") or {}).get("head_config")) or {}
    return cls(**({k: v for k, v in saved.items() if k in known} | fields))


def check_geometry(doc: dict, target, path) -> LayerSpec:
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


__all__ = [
    "check_geometry",
    "check_size",
    "drop_target_copy",
    "head_config",
    "load_strict",
    "source_name",
]
