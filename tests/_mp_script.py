"""Train the dummy head in a fresh process, for tests that need one.

Used by tests/test_multiprocess.py (under `accelerate launch`, 2 CPU processes) and by the
real-crash test in tests/test_checkpoint.py. Each process records into the run directory:
  ids_rank<r>.jsonl     the example ids of every training batch it consumed (one line each)
  writes_rank<r>.txt    one line per checkpoint / head folder it wrote
  result_rank<r>.json   world size, distributed type, final step, val totals, weights digest
With --then-straight DIR the same processes then train again, uninterrupted, into DIR.
With --stop-at N the run stops after step N (as if interrupted; the checkpoint of N is written).
With --crash-in-save N the process dies (os._exit, no cleanup) half-way through writing the
checkpoint of step N, as a kill would leave it.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import logging
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root

from tests._dummy_head import DummyHead, collate_with_ids, make_examples, make_target  # noqa: E402
from train import loop as loop_module  # noqa: E402
from train.checkpoint import folder as checkpoint_folder  # noqa: E402
from train.checkpoint import gathered_weights  # noqa: E402
from train.checkpoint import run as checkpoint_run  # noqa: E402
from train.config import TrainerConfig  # noqa: E402
from train.loop import Trainer  # noqa: E402

CRASH_EXIT_CODE = 17
VAL_ID_OFFSET = 1000


def datasets(num_train: int, num_val: int) -> tuple[list[dict], list[dict]]:
    """The train / val examples the tests use; val ids start at VAL_ID_OFFSET."""
    val = make_examples(num_val, seed=1)
    for example in val:
        example["example_id"] += VAL_ID_OFFSET
    return make_examples(num_train, seed=0), val


def weights_digest(module: torch.nn.Module) -> str:
    """sha256 of the full weights (under FSDP gathered from every process: all must call it)."""
    h = hashlib.sha256()
    with gathered_weights(module):
        for name, tensor in sorted(module.state_dict().items()):
            h.update(name.encode())
            h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def record_writes(rank: int, current: dict) -> None:
    """Wrap the loop's writers (train/checkpoint/run.py) so each process notes what it wrote, in
    current["run_dir"]."""

    def noting(kind, write):
        def wrapper(*args, **kwargs):
            with open(current["run_dir"] / f"writes_rank{rank}.txt", "a") as f:
                f.write(kind + "\n")
            return write(*args, **kwargs)

        return wrapper

    module = checkpoint_run
    module.save_checkpoint = noting("checkpoint", module.save_checkpoint)
    module.save_head_folder = noting("head", module.save_head_folder)


def crash_in_save(step: int) -> None:
    """Die after the head file of checkpoint `step` is written, before the rest."""
    real_save = checkpoint_folder.torch.save

    def save(obj, path, *args, **kwargs):
        if f".step_{step}." in str(path):
            os._exit(CRASH_EXIT_CODE)
        return real_save(obj, path, *args, **kwargs)

    checkpoint_folder.torch.save = save


def force_fsdp_on_cpu() -> None:
    """Let `accelerate launch --config_file conf/accelerate/fsdp.yaml` shard on CPUs.

    Accelerate turns FSDP on only for GPU-like distributed types: with `cpu=True` it quietly
    runs the FSDP config as DDP over gloo. torch's FSDP2 (`fully_shard`) itself works over gloo,
    so while the loop builds its Accelerator the process state claims MULTI_GPU (the device
    stays the CPU); Accelerate then sets up FSDP from the launcher's environment.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    make_accelerator = loop_module.make_accelerator

    def make(cfg):
        state = PartialState(cpu=True)
        if state.distributed_type != DistributedType.FSDP:  # a second run finds it so already
            assert state.distributed_type == DistributedType.MULTI_CPU, state.distributed_type
            PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
        acc = make_accelerator(cfg)  # leaves both states at FSDP, as on GPUs
        assert acc.distributed_type == DistributedType.FSDP and acc.device.type == "cpu"
        return acc

    loop_module.make_accelerator = make


def train_once(args, rank: int, run_dir: Path, current: dict, stop_at: int = 0) -> None:
    """One training run into `run_dir`, recording ids, writes and a result summary."""
    current["run_dir"] = run_dir
    run_dir.mkdir(parents=True, exist_ok=True)

    def collate(examples):
        batch = collate_with_ids(examples)
        ids = batch["example_id"].tolist()
        if ids[0] < VAL_ID_OFFSET:  # a training batch
            with open(run_dir / f"ids_rank{rank}.jsonl", "a") as f:
                f.write(json.dumps(ids) + "\n")
        return batch

    train_set, val_set = datasets(args.num_train, args.num_val)
    cfg = TrainerConfig(
        lr=1e-2,
        warmup_steps=1,
        max_steps=args.max_steps,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        save_every=args.save_every,
        eval_every=args.eval_every,
        keep_last=0,
        log_every=1,
        progress=False,
    )
    head = DummyHead(dropout=args.dropout)
    trainer = Trainer(
        head,
        cfg,
        run_dir,
        train_dataset=train_set,
        collate_fn=collate,
        target=make_target(),
        val_dataset=val_set,
        callbacks=[lambda state: state.step == stop_at] if stop_at else (),
    )
    result = trainer.fit()
    summary = {
        "rank": rank,
        "world": trainer.acc.num_processes,
        "distributed_type": str(trainer.acc.distributed_type),
        "step": result.step,
        "val_totals": result.val_totals,
        "weights": weights_digest(head),
    }
    (run_dir / f"result_rank{rank}.json").write_text(json.dumps(summary) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--num-train", type=int, default=16)
    parser.add_argument("--num-val", type=int, default=7)
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--eval-every", type=int, default=0)
    parser.add_argument("--stop-at", type=int, default=0)
    parser.add_argument("--crash-in-save", type=int, default=0)
    parser.add_argument("--force-fsdp-on-cpu", action="store_true", help="see force_fsdp_on_cpu")
    parser.add_argument("--then-straight", help="afterwards, an uninterrupted run in this dir")
    args = parser.parse_args()

    faulthandler.enable(all_threads=True)  # a native abort prints every thread's Python stack
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    current: dict = {}
    record_writes(rank, current)
    if args.force_fsdp_on_cpu:
        force_fsdp_on_cpu()
    if args.crash_in_save:
        crash_in_save(args.crash_in_save)
    train_once(args, rank, Path(args.run_dir), current, stop_at=args.stop_at)
    if args.then_straight:  # same processes, so no second launch is paid for
        train_once(args, rank, Path(args.then_straight), current)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank has written its results
        torch.distributed.destroy_process_group()
    # Leave without the interpreter's finalization. Under FSDP2 over gloo (a set-up only this
    # test forces; Accelerate runs DDP on CPUs) 2 of 56 two-process launches here aborted there,
    # after main() had returned and the process group was destroyed: "terminate called without
    # an active exception", with no Python frame on any thread (faulthandler). The results are
    # on disk and every rank passed the barrier, so nothing the tests check is skipped.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
