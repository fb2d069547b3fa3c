"""From a DataConfig to tokenized train / validation examples: read the sources (or the target's
self-distilled answers), tokenize with the chat template, split by conversation, and cut each
split to its configured size. The same on every process of a run."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from data.config import DataConfig
from data.dataset import (
    DataSource,
    Example,
    build_examples,
    corpus_stats,
    load_conversations,
    split_examples,
)
from data.paths import resolve_path

log = logging.getLogger(__name__)

# (rank, world size, barrier): how self-distillation shares its work between processes.
Ranks = tuple[int, int, Callable[[], Any] | None]


@dataclass
class PreparedData:
    train: list[Example]
    val: list[Example]


def prepare_data(
    cfg: DataConfig, target: Any, process_ranks: Callable[[], Ranks] | None = None
) -> PreparedData:
    """Read, tokenize and split the conversations.

    target: anything with `.tokenizer` (and, for self-distillation, what data/distill.py needs).
    process_ranks: called only when self-distillation runs, to split its work over processes
    (train/run.py passes Accelerate's); None means one process."""
    distilled = self_distilled_source(cfg, target, process_ranks)
    sources = [distilled] if distilled else cfg.sources
    sources = [dataclasses.replace(s, path=str(resolve_path(s.path))) for s in sources]
    conversations = load_conversations(sources)
    examples = build_examples(conversations, target.tokenizer, cfg.max_length, cfg.chat_template)
    if cfg.val_sources:
        val = build_examples(
            load_conversations(
                [dataclasses.replace(s, path=str(resolve_path(s.path))) for s in cfg.val_sources]
            ),
            target.tokenizer,
            cfg.max_length,
            cfg.chat_template,
        )
        held_out = {tuple(e["input_ids"].tolist()) for e in val}
        train = [e for e in examples if tuple(e["input_ids"].tolist()) not in held_out]
        if len(train) < len(examples):
            log.info("dropped %d training conversations found in data.val_sources",
                     len(examples) - len(train))  # fmt: skip
    else:
        train, val = split_examples(examples, cfg.val_fraction, cfg.split_seed)
    if cfg.max_train_examples:
        train = train[: cfg.max_train_examples]
    if cfg.max_train_tokens:
        train = token_budget(train, cfg.max_train_tokens)
    if cfg.max_val_examples:
        val = val[: cfg.max_val_examples]
    if cfg.mix_sources:
        train = train + mixed_examples(cfg, target.tokenizer, val)
    log.info("train %s | val %s", corpus_stats(train), corpus_stats(val))
    return PreparedData(train, val)


def mixed_examples(cfg: DataConfig, tokenizer: Any, val: list[Example]) -> list[Example]:
    """`data.mix_sources` tokenized, less any conversation equal to a held-out one."""
    sources = [dataclasses.replace(s, path=str(resolve_path(s.path))) for s in cfg.mix_sources]
    conversations = load_conversations(sources)
    mixed = build_examples(conversations, tokenizer, cfg.max_length, cfg.chat_template)
    held_out = {tuple(e["input_ids"].tolist()) for e in val}
    kept = [e for e in mixed if tuple(e["input_ids"].tolist()) not in held_out]
    log.info("mix_sources: %s added to training (%d equal to held-out ones dropped)",
             corpus_stats(kept), len(mixed) - len(kept))  # fmt: skip
    return kept


def self_distilled_source(
    cfg: DataConfig, target: Any, process_ranks: Callable[[], Ranks] | None = None
) -> DataSource | None:
    """`data.self_distill.enabled`: regenerate the prompts' answers with the target (once: a
    later run with the same target and settings reuses the file, a killed one continues it)
    and return that file as the only source; None when self-distillation is off."""
    settings = cfg.self_distill
    if not settings.enabled:
        return None
    from data.distill import distill

    own_template = getattr(target, "template_sha1", None)  # set when model.chat_template is
    out = settings.out or settings.default_out(target.fingerprint, own_template)
    distill_cfg = settings.distill_config(out)
    rank, world, barrier = process_ranks() if process_ranks else (0, 1, None)
    stats = distill(
        target, distill_cfg, rank, world, cfg.chat_template, barrier, progress=rank == 0
    )
    log.info("self-distilled data %s (this run generated %s)", distill_cfg.out, stats)
    return DataSource(path=distill_cfg.out)


def token_budget(examples: list[Example], budget: int) -> list[Example]:
    """The first examples whose loss (assistant) tokens add up to `budget` (the last one cut
    short), so that two data sets can be compared at the same number of training tokens."""
    kept, total = [], 0
    for example in examples:
        if total >= budget:
            break
        n = int(example["loss_mask"].sum())
        if total + n > budget:
            mask = example["loss_mask"].clone()
            mask[mask.cumsum(0) > budget - total] = 0
            example = {**example, "loss_mask": mask}
            n = int(mask.sum())
        kept.append(example)
        total += n
    if total < budget:
        log.warning("data.max_train_tokens=%d but the training split has only %d", budget, total)
    return kept
