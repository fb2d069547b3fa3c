"""Pick the llama.cpp draft length (--spec-draft-n-max) that maximises tokens/s, from a benchmark.

    python scripts/draft_length.py outputs/eval/<run>            # an evaluate.py run dir
    python scripts/draft_length.py outputs/eval/<run> --type q4_0 \\
        --ceiling docs/reports/2026-12-02-engine-ceiling

The cost model and what --ceiling adds: docs/guides/llama_cpp.md ("Draft length").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere


def main(argv: list[str] | None = None) -> int:
    from eval.bench.llama_cpp import best_draft_length, draft_length_limits, measured_step_costs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="an evaluate.py run dir (summary.json)")
    parser.add_argument("--ceiling", type=Path, help="an engine-ceiling dir (summary.json)")
    parser.add_argument("--type", help="with --ceiling: the target type to price steps on")
    args = parser.parse_args(argv)
    summary = json.loads((args.run / "summary.json").read_text())
    methods = summary["methods"]
    missing = {"llama_cpp_plain", "llama_cpp_draft"} - set(methods)
    if missing:
        print(f"{args.run}: the run has no {sorted(missing)}; run evaluate.py with "
              "methods=[llama_cpp_plain,llama_cpp_draft]", file=sys.stderr)  # fmt: skip
        return 1
    plain, draft = methods["llama_cpp_plain"]["overall"], methods["llama_cpp_draft"]["overall"]
    at_least, costs = measured_step_costs(plain, draft)
    n_max = len(at_least)
    if args.ceiling:
        from data.errors import ConfigError
        from eval.bench.engine_ceiling import ceiling_costs

        try:
            c = ceiling_costs(json.loads((args.ceiling / "summary.json").read_text()), args.type)
        except ConfigError as e:
            raise SystemExit(str(e)) from None
        print(f"{args.type}: verify ms by batch {c['verify_ms']}; draft "
              f"{c['draft_ms_per_token']:.2f} ms/token, server overhead "
              f"{c['overhead_ms']:.2f} ms/step (from {args.ceiling})")  # fmt: skip
        best, speed = best_draft_length(at_least, **c)
    else:
        best, speed = best_draft_length(at_least, costs)
        print(f"per-position acceptance {[round(a, 3) for a in at_least]}; ms per step: "
              f"plain {costs[0]:.1f}, draft of {n_max} {costs[n_max]:.1f}")  # fmt: skip
    for k, tps in speed.items():
        print(f"  draft {k}: expected {tps:.1f} tokens/s" + ("  <- best" if k == best else ""))
    n_max, n_min = draft_length_limits(speed)
    print(f"best --spec-draft-n-max: {n_max}, --spec-draft-n-min: {n_min}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
