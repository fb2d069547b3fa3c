"""The scale study: what self-distilled data buys a draft
(docs/reports/2026-12-01-scaling/README.md; the study itself is lab/studies/scaling.py, whose
docstring says what each point trains and measures).

    python scripts/scaling_study.py --data SD.jsonl --budgets 25000 100000 400000
    python scripts/scaling_study.py --report-only   # re-render the report's table and plots
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from data.errors import ConfigError, DraftsmithError  # noqa: E402
from lab.studies.scaling import EXPERIMENTS, StudyConfig, run_study  # noqa: E402


def main() -> None:
    d = StudyConfig(report_only=True)  # the defaults
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, help="self-distilled conversations (JSONL)")
    p.add_argument("--budgets", type=int, nargs="+", default=d.budgets)
    p.add_argument("--methods", nargs="+", default=d.methods, choices=list(EXPERIMENTS))
    p.add_argument("--steps", type=json.loads, default=d.steps, help="steps per method (JSON)")
    p.add_argument("--kind", default=d.kind, help="the kind of --data, naming its points")
    p.add_argument("--shuffle", action="store_true", help="seeded shuffle before the held-out cut")
    p.add_argument("--val-rows", type=int, default=d.val_rows)
    p.add_argument("--max-length", type=int, default=d.max_length, help="data.max_length")
    p.add_argument("--per-category", type=int, default=d.per_category)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--threads", type=int, default=None, help="torch threads per run")
    p.add_argument("--gen-tokens-per-s", type=float, help="generation rate of --data")
    p.add_argument("--compare", nargs="*", default=[], help="corpus_prompts=FILE and/or human")
    p.add_argument("--dynamic-at", type=int, nargs="*", help="budgets with EAGLE-3's dynamic tree")
    p.add_argument("--out", type=Path, default=d.out)
    p.add_argument("--docs", type=Path, default=d.docs)
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args()
    try:
        cfg = StudyConfig(**vars(args))
    except ConfigError as err:
        p.error(str(err))
    try:
        run_study(cfg)
    except DraftsmithError as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
