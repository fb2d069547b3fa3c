"""Pick the llama.cpp draft length (--spec-draft-n-max) that maximises tokens/s, from a benchmark.

    python scripts/draft_length.py outputs/eval/<run>            # an evaluate.py run dir

The run must hold `llama_cpp_plain` and `llama_cpp_draft` (drafting n_max tokens). From the
draft's per-position acceptance (share of steps accepting >= i draft tokens) and the measured
milliseconds per target step of both methods (0 drafted tokens: plain; n_max: the draft, its
drafting included), a linear cost model gives the expected tokens/s of every length 0..n_max
(eval.bench.llama_cpp.best_draft_length). Longer drafts than the run's are not extrapolated:
rerun with a larger llama_cpp.draft_n_max to look further. Prints the table and the best length.

    python scripts/draft_length.py outputs/eval/<run> --ceiling docs/engine_ceiling --type q4_0

takes the step costs from an engine-ceiling run instead (eval/studies/engine_ceiling.py): that
type's
measured verify-cost curve (llama-bench, batches of 1..16 tokens), its server overhead and
draft cost per token, so lengths beyond the run's are priced from measurement; prints n-max and
n-min (the shortest draft still faster than not drafting).
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
    from eval.bench.llama_cpp import best_draft_length, draft_length_limits

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
    at_least = [r or 0.0 for r in draft["accept_rate_by_depth"]]
    n_max = len(at_least)
    if args.ceiling:
        best, speed = _from_ceiling(at_least, args.ceiling, args.type)
    else:
        costs = {0: step_ms(plain), n_max: step_ms(draft)}
        best, speed = best_draft_length(at_least, costs)
        print(f"per-position acceptance {[round(a, 3) for a in at_least]}; ms per step: "
              f"plain {costs[0]:.1f}, draft of {n_max} {costs[n_max]:.1f}")  # fmt: skip
    for k, tps in speed.items():
        print(f"  draft {k}: expected {tps:.1f} tokens/s" + ("  <- best" if k == best else ""))
    n_max, n_min = draft_length_limits(speed)
    print(f"best --spec-draft-n-max: {n_max}, --spec-draft-n-min: {n_min}")
    return 0


def _from_ceiling(at_least: list[float], ceiling: Path, target_type: str | None):
    """best_draft_length on a ceiling run's measured curve for one type."""
    from eval.bench.llama_cpp import best_draft_length

    types = json.loads((ceiling / "summary.json").read_text())["types"]
    entry = types.get(target_type)
    if entry is None:
        raise SystemExit(f"--type {target_type}: the ceiling run measured {sorted(types)}")
    curve = {int(k): v for k, v in entry["verify_curve"]["ms"].items()}
    length = (entry.get("own") or {}).get("draft_length") or {}
    draft_ms, overhead = length.get("draft_ms_per_token", 0.0), length.get("overhead_ms", 0.0)
    print(f"{target_type}: verify ms by batch {curve}; draft {draft_ms:.2f} ms/token, server "
          f"overhead {overhead:.2f} ms/step (from {ceiling})")  # fmt: skip
    return best_draft_length(
        at_least, draft_ms_per_token=draft_ms, verify_ms=curve, overhead_ms=overhead
    )


if __name__ == "__main__":
    sys.exit(main())
