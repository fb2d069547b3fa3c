"""What this machine's CPU does fast, for the settings that choose by it (`trainer.mixed_precision=
fast_bf16`, a target GGUF of type `fast_float`)."""

from __future__ import annotations

import torch


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AMX tiles or AVX512-BF16)."""
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


def bf16_is_fast() -> bool:
    """Whether bf16 matrix products run in hardware here: on a CUDA GPU that supports bf16, or,
    without CUDA, on a CPU with AMX or AVX512-BF16 (the `fast_bf16` / `fast_bfloat16` settings)."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return cpu_has_fast_bf16()


def fast_float_type() -> str:
    """The faster unquantised type on this CPU: bf16 where it multiplies bf16 in hardware, f32
    elsewhere (emulated bf16 is slower than f32: llama-server generated a 360-prompt corpus at
    187 tokens/s in bf16 and 211 in f32 on a Xeon without AVX512-BF16 or AMX)."""
    return "bf16" if cpu_has_fast_bf16() else "f32"
