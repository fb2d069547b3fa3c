"""Train a draft head: draftsmith-train +experiment=medusa_llama [overrides...]

The same command as the root `python train.py` (which calls this `main`), from any folder:
`python -m eval.cli.train` works too, and under Accelerate `accelerate launch -m eval.cli.train`.
With `export.formats=[eagle3]` (and optionally `export.push_to_hub=USER/REPO`) the kept head is
exported at the end (eval/publish/export.py: the folder is proved by a round trip before it is
written). A bad setting or bad data prints one line with the fix (exit status 2;
HYDRA_FULL_ERROR=1 shows the traceback).
"""

import hydra
from omegaconf import DictConfig

from data.paths import CONF_DIR
from train.cli import report_user_errors


# Hydra names the job after this module (`train`): the run dir's log is train.log.
@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
@report_user_errors
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    run_dir = HydraConfig.get().runtime.output_dir
    from train.budget import process_started
    from train.run import run as run_training

    result = run_training(cfg, run_dir, started=process_started())
    export = cfg.get("export") or {}
    if export.get("formats") and result.head_dir is not None:
        from eval.publish.export import export_run

        export_run(run_dir, export)
    _close_process_group()


def _close_process_group() -> None:
    """Leave the process group (if any) before exit: a multi-process run (FSDP2 over gloo in
    particular) can otherwise abort at interpreter exit after its work is written."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
