"""Regenerate the assistant turns of a prompt set with the target (data/distill.py).

    python scripts/self_distill.py distill.out=outputs/distill/sd.jsonl distill.max_rows=100
    accelerate launch --num_processes 8 scripts/self_distill.py distill.out=... model=...

Run it again with the same settings to continue a killed or interrupted run (Ctrl-C keeps the
finished conversations); the output then trains a head with
`data.sources=[{_target_: data.dataset.DataSource, path: OUT}]`. A bad setting or an engine that
fails prints one line (exit status 2; HYDRA_FULL_ERROR=1 shows the traceback).
"""

from __future__ import annotations

import json
import logging
import os

import hydra
from omegaconf import DictConfig

from train.cli import report_user_errors

log = logging.getLogger("self_distill")


@hydra.main(config_path="../conf", config_name="distill", version_base="1.3")
@report_user_errors
def main(cfg: DictConfig) -> None:
    import torch
    from accelerate import PartialState
    from hydra.utils import instantiate

    from data.distill import distill
    from heads.target import load_target

    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    # As in training: N processes launched on a machine without accelerators join over gloo.
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    cpu = cfg.device == "cpu" or (launched and not torch.accelerator.is_available())
    state = PartialState(cpu=cpu)
    settings = instantiate(cfg.distill, _convert_="all")
    target = load_target(instantiate(cfg.model, _convert_="all"))
    device = state.device if cfg.device == "auto" else torch.device(cfg.device)
    target.model.to(device)
    stats = distill(
        target,
        settings,
        rank=state.process_index,
        world_size=state.num_processes,
        chat_template=cfg.model.get("chat_template"),
        barrier=state.wait_for_everyone if state.num_processes > 1 else None,
    )
    log.info("rank %d: %s", state.process_index, json.dumps(stats))


if __name__ == "__main__":
    main()
