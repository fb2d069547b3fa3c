"""The work of self-distillation (data/distill.py): the conversations to write, one per (prompt,
sample) with its key `SOURCE/PROMPT_ID/SAMPLE`, and a batch of them generated turn by turn.

A multi-turn prompt replays its user turns and regenerates each answer in turn; a None user turn
is written by the target itself (prompt synthesis, data/synthesize.py). A conversation whose
rendered prompt exceeds `max_prompt_tokens` at some turn keeps the turns before it; if that
leaves no answer, its key is skipped with the reason.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from data.formats import DataFormatError, read_prompts
from data.paths import resolve_path
from data.synthesize import SynthesisSpec, sample_user_turns


@dataclass
class WorkItem:
    """One conversation to write. A None turn is a user turn the target writes itself (a
    synthesised follow-up, sampled as `synth` says); `system` opens the conversation."""

    key: str
    source: str
    prompt_id: str
    sample: int
    turns: list[str | None]
    system: str | None = None
    synth: SynthesisSpec | None = None


def synthesis_specs(cfg) -> list[SynthesisSpec]:
    return [SynthesisSpec(**p["synthesize"]) for p in cfg.prompts if "synthesize" in p]


def work_items(cfg, synthesized: dict[str, list[dict]] | None = None) -> list[WorkItem]:
    """Every (prompt, sample) of every source of `cfg` (a DistillConfig), in a fixed order.
    synthesized: the accepted prompts of each synthesis entry by name (data.synthesize)."""
    items, seen = [], set()
    for spec in cfg.prompts:
        if "synthesize" in spec:
            synth = SynthesisSpec(**spec["synthesize"])
            if synth.name in seen:
                raise DataFormatError(
                    f"two prompt sources are named {synth.name!r}; give each synthesis entry "
                    "its own name"
                )
            seen.add(synth.name)
            for prompt in (synthesized or {}).get(synth.name, []):
                for sample in range(cfg.num_samples):
                    key = f"{synth.name}/{prompt['id']}/{sample}"
                    items.append(
                        WorkItem(
                            key,
                            synth.name,
                            str(prompt["id"]),
                            sample,
                            prompt["turns"],
                            synth.system,
                            synth,
                        )
                    )
            continue
        source = spec["path"]
        path = resolve_path(source)
        found = str(path) if path.exists() else source
        prompts = read_prompts(found, split=spec["split"])[spec["skip"] :]
        limit = spec["max_rows"] if spec["max_rows"] is not None else cfg.max_rows
        name = Path(source).stem if path.exists() else source
        if name == "question" or name in seen:  # e.g. data/corpora/X/question.jsonl
            name = f"{Path(source).parent.name}_{name}"
        seen.add(name)
        for prompt in prompts[:limit] if limit else prompts:
            for sample in range(cfg.num_samples):
                key = f"{name}/{prompt['id']}/{sample}"
                items.append(WorkItem(key, name, str(prompt["id"]), sample, prompt["turns"]))
    keys = [item.key for item in items]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise DataFormatError(f"prompt id {dup!r} occurs twice in one source; ids must be unique.")
    return items


def turn_seed(base: int, keys: Sequence[str], turn: int) -> int:
    digest = hashlib.sha1(f"{base}|{turn}|{'|'.join(keys)}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def run_batch(gen, batch: list[WorkItem], cfg, meta: dict):
    """All turns of a batch of conversations: (rows, skipped rows, new tokens). gen: a started
    generator (HFGenerator or ServerGenerator); cfg: the DistillConfig; meta: the output's meta."""
    histories: list[list[dict]] = [
        [{"role": "system", "content": item.system}] if item.system else [] for item in batch
    ]
    finish: list[list[str]] = [[] for _ in batch]
    open_items = set(range(len(batch)))
    reasons: dict[int, str] = {}
    tokens = 0
    for turn in range(max(len(item.turns) for item in batch)):
        user = _user_turns(gen, batch, histories, open_items, turn, cfg, reasons)
        active, prompts = [], []
        for i in sorted(open_items):
            if turn >= len(batch[i].turns):
                continue
            history = histories[i] + [{"role": "user", "content": user[i]}]
            ids = gen.encoder.prompt(history)
            if len(ids) > cfg.max_prompt_tokens:
                open_items.discard(i)  # the conversation ends before this turn
                reasons[i] = f"turn {turn + 1} prompt has {len(ids)} > max_prompt_tokens tokens"
                continue
            histories[i] = history
            active.append(i)
            prompts.append(ids)
        if not active:
            break
        answers = gen.generate(prompts, turn_seed(cfg.seed, [batch[i].key for i in active], turn))
        for i, (ids, why) in zip(active, answers):
            text = gen.tok.decode(ids, skip_special_tokens=True)
            histories[i].append({"role": "assistant", "content": text})
            finish[i].append(why)
            tokens += len(ids) + (why == "eos")
    rows, skipped = [], []
    for i, item in enumerate(batch):
        history = histories[i]
        if not any(m["role"] == "assistant" for m in history):
            skipped.append({"id": item.key, "reason": reasons.get(i, "no turn generated")})
            continue
        rows.append(
            {
                "id": item.key,
                "source": item.source,
                "prompt_id": item.prompt_id,
                "sample": item.sample,
                "messages": history,
                "finish": finish[i],
                "target_fingerprint": meta["target_fingerprint"],
            }
        )
    return rows, skipped, tokens


def _user_turns(gen, batch, histories, open_items, turn: int, cfg, reasons) -> dict[int, str]:
    """This turn's user text per open conversation: given, or (None in the prompt) sampled by
    the target after the conversation so far; a sampled turn the filters reject ends the
    conversation before it."""
    user, ask = {}, []
    for i in sorted(open_items):
        if turn < len(batch[i].turns):
            if batch[i].turns[turn] is None:
                ask.append(i)
            else:
                user[i] = batch[i].turns[turn]
    for synth in {id(batch[i].synth): batch[i].synth for i in ask}.values():
        group = [i for i in ask if batch[i].synth is synth]
        seed = turn_seed(cfg.seed, [batch[i].key for i in group], turn) ^ 0x5A5A
        sampled = sample_user_turns(gen, gen.encoder, [histories[i] for i in group], synth, seed)
        for i, (text, reject) in zip(group, sampled):
            if reject:
                open_items.discard(i)
                reasons[i] = f"turn {turn + 1}: the sampled follow-up was rejected ({reject})"
            else:
                user[i] = text
    return user


__all__ = ["WorkItem", "run_batch", "synthesis_specs", "turn_seed", "work_items"]
