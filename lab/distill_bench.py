"""Self-distillation throughput by backend and batch size (scripts/bench_distill.py).

Each setting regenerates the same first N prompts (first turns only) into a scratch file: `hf`
at each batch size (transformers generate; in each dtype, a cast copy of the target), then
`llama_cpp` with each number of parallel slots on each GGUF. Every setting's tokens/s, its ratio
to the first setting's, and how many answers equal the first setting's (quantised kernels may
differ from HF's fp32) are returned, one dict a setting.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from data.distill import DistillConfig, distill
from data.parts import read_rows


def bench_settings(
    batch_sizes: list[int],
    hf_dtypes: list[str | None],
    llama_cpp_slots: list[int],
    ggufs: list[str],
) -> list[tuple[str, str, int, dict]]:
    """(name, backend, size, DistillConfig overrides) of every setting, in the order they run:
    HF at each batch size in each dtype, then each GGUF at each slot count (named by the GGUF's
    stem when there are several)."""
    settings = []
    for dt in hf_dtypes:
        for bs in batch_sizes:
            name = f"hf-{dt}-{bs}" if dt else f"hf-{bs}"
            settings.append((name, "hf", bs, {"batch_size": bs, "dtype": dt}))
    for gguf in ggufs:
        for slots in llama_cpp_slots:
            engine = {"backend": "llama_cpp", "gguf": gguf, "parallel": slots}
            name = f"{Path(gguf).stem}-{slots}" if len(ggufs) > 1 else f"llama_cpp-{slots}"
            settings.append((name, "llama_cpp", slots, {"batch_size": max(slots, 8), **engine}))
    return settings


def _log(line: str) -> None:
    print(line, flush=True)


def bench_distill(
    target, prompts: list[dict], settings, max_new_tokens: int, log=_log
) -> list[dict]:
    """Run every setting of `bench_settings` on the first turns of `prompts` (read_prompts rows)
    and return its distill stats with wall_s, backend, size, gguf, dtype, same_as_first and
    ratio_to_first (tokens/s over the first setting's). Logs a line a setting."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "prompts.jsonl"
        source.write_text("".join(json.dumps({"id": i, "prompt": p["turns"][0]}) + "\n"
                                  for i, p in enumerate(prompts)))  # fmt: skip
        answers: dict[str, dict] = {}
        for name, backend, size, extra in settings:
            out = Path(tmp) / f"{name}.jsonl"
            cfg = DistillConfig(prompts=[str(source)], out=str(out),
                                max_new_tokens=max_new_tokens, **extra)  # fmt: skip
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
            log(f"{name:12s}: {stats['new_tokens']} tokens in {stats['seconds']:.1f}s = "
                f"{stats['tokens_per_s']:.1f} tokens/s; {stats['same_as_first']}/"
                f"{len(first)} answers equal the first setting's")  # fmt: skip
    base = results[0]["tokens_per_s"]
    for r in results:
        r["ratio_to_first"] = r["tokens_per_s"] / base if base else None
    return results


def summary_rows(results: list[dict]) -> list[tuple]:
    """(backend, GGUF stem, dtype, size, tokens/s, ratio to the first) a setting, rounded."""
    return [(r["backend"], r["gguf"] and Path(r["gguf"]).stem, r["dtype"], r["size"],
             round(r["tokens_per_s"], 1), round(r["ratio_to_first"], 2))
            for r in results]  # fmt: skip
