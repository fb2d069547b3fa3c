"""Split an EAGLE-3 head's validation-versus-decoding acceptance gap into its causes (issue 26).

    OMP_NUM_THREADS=1 python scripts/acceptance_gap.py --run-dir /work/runs/e3_base \\
        --limit 32 --max-new-tokens 128 --out docs/acceptance_gap.json

Reads the run's config (target, data split) and its kept head (best_head, else head; or
--head), then measures on the validation split, on the fp32 target's greedy answers to the
split's first turns and to MT-bench first turns, and while decoding those with a chain of
--depth (eval/analysis/acceptance_gap.py). Prints the causes table and the per-depth rates
(markdown, as docs/acceptance_gap.md shows them) and writes every number to --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere


def references_for(
    path: str | None, target, prompts: list, max_new_tokens: int | list[int]
) -> list[list[int]]:
    """HF generate's greedy answers to `prompts`: read from `path` (JSON) when it holds them for
    this target, these prompts and this length, else computed (and written there)."""
    from eval.analysis.acceptance_gap import hf_greedy
    from train.rundir import write_json_atomic

    want = {"target": target.fingerprint, "max_new_tokens": max_new_tokens}
    asked = [p[0].tolist() for p in prompts]
    if path and Path(path).is_file():
        doc = json.loads(Path(path).read_text())
        rows = doc.get("rows", [])[: len(asked)]
        if {k: doc.get(k) for k in want} == want and [r["prompt"] for r in rows] == asked:
            return [r["tokens"] for r in rows]
    answers = hf_greedy(target, prompts, max_new_tokens)
    if path:
        rows = [{"prompt": p, "tokens": a} for p, a in zip(asked, answers, strict=True)]
        write_json_atomic(path, {**want, "rows": rows})
    return answers


def main(argv: list[str] | None = None) -> int:
    import heads
    from eval.analysis.acceptance_gap import (
        analyse,
        chat_prompts,
        first_turn_prompts,
        load_run,
        markdown,
    )
    from train.rundir import kept_head, write_json_atomic

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True, help="a train.py run dir (config.yaml)")
    parser.add_argument("--head", help="head folder (default: the run's kept head)")
    parser.add_argument("--prompts", default="data/corpora/mt_bench/question.jsonl")
    parser.add_argument("--limit", type=int, default=32, help="MT-bench questions (first turns)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--depth", type=int, default=3, help="the chain's depth")
    parser.add_argument("--val-limit", type=int, help="validation conversations (default all)")
    parser.add_argument(
        "--greedy-limit", type=int, default=0, help="of those, first turns regenerated in fp32"
    )
    parser.add_argument("--greedy-max-new", type=int, default=128, help="their longest answer")
    parser.add_argument("--decode-limit", type=int, help="MT-bench prompts decoded (default all)")
    parser.add_argument("--out", help="write the numbers here (JSON)")
    parser.add_argument("--references", help="HF generate's answers, read/written here (JSON)")
    parser.add_argument("--val-references", help="the same for the regenerated first turns")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    target, val, precision = load_run(args.run_dir)
    head_dir = Path(args.head) if args.head else kept_head(args.run_dir)
    if head_dir is None:
        parser.error(f"{args.run_dir} holds no head (best_head/ or head/): pass --head.")
    head = heads.from_pretrained(str(head_dir), target).eval()
    prompts = chat_prompts(args.prompts, args.limit, target.tokenizer)
    answers = references_for(args.references, target, prompts, args.max_new_tokens)
    val = val[: args.val_limit]
    firsts = first_turn_prompts(val[: args.greedy_limit])
    limits = [min(n, args.greedy_max_new) for _, n in firsts]
    firsts_prompts = [p for p, _ in firsts]
    regenerated = references_for(args.val_references, target, firsts_prompts, limits)
    result = analyse(
        head, target, val, list(zip(prompts, answers, strict=True)),
        list(zip(firsts_prompts, regenerated, strict=True)), args.max_new_tokens, args.depth,
        args.decode_limit, precision,
    )  # fmt: skip
    result["setup"] = {
        "head": str(head_dir),
        "command": " ".join(["python", "scripts/acceptance_gap.py", *(argv or sys.argv[1:])]),
        "validation_conversations": len(val),
        "regenerated_first_turns": len(firsts),
        "decoded": len(prompts[: args.decode_limit]),
        "prompts": args.prompts,
        "limit": args.limit,
        "max_new_tokens": args.max_new_tokens,
        "trainer_precision": {k: str(v) for k, v in precision.items()},
        "seconds": round(time.perf_counter() - started, 1),
    }
    if args.out:
        write_json_atomic(args.out, result)
    print(markdown(result))
    print(json.dumps(result["validation_trainer"], indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
