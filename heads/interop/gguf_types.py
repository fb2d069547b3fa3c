"""Target GGUFs of a chosen type: `llama_cpp.target_gguf=q4_0|q4_k_m|q8_0|bf16|f32|auto`.

Which type a CPU runs fastest depends on its kernels, not on the bits alone: llama.cpp's x86
backend has multi-token matmul paths and weight repacking for Q4_0, Q4_K, Q8_0, BF16 and F32
but not for Q4_1 (the embedded SmolLM2 file), so a speculative verify of k tokens costs very
different multiples of one token per type (docs/engine_ceiling). Each type is made once from the
target's Hugging Face folder and cached beside the converter's output
(`<cache_dir>/gguf/<name>-<digest>-<type>.gguf`): f32 and bf16 by llama.cpp's converter,
q4_0 / q4_k_m / q8_0 by llama-quantize from the f32 file (lossless from any HF dtype), so a
quantised target is exactly what `llama-quantize model-f32.gguf TYPE` gives a user. `auto` is
the target's own GGUF (the embedded SmolLM2's Q4_1 as shipped).
"""

from __future__ import annotations

import os
from pathlib import Path

from data.engines.llama_tools import QUANT_TYPES, quantize_gguf

TARGET_TYPES = ("q4_0", "q4_k_m", "q8_0", "bf16", "f32", "auto")


def quantized_target_gguf(cfg, qtype: str) -> Path:
    """The target of a TargetConfig quantised to `qtype` (q4_0, q4_k_m, q8_0): its f32 GGUF
    (converted once) through llama-quantize, cached next to it; written atomically."""
    from heads.interop.gguf import gguf_for_target

    if qtype not in QUANT_TYPES:
        raise ValueError(f"target type {qtype!r}: quantised types are {', '.join(QUANT_TYPES)}.")
    f32 = gguf_for_target(cfg, outtype="f32", own=False)
    out = f32.with_name(f32.name.removesuffix("-f32.gguf") + f"-{qtype}.gguf")
    if not out.is_file():
        quantize_gguf(f32, out, qtype, threads=max(1, min(os.cpu_count() or 1, 4)))
    return out


def target_gguf_of_type(cfg, target_type: str) -> Path:
    """The target GGUF of one type named in TARGET_TYPES (else a clear error)."""
    from heads.interop.gguf import gguf_for_target

    if target_type == "auto":
        return gguf_for_target(cfg)
    if target_type in QUANT_TYPES:
        return quantized_target_gguf(cfg, target_type)
    if target_type in ("f32", "bf16", "f16"):
        return gguf_for_target(cfg, outtype=target_type, own=False)
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
