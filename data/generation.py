"""Generating text with the target: `generate` settings that change nothing, and every EOS id.

Shared by self-distillation (data/distill.py) and the benchmark's HF baselines
(eval/bench/methods.py). The target is duck-typed (`.tokenizer`, `.model.generation_config`).
"""

from __future__ import annotations

# Logit processors pinned to no-ops for `generate`: unset fields are filled from the checkpoint's
# generation_config (transformers 5), whose repetition penalty, n-gram blocking or sampling knobs
# would turn greedy decoding (or plain temperature sampling) into something else.
NEUTRAL_PROCESSORS = {
    "temperature": 1.0,
    "top_k": 50,  # transformers' default; greedy ignores it (sampling callers set 0: no cut)
    "top_p": 1.0,
    "typical_p": 1.0,
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
}


def eos_token_ids(target) -> list[int]:
    """Every id that ends an answer: the tokenizer's EOS and the model's generation config's."""
    ids: set[int] = set()
    tok_eos = getattr(target.tokenizer, "eos_token_id", None)
    gen = getattr(target.model, "generation_config", None)
    for value in (tok_eos, getattr(gen, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(int(v) for v in value)
    return sorted(ids)
