"""What this machine's CPU does fast, for the settings that choose by it (`trainer.mixed_precision=
fast_bf16`, a target GGUF of type `fast_float`)."""

from __future__ import annotations

import torch


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AMX tiles or AVX512-BF16)."""
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


def fast_float_type() -> str:
    """The faster unquantised type on this CPU: bf16 where it multiplies bf16 in hardware, f32
    elsewhere (emulated bf16 is slower than f32: llama-server generated a 360-prompt corpus at
    187 tokens/s in bf16 and 211 in f32 on a Xeon without AVX512-BF16 or AMX)."""
    return "bf16" if cpu_has_fast_bf16() else "f32"
