"""Decoding methods for the benchmark: a name and `run(input_ids, max_new_tokens) -> Record`.

- `PlainMethod`: one token per target forward, through the engine's own cache code (the in-run
  baseline the speedups are measured against),
- `HFGenerateMethod`: Hugging Face `generate`, greedy, optionally with prompt-lookup decoding
  (external baselines),
- `SpeculativeMethod`: a draft head's proposer (eval.engine.drafting) + a verifier in
  `SpeculativeGenerator`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from data.errors import ConfigError
from data.generation import NEUTRAL_PROCESSORS, eos_token_ids
from eval.engine import kv_cache
from eval.engine.drafting import make_proposer
from eval.engine.generator import GenerationResult, SpeculativeGenerator, plain_decode
from eval.engine.tree_spec import TreeSpec
from eval.engine.verify import GreedyVerifier, Verifier

BASELINES = ("plain", "hf_generate", "hf_prompt_lookup")
HEAD = "head"  # the method of evaluate.py's head_path
METHODS = (*BASELINES, HEAD)  # every name build_methods takes


@dataclass
class Record:
    """What one method produced for one request.

    tokens: the new token ids. target_forwards: every target forward, the prefill included.
    prefill_tokens: tokens the first forward emitted (1, or more when it also verified a draft).
    accept_lengths: tokens each later forward emitted (accepted draft tokens + the bonus token).
    seconds: wall time of the request; draft_seconds: the part of it the proposer took.
    """

    tokens: list[int]
    target_forwards: int
    prefill_tokens: int
    accept_lengths: list[int]
    seconds: float
    draft_seconds: float = 0.0  # of `seconds`, time spent drafting (speculative methods)


class Method(Protocol):
    name: str
    max_draft_depth: int  # deepest draft token a step can accept (0: no drafting)

    def run(self, input_ids: Tensor, max_new_tokens: int) -> Record: ...


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _from_result(result: GenerationResult, seconds: float) -> Record:
    tokens = result.new_tokens.tolist()
    return Record(
        tokens,
        result.num_target_forwards,
        min(1, len(tokens)),
        list(result.accept_lengths),
        seconds,
        result.draft_seconds,
    )


class PlainMethod:
    """One token per target forward, through the same cache code as the speculative loop."""

    max_draft_depth = 0

    def __init__(
        self, model, eos_ids: Sequence[int], verifier: Verifier | None = None, name: str = "plain"
    ):
        self.name, self.model, self.eos_ids = name, model, list(eos_ids)
        self.verifier = verifier or GreedyVerifier()

    def run(self, input_ids: Tensor, max_new_tokens: int) -> Record:
        t0 = time.perf_counter()
        result = plain_decode(self.model, input_ids, max_new_tokens, self.verifier, self.eos_ids)
        _sync(self.model.device)
        return _from_result(result, time.perf_counter() - t0)


class SpeculativeMethod:
    """A draft head: propose a tree, verify it in one target forward, commit the accepted path."""

    def __init__(self, name: str, generator: SpeculativeGenerator, max_draft_depth: int):
        self.name, self.generator, self.max_draft_depth = name, generator, max_draft_depth

    def run(self, input_ids: Tensor, max_new_tokens: int) -> Record:
        t0 = time.perf_counter()
        result = self.generator.generate(input_ids, max_new_tokens)
        _sync(self.generator.model.device)
        return _from_result(result, time.perf_counter() - t0)


class HFGenerateMethod:
    """Hugging Face `generate`, greedy; with `prompt_lookup_num_tokens`, prompt-lookup decoding.

    A forward pre-hook reads the cache length at every target forward: each forward commits the
    tokens it verified, so the growth of the cache between forwards is what a forward emitted.
    """

    def __init__(
        self,
        name: str,
        model,
        eos_ids: Sequence[int],
        pad_id: int | None,
        prompt_lookup_num_tokens: int | None = None,
    ):
        self.name, self.model, self.eos_ids, self.pad_id = name, model, list(eos_ids), pad_id
        self.lookup = prompt_lookup_num_tokens
        self.max_draft_depth = prompt_lookup_num_tokens or 0

    def _config(self, max_new_tokens: int):
        from transformers import GenerationConfig

        extra = {"prompt_lookup_num_tokens": self.lookup} if self.lookup else {}
        eos = self.eos_ids or None
        pad = self.pad_id if self.pad_id is not None else (eos[0] if eos else None)
        # Unset fields are filled from the model's generation_config (transformers 5): pin the
        # logit processors to neutral values so a checkpoint's defaults (repetition penalty,
        # n-gram blocking, sampling knobs) cannot turn the baseline away from plain greedy.
        return GenerationConfig(
            max_new_tokens=max_new_tokens,
            min_length=0,
            do_sample=False,
            num_beams=1,
            **NEUTRAL_PROCESSORS,
            eos_token_id=eos,
            pad_token_id=pad,
            **extra,
        )

    @torch.inference_mode()
    def run(self, input_ids: Tensor, max_new_tokens: int) -> Record:
        lengths: list[int] = []

        def count(module, args, kwargs):
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            lengths.append(0 if cache is None else kv_cache.cache_length(cache))

        input_ids = input_ids.to(self.model.device)
        config = self._config(max_new_tokens)
        handle = self.model.register_forward_pre_hook(count, with_kwargs=True)
        try:
            t0 = time.perf_counter()
            out = self.model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
            )
            _sync(self.model.device)
            seconds = time.perf_counter() - t0
        finally:
            handle.remove()
        prompt_len = input_ids.shape[1]
        tokens = out[0, prompt_len:].tolist()
        # Forward i starts at cache length L_i; it emits L_{i+1} - L_i tokens (the prefill:
        # L_1 - prompt + 1), the last one (prompt + new) - L_last - 1.
        ends = lengths[1:] + [prompt_len + len(tokens) - 1]
        emitted = [b - a for a, b in zip(lengths, ends)]
        emitted[0] += 1 - prompt_len
        return Record(tokens, len(lengths), emitted[0], emitted[1:], seconds)


def head_method(
    target,
    name: str,
    head,
    tree: TreeSpec,
    verifier: Verifier | None = None,
    max_context: int | None = None,
) -> SpeculativeMethod:
    """A draft head decoding over `tree` (resolved where it entered: resolve_tree)."""
    proposer = make_proposer(head, tree)
    generator = SpeculativeGenerator(
        target.model, proposer, verifier or GreedyVerifier(), eos_token_ids(target), max_context
    )
    return SpeculativeMethod(name, generator, tree.depth)


def build_methods(
    target,
    names: Sequence[str],
    head=None,
    tree: TreeSpec | None = None,
    verifier: Verifier | None = None,
    prompt_lookup_num_tokens: int = 10,
    max_context: int | None = None,
) -> list[Method]:
    """Methods by name: plain, hf_generate, hf_prompt_lookup, head (needs head + tree).

    `tree`: the TreeSpec of `head` (eval.engine.tree_spec.resolve_tree, where the tree enters).
    `verifier` (default greedy) decides the tokens of `plain` and `head`; the HF baselines are
    always greedy.
    """
    model, eos = target.model, eos_token_ids(target)
    pad = getattr(target.tokenizer, "pad_token_id", None)
    verifier = verifier or GreedyVerifier()
    methods: list[Method] = []
    for name in names:
        if name == "plain":
            methods.append(PlainMethod(model, eos, verifier))
        elif name == "hf_generate":
            methods.append(HFGenerateMethod(name, model, eos, pad))
        elif name == "hf_prompt_lookup":
            methods.append(HFGenerateMethod(name, model, eos, pad, prompt_lookup_num_tokens))
        elif name == HEAD:
            if head is None or tree is None:
                raise ConfigError("method 'head' needs a trained head (head_path=...) and a tree.")
            methods.append(head_method(target, name, head, tree, verifier, max_context))
        else:
            raise ConfigError(f"unknown method {name!r}: use any of {', '.join(METHODS)}.")
    if len({m.name for m in methods}) != len(methods):
        raise ConfigError(f"methods={list(names)} names one method twice; list each once.")
    return methods
