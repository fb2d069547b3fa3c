"""Make a run's training data without training: the self-distilled conversations (prompt
synthesis included) that `train.py` with the same overrides would make, into the same file, so
the run then finds them ready. Resumable like training: run it again to continue.

    python scripts/prepare_data.py +experiment=eagle3_llama_long
    accelerate launch --num_processes 8 scripts/prepare_data.py +experiment=...   # sharded

Prints the data file and the train / validation sizes.
"""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig

log = logging.getLogger("prepare_data")


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from hydra.utils import instantiate

    from data.config import DataConfig
    from data.prepare import prepare_data
    from heads.target import load_target
    from train.run import _process_ranks, engine_gguf

    data_cfg: DataConfig = instantiate(cfg.data, _target_=DataConfig, _convert_="all")
    model_cfg = instantiate(cfg.model)
    target = load_target(model_cfg)
    engine_gguf(data_cfg, model_cfg)
    data = prepare_data(data_cfg, target, _process_ranks)
    from data.dataset import corpus_stats

    print(f"train {corpus_stats(data.train)}")
    print(f"val {corpus_stats(data.val)}")


if __name__ == "__main__":
    main()
