"""Did Medusa-2's adapter keep the target's quality? The target's own language-model loss on
held-out human conversations, with and without a Medusa-2 head's adapter.

    python scripts/target_quality.py outputs/<run>/best_head --out outputs/quality.json

For each conversation it scores the assistant tokens (the training loss mask) under the original
target (adapter off) and the adapted one: mean next-token cross-entropy (nats) and perplexity,
the KL from the original's next-token distribution to the adapted one, and how often the two
greedy next tokens agree (1.0 means greedy decoding is unchanged on these prefixes). The default
held-out set is gpteacher roleplay rows 1800-1863 and oasst_en conversations 200-263; the default
recipe (data=smollm2_distilled) trains on neither (it reads the first 40 and 24 rows).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("head", type=Path, help="a Medusa-2 head folder")
    parser.add_argument("--model", default="smollm2_135m", help="a conf/model option")
    parser.add_argument("--sets", nargs="+", default=DEFAULT_SETS, help="PATH:START:STOP ...")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--out", type=Path, default=Path("outputs/target_quality.json"))
    args = parser.parse_args()

    import heads
    from data.dataset import build_examples
    from heads.medusa2 import Medusa2Head
    from train.rundir import load_conf_target

    target = load_conf_target(args.model)
    head = heads.from_pretrained(args.head, target)
    if not isinstance(head, Medusa2Head):
        raise SystemExit(f"{args.head} holds a {head.method} head: give a Medusa-2 head folder.")
    report = {"head": str(args.head), "sets": {}}
    for spec in args.sets:
        examples = build_examples(held_out(spec), target.tokenizer, args.max_length)
        report["sets"][spec] = score(target, head, examples) | {"conversations": len(examples)}
        print(spec, json.dumps({k: round(v, 4) for k, v in report["sets"][spec].items()}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
