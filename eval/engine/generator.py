"""The speculative decoding loop: prefill, then propose -> verify (one forward) -> commit.

Batch size 1. The target is an unmodified Hugging Face causal LM with sdpa or eager attention.
Each step feeds the whole draft tree to the target in one forward (4-D tree mask, position ids =
prefix length + depth), the verifier accepts a path, and the cache keeps that path's entries. The
hidden state and logits at the last accepted node come out of the same forward, so accepted
tokens are never recomputed.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from eval.engine import kv_cache
from eval.engine.proposers import DecodeState, Proposer
from eval.engine.tree import Draft, root_only_draft
from eval.engine.verify import GreedyVerifier, Verifier


@dataclass
class GenerationResult:
    """tokens [1, T + n] (prompt then new tokens, like HF generate), new_tokens [n].

    accept_lengths[i]: tokens the i-th tree step produced (accepted candidates + bonus), before
    any truncation at EOS / max_new_tokens / context; their mean is the acceptance length tau.
    num_target_forwards counts the prefill too.
    """

    tokens: Tensor
    new_tokens: Tensor
    num_target_forwards: int
    accept_lengths: list[int] = field(default_factory=list)
    seconds: float = 0.0
    stop_reason: str = ""  # "eos" | "max_new_tokens" | "context"
    draft_seconds: float = 0.0  # of `seconds`, the time the proposer took (drafting)

    @property
    def tau(self) -> float:
        """Mean tokens per tree step (the first token, from the prefill, is not counted)."""
        return sum(self.accept_lengths) / max(len(self.accept_lengths), 1)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens.numel() / self.seconds if self.seconds > 0 else 0.0


class _Output:
    """New tokens so far, cut right after an EOS or at the token budget."""

    def __init__(self, budget: int, budget_reason: str, eos: set[int]):
        self.tokens: list[int] = []
        self.budget, self.budget_reason, self.eos = budget, budget_reason, eos
        self.stop_reason = ""

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            if len(self.tokens) >= self.budget:
                self.stop_reason = self.budget_reason
                return
            self.tokens.append(token)
            if token in self.eos:
                self.stop_reason = "eos"
                return
        if len(self.tokens) >= self.budget:
            self.stop_reason = self.budget_reason

    @property
    def done(self) -> bool:
        return bool(self.stop_reason)


def _eos_set(eos_token_id: int | Iterable[int] | None) -> set[int]:
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(t) for t in eos_token_id}


def _start(model, input_ids: Tensor, max_new_tokens: int, eos, max_context: int | None):
    """Checks and the token budget shared by both decoders."""
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, T] (batch size 1), got {tuple(input_ids.shape)}")
    limit = kv_cache.context_limit(model)
    max_context = limit if max_context is None else max_context
    if max_context > limit:
        raise ValueError(f"max_context={max_context} exceeds what this model supports ({limit}).")
    prompt_len = input_ids.shape[1]
    if prompt_len >= max_context:
        raise ValueError(f"the prompt ({prompt_len} tokens) leaves no room in {max_context}.")
    room = max_context - prompt_len
    if max_new_tokens <= room:
        return max_context, _Output(max_new_tokens, "max_new_tokens", _eos_set(eos))
    return max_context, _Output(room, "context", _eos_set(eos))


def _prefill(
    model, cache, input_ids: Tensor, verifier: Verifier, layers=None
) -> tuple[DecodeState, list[int]]:
    """One forward over the prompt; the verifier picks the first new token from its last logits.

    `layers`: HF hidden_states indices the proposer wants in `DecodeState.step_aux` (or None).
    """
    out = kv_cache.forward_features(model, cache, input_ids, layers=layers)
    first = verifier.verify(
        out.logits[-1:], root_only_draft(int(input_ids[0, -1]), out.logits.device)
    )
    next_tokens = torch.cat([input_ids[0, 1:], torch.tensor(first.tokens, device=input_ids.device)])
    return DecodeState(out.hidden, next_tokens, input_ids.shape[1], out.aux), first.tokens


def _result(input_ids: Tensor, out: _Output, forwards: int, accepts: list[int], t0: float):
    new = torch.tensor(out.tokens, dtype=torch.long)
    tokens = torch.cat([input_ids[0].cpu(), new])[None]
    seconds = time.perf_counter() - t0
    return GenerationResult(tokens, new, forwards, accepts, seconds, out.stop_reason)


class SpeculativeGenerator:
    """Speculative decoding with a proposer (draft tree each step) and a verifier (which path).

    model: the HF causal LM (e.g. `Target.model`), sdpa or eager attention.
    eos_token_id: one id, several, or None (then only max_new_tokens / max_context stop).
    max_context: longest total sequence (prompt + new tokens); default: what the model supports.
    """

    def __init__(
        self,
        model,
        proposer: Proposer,
        verifier: Verifier,
        eos_token_id: int | Iterable[int] | None = None,
        max_context: int | None = None,
    ):
        kv_cache.check_attention(model)
        self.model, self.proposer, self.verifier = model, proposer, verifier
        self.eos_token_id, self.max_context = eos_token_id, max_context
        self.draft_seconds = 0.0  # proposer time since the last `generate` started

    @torch.inference_mode()
    def generate(self, input_ids: Tensor, max_new_tokens: int) -> GenerationResult:
        t0 = time.perf_counter()
        input_ids = input_ids.to(self.model.device)
        max_context, out = _start(
            self.model, input_ids, max_new_tokens, self.eos_token_id, self.max_context
        )
        cache = kv_cache.make_cache(self.model)
        layers = getattr(self.proposer, "feature_layers", None)
        state, first = _prefill(self.model, cache, input_ids, self.verifier, layers)
        out.extend(first)
        forwards, accepts = 1, []
        self.draft_seconds = 0.0
        while not out.done:
            state, emitted = self.step(cache, state, max_context)
            forwards += 1
            accepts.append(len(emitted))
            out.extend(emitted)
        result = _result(input_ids, out, forwards, accepts, t0)
        result.draft_seconds = self.draft_seconds
        return result

    def step(self, cache, state: DecodeState, max_context: int) -> tuple[DecodeState, list[int]]:
        """Propose a tree, verify it in one target forward, commit the accepted path.

        The proposer's wall time is added to `self.draft_seconds` (what drafting costs per step,
        against the verify forward, is what decides the speedup)."""
        t0 = time.perf_counter()
        draft = self.proposer.propose(state)
        if draft.tokens.device.type == "cuda":
            torch.cuda.synchronize(draft.tokens.device)
        self.draft_seconds += time.perf_counter() - t0
        draft = draft.truncated(max_context - 1 - state.position)  # deepest node fits the context
        layers = getattr(self.proposer, "feature_layers", None)
        out = kv_cache.tree_forward_features(
            self.model, cache, draft.tokens, draft.tree.depth, draft.tree.attn_mask, layers
        )
        verdict = self.verifier.verify(out.logits, draft)
        kv_cache.keep_path(cache, state.position, verdict.nodes)
        nodes = torch.tensor(verdict.nodes, device=out.hidden.device)
        emitted = torch.tensor(verdict.tokens, device=out.hidden.device)
        aux = None if out.aux is None else out.aux[nodes]
        state = DecodeState(out.hidden[nodes], emitted, state.position + len(verdict.nodes), aux)
        return state, verdict.tokens


@torch.inference_mode()
def plain_decode(
    model,
    input_ids: Tensor,
    max_new_tokens: int,
    verifier: Verifier | None = None,
    eos_token_id: int | Iterable[int] | None = None,
    max_context: int | None = None,
) -> GenerationResult:
    """The in-run baseline: one token per target forward, through the same cache code.

    The next token is chosen by `verifier` on a root-only tree (greedy by default; pass a
    `SpeculativeSampler` for the sampled baseline).
    """
    t0 = time.perf_counter()
    verifier = verifier or GreedyVerifier()
    input_ids = input_ids.to(model.device)
    _, out = _start(model, input_ids, max_new_tokens, eos_token_id, max_context)
    cache = kv_cache.make_cache(model)
    _, first = _prefill(model, cache, input_ids, verifier)
    out.extend(first)
    root = root_only_draft(first[-1], input_ids.device)
    forwards, accepts = 1, []
    while not out.done:
        logits, _ = kv_cache.forward(model, cache, root.tokens[None])  # [1, 1] -> [1, V]
        verdict = verifier.verify(logits, root)
        forwards += 1
        accepts.append(1)
        out.extend(verdict.tokens)
        root = Draft(root.tree, torch.tensor(verdict.tokens, device=input_ids.device))
    return _result(input_ids, out, forwards, accepts, t0)


def plain_greedy(model, input_ids: Tensor, max_new_tokens: int, **kwargs) -> GenerationResult:
    """Greedy plain decoding (see `plain_decode`)."""
    return plain_decode(model, input_ids, max_new_tokens, GreedyVerifier(), **kwargs)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
