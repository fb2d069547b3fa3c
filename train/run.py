"""`run(cfg)`: the training recipe behind `python train.py +experiment=...`.

Linear on purpose: load the target, read and tokenize the data, build the head, compute target
features once (when `data.features=memory`), train, report. Hydra's `_target_` entries are
instantiated here, at the edge; everything below takes dataclasses.
"""

from __future__ import annotations

import json
import logging
import os
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

import heads
from data.config import DataConfig
from data.dataset import EveryTokenLabelled, ExampleDataset, collate, corpus_stats
from data.feature_cache import open_or_build_feature_cache
from data.feature_cache_format import default_cache_dir, examples_sha1
from data.features import LazyFeatureDataset
from data.paths import resolve_path
from data.prepare import PreparedData, prepare_data
from heads.base import CONFIG_NAME, WEIGHTS_NAME, warm_start
from heads.folder import is_foreign_head, load_head_tensors
from heads.target import Target, load_target
from heads.vocab import count_tokens
from train.config import TrainerConfig, fold_chat_template
from train.loop import TrainResult, train
from train.rundir import BEST_FILE, DATA_STATS, kept_head
from train.tracking import Tracker, env_rank

log = logging.getLogger(__name__)


def feature_datasets(data: PreparedData, target: Target, layers, data_cfg: DataConfig):
    """Train/val datasets with target features: "memory" computes each example's features the
    first time it is read and keeps them for every later epoch; "disk" reads them from a
    sharded on-disk cache, built first where missing; "online" recomputes per batch (DataConfig
    has checked the mode and the dtype)."""
    if data_cfg.features == "online":
        return ExampleDataset(data.train), ExampleDataset(data.val)
    if data_cfg.features == "disk":
        return disk_feature_datasets(data, target, layers, data_cfg)
    dtype = getattr(torch, data_cfg.feature_dtype)
    cast = data_cfg.feature_autocast
    return (
        LazyFeatureDataset(data.train, target, layers, dtype, autocast=cast),
        LazyFeatureDataset(data.val, target, layers, dtype, autocast=cast),
    )


def disk_feature_datasets(data: PreparedData, target: Target, layers, data_cfg: DataConfig):
    """Open (building what is missing) the on-disk caches `<data.feature_cache>/{train,val}`.

    `data.feature_cache: null` picks a folder per target, layer set, dtype and data (see
    `default_cache_dir`). The build is split over ranks only when torch.distributed is already
    initialised (its barrier is needed); under `accelerate launch` this starts Accelerate's
    process state first, so rank r builds shards r, r + W, ... and rank 0 writes the index.
    Shards are written to a per-process tmp file then renamed, and shards already on disk are
    skipped, so a killed build resumes.
    """
    folder, cast = data_cfg.feature_cache, data_cfg.feature_autocast
    dtype = data_cfg.feature_dtype
    if folder is None:
        data_sha1 = examples_sha1(data.train + data.val)
        folder = default_cache_dir(target.fingerprint, layers, dtype, data_sha1, autocast=cast)
    rank, world_size, barrier = _process_ranks()
    kwargs = dict(
        rank=rank, world_size=world_size, barrier=barrier, progress=env_rank() == 0, autocast=cast
    )
    _place_for_features(target)
    return tuple(
        open_or_build_feature_cache(examples, target, Path(folder) / split, layers, dtype, **kwargs)
        for split, examples in (("train", data.train), ("val", data.val))
    )


