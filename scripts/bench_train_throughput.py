"""Feature and training throughput on the embedded target (issue 13; lab/throughput/measure.py):
tokens/s of feature extraction (fp32, bf16 weights, bf16 autocast) and the bf16 features' error,
training steps per head (padded, packed, bf16 autocast, per-example targets) and disk
feature-cache reads.

    nice -n 5 python scripts/bench_train_throughput.py --examples 32 --steps 4

Writes docs/reports/2026-12-01-throughput/throughput.md (a table) and throughput.json beside it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lab.throughput.measure import PARTS, ThroughputSettings, default_heads, run  # noqa: E402


def main() -> None:
    defaults = ThroughputSettings(heads=[])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=defaults.model, help="a conf/model option")
    parser.add_argument("--examples", type=int, default=defaults.examples)
    parser.add_argument("--skip", type=int, default=defaults.skip, help="first conversation")
    parser.add_argument("--max-length", type=int, default=defaults.max_length)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--steps", type=int, default=defaults.steps, help="timed steps per run")
    parser.add_argument("--pack-tokens", type=int, default=defaults.pack_tokens)
    parser.add_argument("--heads", nargs="+", default=default_heads())
    parser.add_argument("--threads", type=int, default=defaults.threads)
    parser.add_argument(
        "--parts",
        nargs="+",
        default=list(PARTS),
        choices=PARTS,
        help="what to measure (train alone still extracts fp32 features once, untimed)",
    )
    parser.add_argument("--out", type=Path, default=defaults.out)
    args = parser.parse_args()
    flags = [
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items()
    ]
    command = "python scripts/bench_train_throughput.py " + " ".join(flags)
    report = run(ThroughputSettings(**vars(args)), command)
    from lab.throughput.report import markdown

    print(markdown(report))


if __name__ == "__main__":
    main()
