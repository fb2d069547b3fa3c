"""Train a draft head: python train.py +experiment=medusa_llama [overrides...]

Also under Accelerate: accelerate launch [--config_file conf/accelerate/ddp.yaml] train.py ...
"""

import hydra
from omegaconf import DictConfig

import train


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    train.run(cfg)


if __name__ == "__main__":
    main()
