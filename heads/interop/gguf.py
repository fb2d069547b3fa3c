"""GGUF files for llama.cpp: a draft head (EAGLE-3, DFlash) and, where needed, its target.

A draft becomes GGUF in two steps: the serving layout Hugging Face engines read (`export_draft`,
e.g. `LlamaForCausalLMEagle3`, or z-lab's `DFlashDraftModel` with its `mask_embedding.pt`), then
llama.cpp's own converter from the pinned build (`data.engines.llama_cpp.convert_to_gguf`) with
`--target-model-dir` the target's folder (the converter takes the tokenizer, vocabulary size and
hidden size from there, and for a learned DFlash MASK vector the target's embedding and lm_head,
written into the draft GGUF with the vector in the mask token's row). A DFlash GGUF records
`dflash.block_size`, `dflash.target_layers` (z-lab ids + 1, HF hidden_states indices) and
`tokenizer.ggml.mask_token_id`; llama-server serves it with `--spec-type draft-dflash
--spec-draft-n-max B-1`. A DFlash head with a reduced draft vocabulary (its own lm_head over D
tokens and d2t) goes through llama.cpp's DSpark converter instead, the one that reads
`draft_vocab_size` and `d2t` (conversion/qwen.py `DSparkModel`): its speculators layout, named
`DSparkSpeculator`, with `sample_from_anchor: false` and no Markov tensors, which the runtime
(src/models/dflash.cpp) serves as a plain DFlash draft scattering its D logits through d2t. DSpark
heads take the same converter with their Markov head (`--spec-type draft-dspark
--spec-draft-n-max B`). The target needs a
GGUF of its own only when it is not one already: the embedded SmolLM2 is shipped as Q4_1, and
`target_gguf(..., outtype="f32")` converts its de-quantized folder for numerically faithful runs.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from data.engines.llama_cpp import GGUF_OUTTYPES, convert_to_gguf
from heads.interop.dflash import DSPARK_SPECULATORS_ARCH
from heads.interop.export import export_draft, formats_for

# head format written before conversion -> llama.cpp's --spec-type for the resulting GGUF
# head method -> llama.cpp's --spec-type, and the layout its converter reads for that method
GGUF_SPEC_TYPES = {"eagle3": "draft-eagle3", "dflash": "draft-dflash", "dspark": "draft-dspark"}
GGUF_SOURCE_FORMATS = {"eagle3": "eagle3", "dflash": "dflash", "dspark": "speculators"}
DRAFT_GGUF = "draft.gguf"


def gguf_source_format(head) -> str:
    """The serving layout a head is converted from, or a clear refusal."""
    fmt = GGUF_SOURCE_FORMATS.get(head.method)
    if fmt not in formats_for(head):
        raise ValueError(
            f"llama.cpp serves no {type(head).__name__} drafts: GGUF export takes EAGLE-3, "
            "DFlash and DSpark heads. Export this head as one of "
            f"{', '.join(formats_for(head))} for vLLM/SGLang instead."
        )
    if fmt == "dflash" and head.draft_vocab_size < head.target_info.vocab_size:
        # z-lab's layout has no lm_head or d2t; llama.cpp's DSpark converter reads both
        return "speculators"
    return fmt


def spec_type_for(head) -> str:
    """The llama-server `--spec-type` that serves this head's GGUF."""
    gguf_source_format(head)  # refuses what llama.cpp cannot serve
    return GGUF_SPEC_TYPES[head.method]