def _process_ranks():
    """(rank, world size, barrier) for work split over processes before training starts (self-
    distillation, the disk feature cache). Under `accelerate launch` this starts Accelerate's
    shared process state now (the training loop's Accelerator reuses it); CPU-only machines join
    over gloo, as in train/loop.py. One process: (0, 1, None)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from accelerate import PartialState

        PartialState(cpu=not torch.accelerator.is_available())
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        dist = torch.distributed
        return dist.get_rank(), dist.get_world_size(), dist.barrier
    return 0, 1, None


def _place_for_features(target: Target) -> None:
    """Put the target on this process's accelerator (LOCAL_RANK under `accelerate launch`)
    before it computes a whole feature cache; the training loop would move it there anyway."""
    model = target.model
    if getattr(model, "hf_device_map", None) or not torch.accelerator.is_available():
        return
    kind = torch.accelerator.current_accelerator().type
    model.to(torch.device(kind, int(os.environ.get("LOCAL_RANK", "0"))))


def build_head(head_cfg: Any, target: Target, train_examples: list[dict]):
    counts = count_tokens(train_examples, target.vocab_size)
    return heads.build_head(head_cfg, target, token_counts=counts)


def _log_final_head(tracker: Tracker, run_dir: Path, method: str) -> None:
    """The head the run keeps (best_head when an evaluator chose one, else head) as a W&B
    model artifact, with the run's data size and best metric as metadata."""
    chosen = kept_head(run_dir)
    if chosen is None:
        return
    meta = {"method": method, "folder": chosen.name}
    for name in (DATA_STATS, BEST_FILE):
        if (run_dir / name).is_file():
            meta[Path(name).stem] = json.loads((run_dir / name).read_text())
    tracker.log_artifact(chosen, name=f"{method}-head", type="model", metadata=meta)


def init_head_weights(head, path: str, target: Target | None = None) -> None:
    """`init_from`: start from a saved head's weights instead of the initialisation. A native
    folder gives its tensors as saved; a serving-engine layout (heads/interop/) is imported
    onto `target` first. A head's own `init_from` decides which part takes them (Medusa-2: its
    heads)."""
    if is_foreign_head(path) and target is not None:
        tensors = heads.from_pretrained(path, target).state_dict()
    elif (Path(path) / CONFIG_NAME).is_file() and (Path(path) / WEIGHTS_NAME).is_file():
        tensors = load_head_tensors(path)
    else:
        raise FileNotFoundError(
            f"init_from={path}: no head there (config.json and {WEIGHTS_NAME}); give a head folder."
        )
    own = getattr(head, "init_from", None)
    fresh = own(tensors, path) if own else warm_start(head, tensors, path)
    log.info("init_from %s: weights loaded (%d tensors left as initialised)", path, len(fresh))


def engine_gguf(data_cfg: DataConfig, model_cfg) -> None:
    """Self-distillation through llama.cpp needs the target as GGUF: `data.self_distill.gguf`
    unset means the target's own (the embedded one as shipped) or its folder converted once; an
    outtype (f32, f16, bf16, q8_0) converts its Hugging Face weights to that type once; a path
    is used as given (heads.interop.gguf.TargetGGUF)."""
    sd = data_cfg.self_distill
    if sd.enabled and sd.backend == "llama_cpp":
        from heads.interop.gguf import TargetGGUF, gguf_for_target

        sd.gguf = str(gguf_for_target(model_cfg, TargetGGUF.parse(sd.gguf)))


