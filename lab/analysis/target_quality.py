"""Did Medusa-2's adapter keep the target's quality? (scripts/target_quality.py)

For each held-out conversation `score` rates the assistant tokens (the training loss mask) under
the original target (adapter off) and the adapted one: mean next-token cross-entropy (nats) and
perplexity, the KL from the original's next-token distribution to the adapted one, and how
often the two greedy next tokens agree (1.0 means greedy decoding is unchanged on these
prefixes). The default held-out set is gpteacher roleplay rows 1800-1863 and oasst_en
conversations 200-263; the default recipe (data=smollm2_distilled) trains on neither (it reads
the first 40 and 24 rows).
"""

from __future__ import annotations

import json

import torch

DEFAULT_SETS = [
    "data/corpora/gpteacher_roleplay/roleplay-simple-deduped-roleplay-instruct.json:1800:1864",
    "data/corpora/oasst_en/conversations.jsonl:200:264",
]


def held_out(spec: str):
    """PATH:START:STOP -> those conversations of the file."""
    from data.formats import read_conversations
    from data.paths import resolve_path

    path, start, stop = spec.rsplit(":", 2)
    rows = read_conversations(str(resolve_path(path)), "auto", int(stop))
    return rows[int(start) :]


@torch.no_grad()
def score(target, head, examples: list[dict]) -> dict:
    """Cross-entropy, perplexity, KL and greedy agreement of the adapted target against the
    original on `examples`' assistant tokens (see the module doc)."""
    from data.dataset import collate

    sums = {"ce_original": 0.0, "ce_adapted": 0.0, "kl": 0.0, "agree": 0.0}
    count = 0
    for example in examples:
        batch = collate([example], pad_id=target.tokenizer.pad_token_id or 0)
        ids, mask = batch["input_ids"], batch["loss_mask"]
        labels = ids[:, 1:]
        keep = mask[:, 1:].bool()  # position t predicts token t+1, scored where t+1 is an answer
        logits_adapted = target.model(input_ids=ids).logits[:, :-1][keep].float()
        with head.adapted.disable_adapter():
            logits_original = target.model(input_ids=ids).logits[:, :-1][keep].float()
        gold = labels[keep]
        lp_a, lp_o = logits_adapted.log_softmax(-1), logits_original.log_softmax(-1)
        sums["ce_adapted"] += -lp_a.gather(-1, gold[:, None]).sum().item()
        sums["ce_original"] += -lp_o.gather(-1, gold[:, None]).sum().item()
        sums["kl"] += (lp_o.exp() * (lp_o - lp_a)).sum().item()
        sums["agree"] += (lp_a.argmax(-1) == lp_o.argmax(-1)).sum().item()
        count += int(keep.sum())
    out = {k: v / count for k, v in sums.items()} | {"tokens": count}
    out["ppl_original"] = float(torch.tensor(out["ce_original"]).exp())
    out["ppl_adapted"] = float(torch.tensor(out["ce_adapted"]).exp())
    out["ce_change_pct"] = 100 * (out["ce_adapted"] / out["ce_original"] - 1)
    return out


def quality_report(target, head, sets: list[str], max_length: int, log=print) -> dict:
    """`score` on each PATH:START:STOP set (conversations cut at `max_length` tokens), logging a
    line a set: {"head": ..., "sets": {spec: scores | {"conversations": n}}} without the head."""
    from data.dataset import build_examples

    report = {"sets": {}}
    for spec in sets:
        examples = build_examples(held_out(spec), target.tokenizer, max_length)
        report["sets"][spec] = score(target, head, examples) | {"conversations": len(examples)}
        log(f"{spec} {json.dumps({k: round(v, 4) for k, v in report['sets'][spec].items()})}")
    return report
