"""Checkpoint-time evaluation: the acceptance length tau of a head while it trains.

The training loop (train/) never imports eval/; the entry point builds a `TauEvaluator` (Hydra
`_target_: eval.engine.tau.TauEvaluator`) and injects it. Calling it with the head and the target
runs greedy speculative decoding on a few prompts (first turns, chat template applied) and
returns {"tau", "tau_per_request"} with the benchmark's definitions (eval/bench/report.py):
tokens emitted by the decode forwards over the decode forwards, the prefill excluded.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from data.generation import eos_token_ids
from data.paths import resolve_path
from eval.engine.drafting import make_proposer
from eval.engine.generator import SpeculativeGenerator
from eval.engine.tree_spec import resolve_tree
from eval.engine.verify import GreedyVerifier


class TauEvaluator:
    """`evaluator(head, target) -> {"tau": float, "tau_per_request": float}`.

    prompts_path: a prompt JSONL (data.read_prompts); the first `limit` questions' first turns.
    tree: anything eval.engine.tree_spec.resolve_tree takes: a conf/tree option name (`tree16`,
          `dynamic`) or *.yaml file, a list of paths (e.g. [[0], [0, 0]]), an int d for a chain
          of d top-1 tokens (e.g. `tree: ${head.num_heads}` in a Hydra config), or an EAGLE-2
          dynamic tree (a mapping {depth, top_k, total_tokens}; EAGLE and EAGLE-3 heads only).
          A Medusa tree must be no deeper than the head drafts (K heads draft K tokens).
    chat_template: for tokenizers without one (see data.resolve_chat_template).
    The head is put in eval mode for the call and back in its previous mode afterwards.
    """

    def __init__(
        self,
        prompts_path: str | Path,
        limit: int = 4,
        max_new_tokens: int = 32,
        tree: int | str | Path | list | dict = "conf/tree/chain.yaml",
        chat_template: str | None = None,
    ):
        from data import read_prompts

        if limit < 1 or max_new_tokens < 1:
            raise ValueError(f"limit={limit}, max_new_tokens={max_new_tokens}: need >= 1 each.")
        path = resolve_path(prompts_path)
        if not path.is_file():
            raise FileNotFoundError(f"TauEvaluator: no prompt file at {prompts_path}.")
        self.turns = [q["turns"][0] for q in read_prompts(str(path))[:limit]]
        self.max_new_tokens, self.chat_template = max_new_tokens, chat_template
        self.tree = resolve_tree(tree)
        self._encoded: tuple[object, list[Tensor]] | None = None  # (tokenizer, prompts)

    def _prompts(self, tokenizer) -> list[Tensor]:
        from data.chat import ChatEncoder

        if self._encoded is None or self._encoded[0] is not tokenizer:
            encoder = ChatEncoder(tokenizer, self.chat_template)
            ids = [
                torch.tensor([encoder.prompt([{"role": "user", "content": t}])], dtype=torch.long)
                for t in self.turns
            ]
            self._encoded = (tokenizer, ids)
        return self._encoded[1]

    @torch.no_grad()
    def decode(self, head, target) -> list:
        """Greedy speculative decoding of every prompt: the GenerationResults, in order."""
        was_training = head.training
        head.eval()
        try:
            generator = SpeculativeGenerator(
                target.model,
                make_proposer(head, self.tree),
                GreedyVerifier(),
                eos_token_id=eos_token_ids(target),
            )
            return [
                generator.generate(ids, self.max_new_tokens)
                for ids in self._prompts(target.tokenizer)
            ]
        finally:
            head.train(was_training)

    @staticmethod
    def tau_of(results: list) -> dict[str, float]:
        """Acceptance length over the decode steps (the prefill's token and forward left out)."""
        tokens, forwards, per_request = 0, 0, []
        for result in results:
            decode_tokens = result.new_tokens.numel() - 1  # the prefill emits one token
            decode_forwards = result.num_target_forwards - 1
            tokens, forwards = tokens + decode_tokens, forwards + decode_forwards
            if decode_forwards:
                per_request.append(decode_tokens / decode_forwards)
        return {
            "tau": tokens / forwards if forwards else 0.0,
            "tau_per_request": sum(per_request) / len(per_request) if per_request else 0.0,
        }

    def __call__(self, head, target) -> dict[str, float]:
        return self.tau_of(self.decode(head, target))
