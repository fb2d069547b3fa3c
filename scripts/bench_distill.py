"""Self-distillation throughput by backend and batch size, on the embedded target (or any
conf/model), and how often each backend's greedy answers equal HF's.

    python scripts/bench_distill.py --batch-sizes 1 8 32 --prompts 32 --max-new-tokens 128
    python scripts/bench_distill.py --batch-sizes 8 --llama-cpp-slots 1 8 --prompts 32
    python scripts/bench_distill.py --batch-sizes 8 --llama-cpp-slots 8 32 --prompts 32 \
        --gguf Q4_1.gguf bf16.gguf q8_0.gguf f32.gguf     # GGUF types side by side
    python scripts/bench_distill.py --batch-sizes 8 32 --hf-dtypes float32 bfloat16  # HF in bf16

Each setting regenerates the same first N prompts (first turns only) into a scratch file:
`hf` at each batch size (transformers generate; in each of --hf-dtypes, a cast copy of the
target), `llama_cpp` with each number of parallel slots
(llama-server on the target's GGUF: the embedded Q4_1 file; `--gguf` others, each at every slot
count; no --batch-sizes: llama.cpp only, compared with its first setting). Prints generated
tokens/s per setting, the ratio to the first, and the share of answers identical to the first HF
setting's (quantised kernels may differ from HF's fp32), and writes them to --out (JSON).
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

    from data.distill import DistillConfig, distill
    from data.formats import read_prompts
    from data.parts import read_rows
    from data.paths import resolve_path
    from train.rundir import load_conf_target

    target = load_conf_target(args.model)
    prompts = read_prompts(str(resolve_path(args.prompts_file)))[: args.prompts]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "prompts.jsonl"
        source.write_text("".join(json.dumps({"id": i, "prompt": p["turns"][0]}) + "\n"
                                  for i, p in enumerate(prompts)))  # fmt: skip
        settings = [
            ("hf", bs, {"batch_size": bs, "dtype": dt})
            for dt in args.hf_dtypes
            for bs in args.batch_sizes
        ]
        ggufs = args.gguf or ([str(_gguf_of(args.model))] if args.llama_cpp_slots else [])
        for gguf in ggufs:
            for slots in args.llama_cpp_slots:
                engine = {"backend": "llama_cpp", "gguf": gguf, "parallel": slots}
                settings.append(("llama_cpp", slots, {"batch_size": max(slots, 8), **engine}))
        answers: dict[str, dict] = {}
        for backend, size, extra in settings:
            name = f"{backend}-{size}"
            if len(ggufs) > 1 and "gguf" in extra:
                name = f"{Path(extra['gguf']).stem}-{size}"
            if extra.get("dtype"):
                name = f"hf-{extra['dtype']}-{size}"
            out = Path(tmp) / f"{name}.jsonl"
            cfg = DistillConfig(prompts=[str(source)], out=str(out),
                                max_new_tokens=args.max_new_tokens, **extra)  # fmt: skip
            t0 = time.perf_counter()
            stats = distill(target, cfg, progress=False)
            stats |= {
                "wall_s": time.perf_counter() - t0,
                "backend": backend,
                "size": size,
                "gguf": extra.get("gguf"),
                "dtype": extra.get("dtype"),
            }
            answers[name] = {r["id"]: r["messages"][-1]["content"] for r in read_rows(out)}
            first = next(iter(answers.values()))
            stats["same_as_first"] = sum(answers[name].get(k) == v for k, v in first.items())
            results.append(stats)
            print(f"{name:12s}: {stats['new_tokens']} tokens in {stats['seconds']:.1f}s = "
                  f"{stats['tokens_per_s']:.1f} tokens/s; {stats['same_as_first']}/"
                  f"{len(first)} answers equal the first setting's", flush=True)  # fmt: skip
    base = results[0]["tokens_per_s"]
    for r in results:
        r["ratio_to_first"] = r["tokens_per_s"] / base if base else None
    report = {"model": args.model, "threads": torch.get_num_threads(), "prompts": len(prompts),
              "ggufs": ggufs,
              "max_new_tokens": args.max_new_tokens, "results": results}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps([(r["backend"], r["gguf"] and Path(r["gguf"]).stem, r["dtype"], r["size"],
                       round(r["tokens_per_s"], 1), round(r["ratio_to_first"], 2))
                      for r in results]))  # fmt: skip


def _gguf_of(model: str):
    """The GGUF llama.cpp serves for a conf/model option (the embedded target's own file)."""
    from omegaconf import OmegaConf

    from data.paths import resolve_path
    from heads.interop.gguf import gguf_for_target
    from train.rundir import target_config

    path = resolve_path(f"conf/model/{model}.yaml")
    return gguf_for_target(
        target_config(OmegaConf.to_container(OmegaConf.load(path), resolve=True))
    )


if __name__ == "__main__":
    main()
