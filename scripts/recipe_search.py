"""The recipe search: variants x training CPU-minute budgets x seeds
(docs/reports/2026-12-02-recipe-search/recipes.md).

    python scripts/recipe_search.py --data SD.jsonl --budgets 15 45 90 \\
        --variants '{baseline: [], muon: [trainer.optimizer=muon]}'
    python scripts/recipe_search.py --report-only       # re-render that recipes.md

Run the same command in a second shell to share the points (each runs under a lock, at
--threads threads). lab/studies/recipes.py documents the data split, how a budget becomes a
step count and how points resume. Exit status 3: some point had greedy mismatches.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REPORT = REPO / "docs" / "reports" / "2026-12-02-recipe-search" / "recipes"
sys.path.insert(0, str(REPO))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, help="fixed conversations file (JSONL)")
    p.add_argument("--variants", help="JSON/YAML file or inline {name: [overrides]}")
    p.add_argument("--experiment", default="eagle3_llama", help="the variants' base experiment")
    p.add_argument("--budgets", type=float, nargs="+", help="training CPU-minutes, e.g. 15 45")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--val-rows", type=int, default=44, help="held-out conversations (>= 40)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per subprocess")
    p.add_argument("--turns", type=int, default=32, help="MT-bench turns (16k; 0: held-out only)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--probe-steps", type=int, default=30, help="steps of a calibration probe")
    p.add_argument("--cpu-s-per-step", type=float, help="a known rate instead of calibrating")
    p.add_argument("--bench", nargs="+", default=[], help="evaluate.py overrides replacing "
                   "MT-bench, e.g. bench=jsonl bench.path=F.jsonl")  # fmt: skip
    p.add_argument("--baseline", default="baseline", help="the variant others are compared to")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "recipes")
    p.add_argument("--docs", type=Path, default=REPORT, help="report folder")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args()

    from data.errors import DraftsmithError
    from lab.studies import recipes
    from lab.studies.recipes_report import render
    from lab.studies.store import load_json
    from lab.studies.variants import parse_variants

    if args.report_only:
        print(render(load_json(args.docs / "results.json"), args.docs))
        return 0
    if not (args.variants and args.budgets):
        p.error("--variants and --budgets are required (or --report-only)")
    try:
        cfg = recipes.SearchConfig(
            variants=parse_variants(args.variants, args.experiment),
            budgets=args.budgets, data=args.data, seeds=args.seeds, out=args.out,
            docs=args.docs, val_rows=args.val_rows, threads=args.threads, turns=args.turns,
            max_new_tokens=args.max_new_tokens, probe_steps=args.probe_steps,
            cpu_s_per_step=args.cpu_s_per_step, bench=tuple(args.bench),
            baseline=args.baseline, invocation=shlex.join(["python", *sys.argv]),
        )  # fmt: skip
        flagged = recipes.run_search(cfg)
    except DraftsmithError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render(load_json(cfg.results_file), cfg.docs))
    if flagged:
        print(f"greedy mismatches in {flagged}: lossless decoding is broken", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
