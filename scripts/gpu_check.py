"""The steps of scripts/gpu_check.sh (docs/guides/gpu_check.md); the work: eval/bench/gpu_check.py.

python scripts/gpu_check.py env OUT_DIR          what this machine has (env.json); exit 1
                                                 when a package the checks need is missing
python scripts/gpu_check.py tokenizer DIR        a character-level ChatML tokenizer
python scripts/gpu_check.py train RUN_DIR [hydra overrides...]
                                                 train.run(cfg) under `accelerate launch`;
                                                 each rank writes dist_rank<r>.json
python scripts/gpu_check.py check-train RUN_DIR [TYPE]
                                                 finite losses, a head folder, one
                                                 distributed type (TYPE if given)
python scripts/gpu_check.py check-bench EVAL_DIR greedy outputs equal plain greedy
python scripts/gpu_check.py summary OUT_DIR      one table of every step (summary.md)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere


def main(argv: list[str] | None = None) -> int:
    from eval.bench import gpu_check

    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="step", required=True)
    sub.add_parser("env").add_argument("out_dir")
    sub.add_parser("tokenizer").add_argument("folder")
    train = sub.add_parser("train")
    train.add_argument("run_dir")
    train.add_argument("overrides", nargs=argparse.REMAINDER)
    check_train = sub.add_parser("check-train")
    check_train.add_argument("run_dir")
    check_train.add_argument("expected", nargs="?", default="")
    sub.add_parser("check-bench").add_argument("eval_dir")
    sub.add_parser("summary").add_argument("out_dir")
    args = parser.parse_args(argv)

    if args.step == "env":
        info = gpu_check.environment(args.out_dir)
        for key, value in info.items():
            if key != "packages":
                print(f"{key}: {value}")
        for package, found in info["packages"].items():
            print(f"  {package}: {found or 'NOT INSTALLED'}")
        if info["missing"]:
            print(f"MISSING (needed by every step): {', '.join(info['missing'])}")
        return 1 if info["missing"] else 0
    if args.step == "tokenizer":
        tokenizer = gpu_check.char_tokenizer(args.folder)
        print(f"tokenizer: {args.folder} ({len(tokenizer)} tokens)")
        return 0
    if args.step == "train":
        gpu_check.train_and_record(args.run_dir, args.overrides)
        return 0
    if args.step == "summary":
        text, failed = gpu_check.summary(args.out_dir)
        print(text)
        return 1 if failed else 0
    if args.step == "check-train":
        check = gpu_check.check_train(args.run_dir, args.expected)
    else:
        check = gpu_check.check_bench(args.eval_dir)
    print(json.dumps(check))
    return 0 if check["ok"] else 1


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
