"""Self-distillation throughput by backend and batch size, on the embedded target (or any
conf/model), and how often each backend's greedy answers equal HF's.

Usage and results: docs/guides/cpu_performance.md; the settings: lab/distill_bench.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2_135m", help="a conf/model option")
    parser.add_argument("--prompts-file", default="data/corpora/oa_prompts_en/prompts.jsonl")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument(
        "--batch-sizes",
        type=int,
        nargs="*",
        default=[1, 8, 32],
        help="HF batch sizes (none: llama_cpp only, compared with its first)",
    )
    parser.add_argument(
        "--hf-dtypes",
        nargs="+",
        default=[None],
        help="HF generation dtypes, each at every batch size (default: the target's own)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--llama-cpp-slots", type=int, nargs="*", default=[])
    parser.add_argument(
        "--gguf",
        nargs="+",
        default=None,
        help="target GGUF(s) for llama_cpp, each run at every slot count (default: its own)",
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_distill.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from data.formats import read_prompts
    from data.paths import resolve_path
    from heads.interop.gguf import gguf_for_target
    from lab.distill_bench import bench_distill, bench_settings, summary_rows
    from train.rundir import conf_target_config, load_conf_target

    target = load_conf_target(args.model)
    prompts = read_prompts(str(resolve_path(args.prompts_file)))[: args.prompts]
    ggufs = args.gguf or []
    if not ggufs and args.llama_cpp_slots:  # llama.cpp serves the target's own GGUF
        ggufs = [str(gguf_for_target(conf_target_config(args.model)))]
    settings = bench_settings(args.batch_sizes, args.hf_dtypes, args.llama_cpp_slots, ggufs)
    results = bench_distill(target, prompts, settings, args.max_new_tokens)
    report = {"model": args.model, "threads": torch.get_num_threads(), "prompts": len(prompts),
              "ggufs": ggufs,
              "max_new_tokens": args.max_new_tokens, "results": results}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(summary_rows(results)))


if __name__ == "__main__":
    main()
