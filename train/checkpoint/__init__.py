"""A run's checkpoints, from writing one to choosing what to keep:

folder.py  the step_<N> folder on disk: write atomically, list, check, read back, prune; a head
           folder from a checkpoint (`head_from_checkpoint`), and how a run keeps a head
state.py   what a folder's files hold beyond tensors: RNG states, optimizer state under FSDP,
           full weights from shards (`gathered_weights`), the data position
resume.py  which checkpoint `trainer.resume` trusts, and whether this run may continue it
run.py     the loop's side (RunCheckpoints): save, resume and keep the head, with collectives
select.py  checkpoint-time evaluators and the best head kept so far (BestKeeper)
"""

from train.checkpoint.folder import (
    CHECKPOINT_INFO,
    HEAD_FILE,
    MANIFEST_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    RUN_FILE,
    SCHEDULER_FILE,
    STATE_FILE,
    Checkpoint,
    CheckpointError,
    TrainState,
    checkpoint_problems,
    checkpoint_root,
    head_from_checkpoint,
    is_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    save_head_folder,
)
from train.checkpoint.resume import (
    check_settings,
    diff_settings,
    find_intact_checkpoint,
    run_record,
)
from train.checkpoint.run import RunCheckpoints, checkpoint_record
from train.checkpoint.select import BestKeeper, Evaluator, run_evaluators
from train.checkpoint.state import (
    capture_rng_state,
    full_optimizer_state,
    gathered_weights,
    load_head_state,
    load_optimizer_state,
    remap_position,
    restore_rng_state,
)

__all__ = [
    "CHECKPOINT_INFO",
    "HEAD_FILE",
    "MANIFEST_FILE",
    "OPTIMIZER_FILE",
    "RNG_FILE",
    "RUN_FILE",
    "SCHEDULER_FILE",
    "STATE_FILE",
    "BestKeeper",
    "Checkpoint",
    "CheckpointError",
    "Evaluator",
    "RunCheckpoints",
    "TrainState",
    "capture_rng_state",
    "check_settings",
    "checkpoint_problems",
    "checkpoint_record",
    "checkpoint_root",
    "diff_settings",
    "find_intact_checkpoint",
    "full_optimizer_state",
    "gathered_weights",
    "head_from_checkpoint",
    "is_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_head_state",
    "load_optimizer_state",
    "prune_checkpoints",
    "remap_position",
    "restore_rng_state",
    "run_evaluators",
    "run_record",
    "save_checkpoint",
    "save_head_folder",
]
