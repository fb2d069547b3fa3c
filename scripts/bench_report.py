"""Rebuild a benchmark's summary.json and report.md from its results.jsonl, and print a compact
table per group of categories (a run stopped early keeps every finished question's rows).

    python scripts/bench_report.py RUN_DIR
    python scripts/bench_report.py RUN_DIR --group mt_bench=writing,roleplay,reasoning,math,\\
coding,extraction,stem,humanities --group other=translation,summarization,qa,math_reasoning,rag
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eval.bench.report import group_metrics, summarize, write_report


def table(rows: list[dict], depths: dict[str, int]) -> list[str]:
    out = [
        "| method | requests | tau | tokens/s | speedup vs plain | draft ms/step | "
        "target ms/forward | greedy mismatches (near ties) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    metrics = {
        m: group_metrics([r for r in rows if r["method"] == m], d) for m, d in depths.items()
    }
    plain = metrics.get("plain", {}).get("tokens_per_s")
    for name, m in metrics.items():
        if not m["requests"]:
            continue
        speedup = f"{m['tokens_per_s'] / plain:.2f}x" if plain and m["tokens_per_s"] else "-"
        tau = f"{m['tau']:.2f}" if m["tau"] is not None else "-"
        out.append(
            f"| {name} | {m['requests']} | {tau} | {m['tokens_per_s']:.1f} | {speedup} | "
            f"{m['draft_ms_per_step'] or 0:.1f} | {m['target_ms_per_forward']:.1f} | "
            f"{m['greedy_mismatches']} ({m['near_tie_mismatches']}) |"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--group", action="append", default=[], help="NAME=cat1,cat2,...")
    args = parser.parse_args()
    rows = [json.loads(line) for line in (args.run_dir / "results.jsonl").read_text().splitlines()]
    old = args.run_dir / "summary.json"
    previous = json.loads(old.read_text()) if old.is_file() else None
    meta = previous["meta"] if previous else {}
    if previous:
        depths = {n: e["max_draft_depth"] for n, e in previous["methods"].items()}
    else:  # a run stopped early: the deepest accepted draft stands in for the tree depth
        depths = {}
        for r in rows:
            deepest = max([a - 1 for a in r["accept_lengths"]], default=0)
            depths[r["method"]] = max(depths.get(r["method"], 0), deepest)
    meta["num_requests"] = len(rows) // max(len(depths), 1)
    summary = summarize(rows, depths, meta)
    old.write_text(json.dumps(summary, indent=2) + "\n")
    write_report(summary, args.run_dir)
    groups = [("all", None)]
    groups += [(g.split("=")[0], set(g.split("=")[1].split(","))) for g in args.group]
    for name, cats in groups:
        mine = [r for r in rows if cats is None or r["category"] in cats]
        print(f"\n### {name}\n")
        print("\n".join(table(mine, depths)))


if __name__ == "__main__":
    main()