def spec_type_of_gguf(path: str | os.PathLike) -> str:
    """The `--spec-type` that serves a draft GGUF, read from its metadata: an `eagle3`
    architecture -> draft-eagle3; `dflash` -> draft-dspark when it carries a Markov head, else
    draft-dflash (llama.cpp tells the two apart the same way)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch == "eagle3":
        return GGUF_SPEC_TYPES["eagle3"]
    if arch == "dflash":
        markov = any("markov" in t.name for t in reader.tensors)
        return GGUF_SPEC_TYPES["dspark" if markov else "dflash"]
    raise ValueError(
        f"{path}: architecture {arch!r} is not a draft llama.cpp serves with a --spec-type "
        "(eagle3 or dflash); set llama_cpp.spec_type, or give a draft GGUF exported by "
        "scripts/export.py --format gguf."
    )


def export_gguf(
    head,
    target,
    target_dir: str | os.PathLike,
    out_file: str | os.PathLike,
    outtype: str = "f32",
) -> Path:
    """Write `head` as a llama.cpp draft GGUF at `out_file`. `target_dir` is the target's Hugging
    Face folder (config.json + tokenizer), which the converter reads."""
    fmt = gguf_source_format(head)
    if not (Path(target_dir) / "config.json").is_file():
        raise FileNotFoundError(
            f"{target_dir}: no config.json; the GGUF converter needs the target's Hugging Face "
            "folder (config.json and tokenizer files) as --target-model-dir."
        )
    with tempfile.TemporaryDirectory(prefix="draftsmith-gguf-") as tmp:
        layout = Path(tmp) / fmt
        export_draft(head, target, fmt, layout)
        if fmt == "speculators":
            _leave_target_tensors_to_llama_cpp(head, target, layout)
            if head.method == "dflash":
                _name_for_dspark_converter(layout)
        return convert_to_gguf(layout, out_file, outtype, target_model_dir=target_dir)


def _name_for_dspark_converter(layout: Path) -> None:
    """Name a reduced-vocabulary DFlash speculators layout `DSparkSpeculator`, the name under
    which llama.cpp's converter reads `draft_vocab_size` and `d2t` (its DFlash converter reads
    neither). `sample_from_anchor: false` stays: the runtime then drafts slots 1..B-1 from the
    block [anchor, MASK x (B-1)] exactly as DFlash does, and without Markov tensors it is served
    as `draft-dflash`."""
    import json

    file = layout / "config.json"
    config = json.loads(file.read_text())
    if config.get("sample_from_anchor") is not False:
        raise ValueError("a DFlash speculators export records sample_from_anchor: false (a bug)")
    config["architectures"] = [DSPARK_SPECULATORS_ARCH]
    file.write_text(json.dumps(config, indent=2))


def _leave_target_tensors_to_llama_cpp(head, target, layout: Path) -> None:
    """llama.cpp's DSpark converter drops a full-vocabulary lm_head but keeps embed_tokens, and
    the runtime then scores with that table (token_embd stands in for a missing output): right
    for a tied target only. Drop the target's own copies so that the runtime borrows the
    target's embedding and output head; keep embed_tokens only to carry a learned MASK row, and
    only on a tied target (its output differs from the target's at the mask token's row)."""
    from safetensors.torch import load_file, save_file

    file = layout / "model.safetensors"
    tensors = load_file(str(file))
    full = head.draft_vocab_size == target.vocab_size
    if full:
        tensors.pop("lm_head.weight", None)
    if getattr(head, "mask_embedding", None) is None:
        tensors.pop("embed_tokens.weight", None)
    elif full and not bool(getattr(target.model.config, "tie_word_embeddings", False)):
        raise ValueError(
            "this draft learned its MASK vector, which llama.cpp's DSpark converter can only "
            "carry in the draft's token embedding, and the runtime would then also score with "
            "that table instead of this untied target's lm_head. Train with "
            "head.learn_mask=false for llama.cpp, or serve the speculators export in vLLM."
        )
    save_file(tensors, str(file), {"format": "pt"})


def target_gguf(
    target_dir: str | os.PathLike, out_file: str | os.PathLike, outtype: str = "f32"
) -> Path:
    """Convert a target's Hugging Face folder to GGUF (f32/f16/bf16/q8_0)."""
    return convert_to_gguf(target_dir, out_file, outtype)


def gguf_for_target(cfg, outtype: str = "f16", own: bool = True) -> Path:
    """A GGUF of the target a TargetConfig names. own=True: the file it comes from when there
    is one (the embedded SmolLM2's Q4_1 as shipped, a folder's `gguf_file`); otherwise (or
    own=False, for a numerically faithful f32/f16 copy) its Hugging Face folder converted once
    into `<cache_dir>/gguf/<name>-<outtype>.gguf`."""
    from heads.target import EMBEDDED, embedded_gguf, resolve_source

    if own and cfg.name_or_path in EMBEDDED:
        return embedded_gguf(cfg.name_or_path)
    if own and cfg.gguf_file:
        return Path(cfg.name_or_path) / cfg.gguf_file
    source, _ = resolve_source(cfg)
    if not (Path(source) / "config.json").is_file():
        raise FileNotFoundError(
            f"model.name_or_path={cfg.name_or_path}: llama.cpp needs the target as GGUF; give a "
            "local folder (converted once) or set data.self_distill.gguf to a .gguf file."
        )
    folder = Path(source).resolve()
    stamp = [str(folder)] + [
        f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in sorted(folder.iterdir())
    ]
    digest = hashlib.sha1("|".join(stamp).encode()).hexdigest()[:10]
    out = Path(cfg.cache_dir).expanduser() / "gguf" / f"{folder.name}-{digest}-{outtype}.gguf"
    if not out.is_file():
        target_gguf(source, out, outtype)
    return out


def chosen_target_gguf(cfg, choice: str | None) -> Path:
    """The target GGUF a setting names: None or "auto", the target's own (`gguf_for_target`);
    q4_0, q4_k_m, q8_0: its f32 conversion through llama-quantize, once (heads.interop.
    gguf_types); f32, f16, bf16: its Hugging Face folder converted once to that type; anything
    else, a .gguf path used as given."""
    from heads.interop.gguf_types import QUANT_TYPES, quantized_target_gguf

    if choice in (None, "", "auto"):
        return gguf_for_target(cfg)
    if choice in QUANT_TYPES:
        return quantized_target_gguf(cfg, choice)
    if choice in GGUF_OUTTYPES:
        return gguf_for_target(cfg, outtype=choice, own=False)
    return Path(choice)
