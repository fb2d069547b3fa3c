"""Train a draft head: python train.py +experiment=medusa_llama [overrides...]

Also under Accelerate: accelerate launch [--config_file conf/accelerate/ddp.yaml] train.py ...
With `export.formats=[eagle3]` (and optionally `export.push_to_hub=USER/REPO`) the kept head is
exported at the end (eval/export.py: the folder is proved by a round trip before it is written).
"""

import hydra
from omegaconf import DictConfig

import train


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    run_dir = HydraConfig.get().runtime.output_dir
    result = train.run(cfg, run_dir)
    export = cfg.get("export") or {}
    if export.get("formats") and result.head_dir is not None:
        from eval.export import export_run

        export_run(run_dir, export)


if __name__ == "__main__":
    main()
