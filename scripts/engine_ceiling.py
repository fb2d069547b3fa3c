"""Measure llama.cpp's ceiling for drafts on this CPU, per target type.

The logic lives in eval/bench/engine_ceiling.py.

    python scripts/engine_ceiling.py --draft DRAFT.gguf --out docs/reports/2026-12-02-engine-ceiling

Per type: llama-bench's verify-cost curve, plain llama-server tokens/s, llama-server with the
draft under forced acceptance (--spec-synth-rates) and with its own; break-even tau per type
and chain length, the predicted speedup at the draft's own tau, the fastest plain type. Writes
OUT/report.md, OUT/summary.json and plots. Rates: per-position vectors split by ';'.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2_135m", help="embedded name or HF folder")
    p.add_argument("--draft", help="a draft GGUF (scripts/export.py --format gguf)")
    p.add_argument("--spec-type", help="default: read from the draft GGUF")
    p.add_argument("--types", default="q4_0,auto,q4_k_m,q8_0,bf16,f32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", default="1,2,4,8,16")
    p.add_argument("--depth", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rates", default="0.6;0.55,0.30,0.15;0.75,0.55,0.40;1,1,1")
    p.add_argument("--own-chain", type=int, default=3, help="0: skip the draft's own run")
    p.add_argument("--prompts", type=int, default=8, help="MT-bench first turns")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=Path("docs/reports/2026-12-02-engine-ceiling"))
    args = p.parse_args(argv)

    from data.engines.llama_cpp import EngineError
    from eval.bench.engine_ceiling import (
        FULL_COMMAND,
        CeilingSettings,
        ceiling_target,
        run_ceiling,
    )
    from eval.bench.engine_ceiling_report import write

    try:
        settings = CeilingSettings.from_text(
            args.types, args.batches, args.rates, threads=args.threads, depth=args.depth,
            reps=args.reps, draft_gguf=args.draft, spec_type=args.spec_type,
            own_chain=args.own_chain, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
        )  # fmt: skip
        command = shlex.join(["python", "scripts/engine_ceiling.py", *(argv or sys.argv[1:])])
        summary = run_ceiling(settings, ceiling_target(args.model), command)
    except (EngineError, ValueError, FileNotFoundError) as e:
        print(f"engine_ceiling failed: {e}", file=sys.stderr)
        return 1
    summary["full_command"] = FULL_COMMAND.format(draft=args.draft or "DRAFT.gguf")
    print(f"wrote {write(summary, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
