"""Pick the llama.cpp draft length (--spec-draft-n-max) that maximises tokens/s, from a benchmark.

    python scripts/draft_length.py outputs/eval/<run>            # an evaluate.py run dir

The run must hold `llama_cpp_plain` and `llama_cpp_draft` (drafting n_max tokens). From the
draft's per-position acceptance (share of steps accepting >= i draft tokens) and the measured
milliseconds per target step of both methods (0 drafted tokens: plain; n_max: the draft, its
drafting included), a linear cost model gives the expected tokens/s of every length 0..n_max
(eval.bench.llama_cpp.best_draft_length). Longer drafts than the run's are not extrapolated:
rerun with a larger llama_cpp.draft_n_max to look further. Prints the table and the best length.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere


def step_ms(metrics: dict) -> float:
    """Wall milliseconds per target step of a method (prefill excluded as far as counted)."""
    return 1000 * metrics["seconds"] / max(metrics["target_forwards"], 1)


def main(argv: list[str] | None = None) -> int:
    from eval.bench.llama_cpp import best_draft_length

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="an evaluate.py run dir (summary.json)")
    args = parser.parse_args(argv)
    summary = json.loads((args.run / "summary.json").read_text())
    methods = summary["methods"]
    missing = {"llama_cpp_plain", "llama_cpp_draft"} - set(methods)
    if missing:
        print(f"{args.run}: the run has no {sorted(missing)}; run evaluate.py with "
              "methods=[llama_cpp_plain,llama_cpp_draft]", file=sys.stderr)  # fmt: skip
        return 1
    plain, draft = methods["llama_cpp_plain"]["overall"], methods["llama_cpp_draft"]["overall"]
    at_least = [r or 0.0 for r in draft["accept_rate_by_depth"]]
    n_max = len(at_least)
    costs = {0: step_ms(plain), n_max: step_ms(draft)}
    best, speed = best_draft_length(at_least, costs)
    print(f"per-position acceptance {[round(a, 3) for a in at_least]}; ms per step: "
          f"plain {costs[0]:.1f}, draft of {n_max} {costs[n_max]:.1f}")  # fmt: skip
    for k, tps in speed.items():
        print(f"  draft {k}: expected {tps:.1f} tokens/s" + ("  <- best" if k == best else ""))
    print(f"best --spec-draft-n-max: {best}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
