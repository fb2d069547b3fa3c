"""Write or check the README's results table and docs/results.md (lab.results_table).

    python scripts/results_table.py --write   # after adding or changing a report in docs/
    python scripts/results_table.py --check   # exit 1 if either file is out of date

Both are rendered from the committed reports' summary.json files and their source.json sidecars.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from data.errors import DraftsmithError  # noqa: E402
from lab import results_table  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--write", action="store_true", help="rewrite README.md's block and docs/results.md"
    )
    mode.add_argument("--check", action="store_true", help="exit 1 if they differ from the reports")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout (default: this one)")
    args = parser.parse_args(argv)
    try:
        if args.check:
            message = results_table.check(args.root)
            if message:
                print(message, file=sys.stderr)
                return 1
            print("README.md and docs/results.md agree with the reports.")
            return 0
        changed = results_table.write(args.root)
        print(
            "wrote " + ", ".join(str(p.relative_to(args.root)) for p in changed)
            if changed
            else "README.md and docs/results.md were already up to date."
        )
        return 0
    except DraftsmithError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
