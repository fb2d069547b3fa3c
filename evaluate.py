"""Benchmark a trained draft head against plain decoding and HF generate, in one run.

    python evaluate.py +experiment=medusa_llama head_path=DIR bench=mt_bench bench.limit=8
    python evaluate.py bench=jsonl bench.path=prompts.jsonl head_path=null   # baselines only

Writes results.jsonl, summary.json, report.md and PNG plots into the Hydra run dir
(conf/evaluate.yaml; eval/bench.py does the work).
"""

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    from eval.bench import run

    run(cfg)


if __name__ == "__main__":
    main()
