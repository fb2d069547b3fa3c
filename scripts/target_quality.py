"""Did Medusa-2's adapter keep the target's quality? The target's own language-model loss on
held-out human conversations, with and without a Medusa-2 head's adapter.

    python scripts/target_quality.py outputs/<run>/best_head --out outputs/quality.json

What it scores and the default held-out sets: lab/analysis/target_quality.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere


def main() -> None:
    from lab.analysis.target_quality import DEFAULT_SETS, quality_report

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("head", type=Path, help="a Medusa-2 head folder")
    parser.add_argument("--model", default="smollm2_135m", help="a conf/model option")
    parser.add_argument("--sets", nargs="+", default=DEFAULT_SETS, help="PATH:START:STOP ...")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--out", type=Path, default=Path("outputs/target_quality.json"))
    args = parser.parse_args()

    import heads
    from heads.medusa2 import Medusa2Head
    from train.rundir import load_conf_target

    target = load_conf_target(args.model)
    head = heads.from_pretrained(args.head, target)
    if not isinstance(head, Medusa2Head):
        raise SystemExit(f"{args.head} holds a {head.method} head: give a Medusa-2 head folder.")
    report = {"head": str(args.head)} | quality_report(target, head, args.sets, args.max_length)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
