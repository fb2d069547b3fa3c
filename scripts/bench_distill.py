"""Self-distillation throughput by batch size, on the embedded target (or any conf/model).

    python scripts/bench_distill.py --batch-sizes 1 8 32 --prompts 32 --max-new-tokens 128

Each batch size regenerates the same first N prompts (first turns only: one generate call per
batch, so the numbers compare) into a scratch file; prints generated tokens/s per batch size and
the ratio to batch size 1, and writes them to --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2_135m", help="a conf/model option")
    parser.add_argument("--prompts-file", default="data/corpora/oa_prompts_en/prompts.jsonl")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_distill.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from data.distill import DistillConfig, distill
    from data.formats import read_prompts
    from data.paths import resolve_path
    from train.rundir import load_conf_target

    target = load_conf_target(args.model)
    prompts = read_prompts(str(resolve_path(args.prompts_file)))[: args.prompts]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "prompts.jsonl"
        source.write_text("".join(json.dumps({"id": i, "prompt": p["turns"][0]}) + "\n"
                                  for i, p in enumerate(prompts)))  # fmt: skip
        for bs in args.batch_sizes:
            cfg = DistillConfig(prompts=[str(source)], out=str(Path(tmp) / f"bs{bs}.jsonl"),
                                max_new_tokens=args.max_new_tokens, batch_size=bs)  # fmt: skip
            t0 = time.perf_counter()
            stats = distill(target, cfg, progress=False)
            stats["wall_s"] = time.perf_counter() - t0
            stats["batch_size"] = bs
            results.append(stats)
            print(f"batch {bs:3d}: {stats['new_tokens']} tokens in {stats['seconds']:.1f}s = "
                  f"{stats['tokens_per_s']:.1f} tokens/s", flush=True)  # fmt: skip
    base = results[0]["tokens_per_s"]
    for r in results:
        r["ratio_to_first"] = r["tokens_per_s"] / base if base else None
    report = {"model": args.model, "threads": torch.get_num_threads(), "prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "results": results}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps([(r["batch_size"], round(r["tokens_per_s"], 1),
                       round(r["ratio_to_first"], 2)) for r in results]))  # fmt: skip


if __name__ == "__main__":
    main()
