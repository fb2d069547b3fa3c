"""Benchmark a trained draft head against plain decoding and HF generate, in one run.

    python evaluate.py +experiment=medusa_llama head_path=DIR bench=mt_bench bench.limit=8
    python evaluate.py bench=jsonl bench.path=prompts.jsonl head_path=null   # baselines only

Writes results.jsonl, summary.json, report.md and PNG plots into the Hydra run dir
(conf/evaluate.yaml; eval/bench.py does the work). A bad setting or a bad head folder prints one
line with the fix (exit status 2; HYDRA_FULL_ERROR=1 shows the traceback).
"""

import hydra
from omegaconf import DictConfig

from train.cli import report_user_errors


@hydra.main(version_base="1.3", config_path="conf", config_name="evaluate")
@report_user_errors
def main(cfg: DictConfig) -> None:
    from eval.bench import run

    run(cfg)


if __name__ == "__main__":
    main()
