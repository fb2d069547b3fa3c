"""Benchmark a trained draft head against plain decoding and HF generate, in one run.

    python evaluate.py +experiment=medusa_llama head_path=DIR bench=mt_bench bench.limit=8
    python evaluate.py bench=jsonl bench.path=prompts.jsonl head_path=null   # baselines only

The command is eval/cli/evaluate.py's `main` (installed as `draftsmith-evaluate`): it writes
results.jsonl, summary.json, report.md and PNG plots into the Hydra run dir (conf/evaluate.yaml;
eval/bench/harness.py does the work). A bad setting or a bad head folder prints one line with the
fix (exit status 2; HYDRA_FULL_ERROR=1 shows the traceback).
"""

from eval.cli.evaluate import chain_overrides, main

__all__ = ["chain_overrides", "main"]

if __name__ == "__main__":
    main()
