"""Split an EAGLE-3 head's validation-versus-decoding acceptance gap into its causes (issue 26).

    OMP_NUM_THREADS=1 python scripts/acceptance_gap.py --run-dir /work/runs/e3_base \\
        --limit 32 --max-new-tokens 128 --out docs/reports/2026-12-02-acceptance-gap/gap.json

What it measures and the commands behind the numbers:
docs/reports/2026-12-02-acceptance-gap/README.md; the logic: lab/analysis/acceptance_gap.py
(measure_run). Prints the causes table and the per-depth rates
(markdown) and writes every number to --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere


def main(argv: list[str] | None = None) -> int:
    from lab.analysis.acceptance_gap import NoHeadError, markdown, measure_run
    from train.rundir import write_json_atomic

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

    options = {k: getattr(args, k) for k in ("prompts", "limit", "max_new_tokens", "depth",
               "val_limit", "greedy_limit", "greedy_max_new", "decode_limit", "references",
               "val_references")}  # fmt: skip
    command = " ".join(["python", "scripts/acceptance_gap.py", *(argv or sys.argv[1:])])
    try:
        result = measure_run(args.run_dir, args.head, command=command, **options)
    except NoHeadError as e:
        parser.error(str(e))
    if args.out:
        write_json_atomic(args.out, result)
    print(markdown(result))
    print(json.dumps(result["validation_trainer"], indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
