"""Export a trained draft for serving engines, the Hub, or draftsmith itself.

    python scripts/export.py RUN_DIR --format eagle3 --out DIR
    python scripts/export.py RUN_DIR --format medusa --out DIR --bench outputs/eval/<run>
    python scripts/export.py RUN_DIR --format eagle3 --out DIR --push-to-hub me/smollm2-eagle3
    python scripts/export.py RUN_DIR --format gguf --out DIR [--draft-outtype q8_0]
        [--target-outtype f32] [--chain 7]

RUN_DIR is what train.py wrote (its best_head/, else head/), a head folder, or a checkpoint
(RUN_DIR/checkpoints/step_N: that step's weights). Formats:
native (draftsmith's own), eagle3 (vLLM / SGLang EAGLE-3), eagle (EAGLE-1/2), medusa (vLLM's
Medusa), medusa_fd (FasterDecoding/Medusa), dflash (z-lab's DFlash layout: vLLM, SGLang,
llama.cpp's converter), speculators (vllm-project/speculators' DFlashSpeculator). The folder
gets config.json, model.safetensors and a model card, and is proved before it is written: it is
re-imported and decoded greedily next to the head on a few prompts (same tokens, same tau), or
the export fails and writes nothing.
--push-to-hub uploads it (private unless --public) with the token in HF_TOKEN.
gguf (llama.cpp, EAGLE-3 and DFlash drafts) writes draft-<outtype>.gguf through llama.cpp's
converter and proves it in llama-server: drafted greedy output = llama.cpp's plain output
(eval/publish/gguf_export.py), with --chain draft tokens a step (a DFlash block of B drafts up
to B-1).
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

    from eval.publish.export import ExportCheckError, export_draft
    from eval.publish.hub import HubUploadError

    if args.format == "gguf":
        return _export_gguf(args)

    try:
        result = export_draft(
            args.source,
            args.format,
            args.out,
            bench=args.bench,
            check_prompts=args.check_prompts,
            check_tokens=args.check_tokens,
            push=args.push_to_hub,
            private=not args.public,
            overwrite=args.overwrite,
        )
    except (ExportCheckError, HubUploadError, FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"export failed: {e}", file=sys.stderr)
        return 1
    check = result.check
    print(f"wrote {result.out} ({result.format}); round trip on {check['prompts']} prompts: "
          f"tau {check['tau_export']:.3f} = head {check['tau_head']:.3f}")  # fmt: skip
    if result.url:
        print(f"pushed: {result.url}")
    return 0


def _export_gguf(args) -> int:
    from data.engines.llama_cpp import EngineError
    from eval.publish.export import ExportCheckError
    from eval.publish.gguf_export import export_gguf_run

    try:
        doc = export_gguf_run(
            args.source,
            args.out,
            outtype=args.outtype,
            target_outtype=args.target_outtype,
            check_prompts=args.check_prompts,
            check_tokens=args.check_tokens,
            chain=args.chain,
            overwrite=args.overwrite,
        )
    except (ExportCheckError, EngineError, FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"export failed: {e}", file=sys.stderr)
        return 1
    check = doc["check"]
    print(
        f"wrote {args.out}/{doc['draft']} ({doc['spec_type']}); llama.cpp with the draft = "
        f"plain on {check['identical']}/{check['prompts']} prompts "
        f"({len(check['near_tie_divergences'])} near-tie divergences); accepted draft tokens "
        f"llama.cpp {check['llama_cpp_accepted']}, harness {check['harness_accepted']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