def run(
    cfg: DictConfig, run_dir: str | os.PathLike | None = None, started: float | None = None
) -> TrainResult:
    """Train the configured head; returns the TrainResult (the head lands in run_dir/head).
    trainer.time_budget_min counts from `started` (a time.monotonic() reading; train.py passes
    its process's start), else from this call."""
    started = time.monotonic() if started is None else started
    run_dir = Path(run_dir or _hydra_run_dir())
    # the settings first: a typo should not wait for the target and the data to load
    fold_chat_template(cfg)
    trainer_cfg: TrainerConfig = instantiate(cfg.trainer)
    logger_cfg = instantiate(cfg.logger)
    data_cfg: DataConfig = instantiate(cfg.data, _target_=DataConfig, _convert_="all")
    torch.manual_seed(cfg.seed)
    model_cfg = instantiate(cfg.model)
    target = load_target(model_cfg)
    engine_gguf(data_cfg, model_cfg)
    data = prepare_data(data_cfg, target, _process_ranks)
    head = build_head(instantiate(cfg.head), target, data.train)
    if cfg.get("init_from"):
        init_head_weights(head, str(resolve_path(cfg.init_from)), target)
    if getattr(head, "uses_target_features", True):
        train_set, val_set = feature_datasets(data, target, head.feature_layers(), data_cfg)
    else:  # Medusa-2: the head runs its adapted target itself; cached features would be stale
        log.info("head %s computes its own features: data.features is not used", head.method)
        train_set, val_set = ExampleDataset(data.train), ExampleDataset(data.val)
    if data_cfg.train_on_prompts:  # training labels only: validation keeps the answers
        train_set = EveryTokenLabelled(train_set)
    tracker = Tracker(logger_cfg, run_dir, is_main=env_rank() == 0)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    if env_rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        stats = {"train": corpus_stats(data.train), "val": corpus_stats(data.val)}
        (run_dir / DATA_STATS).write_text(json.dumps(stats, indent=2) + "\n")
    tracker.log_config(resolved)
    callbacks = [instantiate(c) for c in cfg.get("callbacks", None) or []]
    evaluators = [instantiate(c) for c in cfg.get("evaluators", None) or []]
    pad_id = target.tokenizer.pad_token_id or 0
    result = train(
        head,
        target,
        train_set,
        val_set if len(val_set) else None,
        partial(collate, pad_id=pad_id),
        trainer_cfg,
        run_dir,
        tracker=tracker,
        callbacks=callbacks,
        evaluators=evaluators,
        run_config=resolved,  # config.yaml, once resume has accepted it
        data_sha1=examples_sha1(data.train + data.val),
        started=started,
    )
    if env_rank() == 0:
        _log_final_head(tracker, run_dir, head.method)
    tracker.finish()
    if env_rank() == 0:
        print(format_summary(result, run_dir))
    return result


def format_summary(result: TrainResult, run_dir: Path) -> str:
    """Per-head validation accuracy and throughput, as printed at the end of a run."""
    lines = [f"run dir: {run_dir}", f"steps: {result.step}  time: {result.elapsed_s:.0f}s"]
    if result.planned_steps:
        lines[1] += f"  (trainer.time_budget_min planned {result.planned_steps} steps)"
    if result.step_s > 0:  # the steps' own rate, as the progress bar shows it
        lines.append(
            f"training tokens/s: {result.step_tokens / result.step_s:.0f} in optimizer steps "
            f"({result.tokens / max(result.elapsed_s, 1e-9):.0f} over the whole fit, validation "
            "and checkpoints included)"
        )
    elif result.elapsed_s > 0:
        lines.append(
            f"training tokens/s: {result.tokens / result.elapsed_s:.0f} "
            f"(loss tokens/s: {result.loss_tokens / result.elapsed_s:.0f})"
        )
    # Medusa's head k and EAGLE-3's unroll step i ("step{i}/top1") both draft token t+k+2.
    per_head = sorted(
        k
        for k in result.val_metrics
        if k.endswith("/top1") and k.split("/")[-2].startswith(("head", "step"))
    )
    for key in per_head:
        name = key.split("/")[-2]
        top5 = result.val_metrics.get(key.replace("top1", "top5"))
        extra = f"  top-5 {top5:.3f}" if top5 is not None else ""
        lines.append(f"validation {name}: top-1 {result.val_metrics[key]:.3f}{extra}")
    for key in sorted(k for k in result.val_metrics if k.startswith("eval/")):
        lines.append(f"checkpoint-time {key[5:]}: {result.val_metrics[key]:.3f}")
    if result.head_dir is not None:
        size = sum(f.stat().st_size for f in Path(result.head_dir).iterdir())
        lines.append(f"head: {result.head_dir} ({size / 2**20:.1f} MiB)")
    return "\n".join(lines)


def _hydra_run_dir() -> str:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().runtime.output_dir
