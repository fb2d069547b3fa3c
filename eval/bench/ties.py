"""Greedy mismatches that are rounding, not errors: the target's top-2 logit gap where two
decodings first differ, and the threshold under which that gap counts as a near tie."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from eval.engine.generator import first_difference


@torch.inference_mode()
def top2_gaps(model, input_ids: Tensor, new_tokens: list[int]) -> list[tuple[float, float]]:
    """(top-1 minus top-2 logit, top-1 logit) of the target at every new-token position of
    prompt + new_tokens, computed in the target's own dtype."""
    if not new_tokens:
        return []
    device = next(model.parameters()).device
    seq = torch.cat([input_ids[0].cpu(), torch.tensor(new_tokens, dtype=torch.long)])[None]
    logits = model(input_ids=seq.to(device), use_cache=False).logits[0].float()
    start = input_ids.shape[1] - 1  # logits at t predict token t + 1
    top2 = logits[start : start + len(new_tokens)].topk(2, dim=-1).values
    return list(zip((top2[:, 0] - top2[:, 1]).tolist(), top2[:, 0].tolist()))


# Mantissa bits of the dtypes a target may run in: a logit x is stored to a step of
# 2**(floor(log2 |x|) - bits).
_MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
FP32_TIE_FLOOR = 1e-4  # fp32: batched and one-token kernels differ by more than one ulp


def rounding_step(value: float, dtype: torch.dtype) -> float:
    """The spacing of representable numbers of `dtype` around `value`."""
    bits = _MANTISSA_BITS.get(dtype, 23)
    return 2.0 ** (math.floor(math.log2(max(abs(value), 1e-30))) - bits)


def near_tie_threshold(top1: float, dtype: torch.dtype, fixed: float | None = None) -> float:
    """A greedy mismatch is a rounding divergence, not an error, when the target's top-2 gap at
    the first differing token is at most this: `fixed` when given, else one rounding step of the
    target's dtype at the top-1 logit (bf16 at a logit of 12: 0.0625), never below 1e-4."""
    if fixed is not None:
        return fixed
    return max(FP32_TIE_FLOOR, rounding_step(top1, dtype))


def match_info(rec, ref, gaps: Callable[[], list], tie) -> dict:
    """How Record `rec` compares with the greedy reference `ref`: equal, or where it first differs,
    the target's top-2 gap there and whether that is a near tie (`tie(top1) -> threshold`)."""
    index = first_difference(rec.tokens, ref.tokens)
    if index is None:
        return {"greedy_match": True, "first_mismatch": None, "top2_gap": None, "near_tie": False}
    all_gaps = gaps()
    gap, top1 = all_gaps[index] if index < len(all_gaps) else (None, None)
    near = gap is not None and gap <= tie(top1)
    return {"greedy_match": False, "first_mismatch": index, "top2_gap": gap, "near_tie": near}
