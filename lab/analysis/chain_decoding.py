"""What speculative chain decoding drafted, round by round, for lab/analysis/acceptance_gap.py.

`ChainRecorder` wraps the harness's proposer (eval/engine/drafting.py `make_proposer`) and
records, per verification round, the root position and the drafted chain; `decode_stats` reads
acceptance per depth off those rounds and checks them against the training-time-test unroll of
the decoded sequence at the same rows (a mismatch would be a train/decode difference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from heads.acceptance import accepted_lengths


def _ratio(a, b) -> float:
    return float(a) / float(b) if float(b) else 0.0


class ChainRecorder:
    """A proposer that records what the one it wraps drafted: `rounds`, one (root position,
    [token at depth 1, 2, ...]) per verification round (a chain tree: one node per depth)."""

    def __init__(self, proposer) -> None:
        self.proposer = proposer
        self.feature_layers = getattr(proposer, "feature_layers", None)
        self.rounds: list[tuple[int, list[int]]] = []

    def propose(self, state):
        draft = self.proposer.propose(state)
        depth = draft.tree.depth.tolist()
        if len(set(depth)) != len(depth):
            raise ValueError("ChainRecorder records chains: give a chain tree (one node a depth).")
        by_depth = sorted(range(len(depth)), key=depth.__getitem__)
        self.rounds.append((state.position, [int(draft.tokens[j]) for j in by_depth[1:]]))
        return draft


@dataclass
class DecodedTurn:
    """One prompt through speculative chain decoding, and through HF generate (fp32 greedy)."""

    prompt: list[int]
    tokens: list[int]  # the speculative decoder's new tokens
    reference: list[int]  # HF generate's greedy new tokens
    rounds: list[tuple[int, list[int]]]
    forwards: int  # target forwards, the prefill included

    def sequence(self) -> tuple[Tensor, Tensor]:
        """(input_ids, loss_mask) (T,): the prompt then the decoded answer, labels on the answer."""
        ids = torch.tensor(self.prompt + self.tokens)
        mask = torch.zeros_like(ids)
        mask[len(self.prompt) :] = 1
        return ids, mask


@torch.no_grad()
def hf_greedy(target, prompts: list[Tensor], max_new_tokens: int | list[int]) -> list[list[int]]:
    """HF generate's greedy new tokens for each prompt [1, P] (the target's own dtype), at most
    `max_new_tokens` (one number, or one per prompt)."""
    from data.generation import eos_token_ids
    from eval.bench.methods import HFGenerateMethod

    hf = HFGenerateMethod("hf", target.model, eos_token_ids(target), target.tokenizer.pad_token_id)
    limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
    return [hf.run(ids, n).tokens for ids, n in zip(prompts, limits, strict=True)]


@torch.no_grad()
def decode_turns(
    head, target, prompts: list[Tensor], max_new_tokens: int, depth: int,
    references: list[list[int]] | None = None,
) -> list[DecodedTurn]:  # fmt: skip
    """Greedy chain decoding (depth `depth`) of each prompt [1, P], recorded, beside HF
    generate's answer (`references`, computed when not given)."""
    from data.generation import eos_token_ids
    from eval.engine.drafting import make_proposer
    from eval.engine.generator import SpeculativeGenerator
    from eval.engine.tree_spec import resolve_tree
    from eval.engine.verify import GreedyVerifier

    head.eval()
    references = references or hf_greedy(target, prompts, max_new_tokens)
    recorder = ChainRecorder(make_proposer(head, resolve_tree(depth)))
    generator = SpeculativeGenerator(
        target.model, recorder, GreedyVerifier(), eos_token_id=eos_token_ids(target)
    )
    turns = []
    for ids, reference in zip(prompts, references, strict=True):
        recorder.rounds = []
        result = generator.generate(ids, max_new_tokens)
        turns.append(
            DecodedTurn(
                ids[0].tolist(), result.new_tokens.tolist(), reference, recorder.rounds,
                result.num_target_forwards,
            )
        )  # fmt: skip
    return turns


def decode_stats(turns: list[DecodedTurn], seqs: list) -> dict:
    """Measured tau and acceptance per depth of the recorded rounds, and how they compare with
    the teacher-forced unroll of the same sequences (`seqs[k]` of `turns[k].sequence()`) at
    the rows decoding queried: `drafted_mismatches` counts drafted tokens (at depths whose
    context was right) that differ from the unroll's, `accepted_mismatches` rounds whose
    accepted length differs; both 0 when drafting and training agree."""
    S = len(turns[0].rounds[0][1]) if turns and turns[0].rounds else 0
    reach_n, reach_hit, any_n = [0] * S, [0] * S, [0] * S
    drafted_diff = accepted_diff = tokens = forwards = 0
    for turn, seq in zip(turns, seqs, strict=True):
        full = turn.prompt + turn.tokens
        tokens, forwards = tokens + len(turn.tokens) - 1, forwards + turn.forwards - 1
        tf_accepted = accepted_lengths(seq.hits[:, None])[0]
        for position, chain in turn.rounds:
            accepted, alive = 0, True
            for i, token in enumerate(chain):
                if position + 1 + i >= len(full):
                    break
                any_n[i] += 1
                if alive:
                    reach_n[i] += 1
                    drafted_diff += int(token != int(seq.drafted[i, position - 1]))
                    alive = token == full[position + 1 + i]
                    reach_hit[i] += int(alive)
                    accepted += int(alive)
            accepted_diff += int(accepted != int(tf_accepted[position - 1]))
    unconditional = [_ratio(h, n) for h, n in zip(reach_hit, any_n, strict=True)]
    return {
        "tau": _ratio(tokens, forwards),
        "rounds": sum(len(t.rounds) for t in turns),
        "accept": [_ratio(h, n) for h, n in zip(reach_hit, reach_n, strict=True)],
        "accept_unconditional": unconditional,
        "drafted_mismatches": drafted_diff,
        "accepted_mismatches": accepted_diff,
        "greedy_mismatches": sum(t.tokens != t.reference for t in turns),
    }


def queried_rows(turns: list[DecodedTurn]) -> list[list[int]]:
    """Per turn, the rows t = position - 1 at which decoding queried the draft."""
    return [[position - 1 for position, _ in turn.rounds] for turn in turns]
