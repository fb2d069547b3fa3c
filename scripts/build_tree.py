"""Write conf/tree/*.yaml: static Medusa trees chosen by estimated acceptance.

    python scripts/build_tree.py --nodes 16 32 64 --out conf/tree

A path's score is the product of per-head, per-rank acceptance estimates (`ACCURACY` below, or a
JSON file of measured values via --accuracy); the N - 1 best paths form the N-node tree. Measure
the estimates on your own heads (per-head top-k accuracy from training) for a tree that fits them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eval.engine.tree import chain_paths, expected_acceptance_paths

# accuracy[d][r]: how often head d's rank-r token is right (rough Medusa-1 figures on a chat model;
# later heads are weaker, lower ranks quickly become unlikely).
TAIL = [0.03, 0.02, 0.015, 0.01, 0.01, 0.008, 0.007]
ACCURACY = [
    [0.60, 0.10, 0.05] + TAIL,
    [0.40, 0.09, 0.05] + TAIL,
    [0.30, 0.08, 0.04] + TAIL,
    [0.25, 0.07, 0.04] + TAIL,
]


def write_tree(path: Path, paths: list[list[int]], comment: str) -> None:
    lines = [
        f"# {comment}",
        f"# {len(paths) + 1} nodes (root included), depth "
        f"{max((len(p) for p in paths), default=0)}.",
        "paths:",
    ]
    lines += [f"  - {json.dumps(p)}" for p in paths]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--chain", type=int, default=4, help="depth of chain.yaml")
    parser.add_argument("--accuracy", type=Path, help="JSON [[head0 rank0, rank1, ...], ...]")
    parser.add_argument("--out", type=Path, default=Path("conf/tree"))
    args = parser.parse_args()
    accuracy = json.loads(args.accuracy.read_text()) if args.accuracy else ACCURACY
    args.out.mkdir(parents=True, exist_ok=True)
    write_tree(args.out / "chain.yaml", chain_paths(args.chain), "A single chain of top-1 tokens.")
    for n in args.nodes:
        paths = expected_acceptance_paths(accuracy, n)
        comment = "Medusa tree: the best paths by estimated acceptance (scripts/build_tree.py)."
        write_tree(args.out / f"tree{n}.yaml", paths, comment)


if __name__ == "__main__":
    main()
