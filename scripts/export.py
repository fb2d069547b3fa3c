"""Export a trained draft for serving engines, the Hub, or draftsmith itself.

Sources, formats and the proof: docs/guides/export.md; GGUF for llama.cpp (--format gguf,
--draft-outtype, --target-outtype, --chain): docs/guides/llama_cpp.md.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere


def main(argv: list[str] | None = None) -> int:
    from data.engines.llama_cpp import GGUF_OUTTYPES
    from heads.interop import FORMATS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a train.py run dir or a head folder")
    parser.add_argument("--format", required=True, choices=[*FORMATS, "gguf"])
    parser.add_argument(
        "--draft-outtype",
        "--outtype",
        dest="outtype",
        default="f32",
        choices=GGUF_OUTTYPES,
        help="gguf: the draft's GGUF type (q8_0: a third of f32's size and drafting cost)",
    )
    parser.add_argument(
        "--target-outtype",
        help="gguf: also write the target as f32, bf16, q8_0, q4_k_m or q4_0 (f32: for "
        "token-faithful runs); "
        "default: the target's own GGUF (the embedded SmolLM2's Q4_1)",
    )
    parser.add_argument("--out", required=True, type=Path, help="the folder to write")
    parser.add_argument(
        "--bench", help="an evaluate.py run dir: its table and plots go in the card"
    )
    parser.add_argument("--push-to-hub", metavar="REPO", help="upload to this Hub repo")
    parser.add_argument("--public", action="store_true", help="a public repo (default: private)")
    parser.add_argument("--check-prompts", type=int, default=4)
    parser.add_argument("--check-tokens", type=int, default=32)
    parser.add_argument(
        "--chain", type=int, default=3, help="gguf: draft tokens a step in the proof (n-max)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    from data.engines.llama_cpp import EngineError
    from eval.publish.export import ExportCheckError, export_draft, summary
    from eval.publish.gguf_export import export_gguf_run, gguf_summary
    from eval.publish.hub import HubUploadError

    checks = {"check_prompts": args.check_prompts, "check_tokens": args.check_tokens}
    try:
        if args.format == "gguf":
            doc = export_gguf_run(args.source, args.out, outtype=args.outtype, chain=args.chain,
                                  target_outtype=args.target_outtype,
                                  overwrite=args.overwrite, **checks)  # fmt: skip
            print(gguf_summary(args.out, doc))
        else:
            result = export_draft(args.source, args.format, args.out, bench=args.bench,
                                  push=args.push_to_hub, private=not args.public,
                                  overwrite=args.overwrite, **checks)  # fmt: skip
            print(summary(result))
    except (ExportCheckError, EngineError, HubUploadError, FileExistsError, FileNotFoundError,
            ValueError) as e:  # fmt: skip
        print(f"export failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
