"""From data sources to training examples and padded batches.

An example is ``{"input_ids": LongTensor[T], "loss_mask": LongTensor[T]}`` plus, once features
are cached, ``"hidden": Tensor[T, H]`` and/or ``"aux": Tensor[T, k*H]``. ``collate`` turns a list
of examples into a right-padded batch (see the interfaces: input_ids / attention_mask /
loss_mask ``[B, T]``, features ``[B, T, ...]``).

Packing (``trainer.pack_tokens``): ``pack_examples`` concatenates the examples of a micro-batch
into rows of at most N tokens, each row carrying ``position_ids`` (restarting at 0 per
conversation) and ``segment_ids`` (1, 2, ... per conversation; collate pads both with 0). The
heads read those two keys to keep attention, positions and labels inside each conversation
(heads/base.py), so a packed batch gives the same loss as the padded one, with no padding.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from data.chat import ChatEncoder
from data.errors import ConfigError
from data.formats import FORMATS, Conversation, DataFormatError, read_conversations

log = logging.getLogger(__name__)

Example = dict[str, torch.Tensor]
SEQUENCE_KEYS = ("input_ids", "loss_mask")
FEATURE_KEYS = ("hidden", "aux")
# per-token training targets a head derives once from an example's cached features and keeps for
# later epochs (heads.base `example_targets`; train.features.ExampleTargets)
DERIVED_KEYS = ("target_argmax",)
PACK_KEYS = ("position_ids", "segment_ids")


@dataclass
class DataSource:
    """One training data source.

    path: a .json / .jsonl file, a local dataset folder or a hub dataset name.
    format: "auto" (detect per row), "sharegpt", "openai" or "alpaca".
    max_rows: read at most this many rows (the first ones after `skip`), or all when None.
    skip: leave out the first `skip` rows (e.g. the ones another stage already uses).
    weight: repeat the source's conversations this many times (2.0 doubles it, 0.5 keeps the
        first half), to balance a mixture.
    split: the split to load for hub datasets / dataset folders.
    """

    path: str
    format: str = "auto"
    max_rows: int | None = None
    weight: float = 1.0
    split: str = "train"
    skip: int = 0

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ConfigError(f"DataSource.format={self.format!r}; use one of {list(FORMATS)}")
        if self.max_rows is not None and self.max_rows <= 0:
            raise ConfigError(f"DataSource.max_rows={self.max_rows}; use a positive int or null")
        if not self.weight > 0:
            raise ConfigError(f"DataSource.weight={self.weight}; use a positive number")
        if not (isinstance(self.skip, int) and self.skip >= 0):
            raise ConfigError(f"DataSource.skip={self.skip!r}; use a row count >= 0")


def load_conversations(sources: Sequence[DataSource]) -> list[Conversation]:
    """Read every source, normalise its rows to messages and apply its weight."""
    if not sources:
        raise DataFormatError("no data sources given; set `data.sources` to at least one file")
    conversations: list[Conversation] = []
    for source in sources:
        last = None if source.max_rows is None else source.skip + source.max_rows
        rows = read_conversations(source.path, source.format, last, source.split)[source.skip :]
        if not rows:
            raise DataFormatError(
                f"{source.path}: no rows left after skip={source.skip}; lower `skip`"
            )
        count = max(1, round(len(rows) * source.weight))
        conversations += [rows[i % len(rows)] for i in range(count)]
        log.info("data source %s: %d conversations (x%g)", source.path, len(rows), source.weight)
    return conversations


def build_examples(
    conversations: Sequence[Conversation],
    tokenizer: Any,
    max_length: int,
    chat_template: str | None = None,
) -> list[Example]:
    """Tokenize conversations into examples; conversations left with no assistant token after
    truncation to ``max_length`` are dropped with a warning."""
    encoder = ChatEncoder(tokenizer, chat_template)
    examples, dropped, truncated = [], 0, 0
    for messages in conversations:
        example = encoder.example(messages, max_length)
        if example is None:
            dropped += 1
            continue
        truncated += len(example["input_ids"]) == max_length
        examples.append(example)
    if dropped:
        log.warning(
            "dropped %d of %d conversations: no assistant token within max_length=%d "
            "(raise data.max_length to keep them)",
            dropped,
            len(conversations),
            max_length,
        )
    if truncated:
        log.info("%d examples reach max_length=%d and may be truncated", truncated, max_length)
    if not examples:
        raise DataFormatError(
            f"no training examples left out of {len(conversations)} conversations; "
            f"raise data.max_length (now {max_length})"
        )
    return examples


def corpus_stats(examples: Sequence[Example]) -> dict[str, int]:
    """Counts for logs: examples, tokens and assistant (loss) tokens."""
    return {
        "examples": len(examples),
        "tokens": sum(len(e["input_ids"]) for e in examples),
        "loss_tokens": sum(int(e["loss_mask"].sum()) for e in examples),
    }


def _example_key(example: Example, seed: int) -> bytes:
    """A seeded hash of the example's tokens: the same conversation always lands on the same
    side of the split, whatever the order of the list (duplicates stay together)."""
    ids = example["input_ids"].to(torch.int64).numpy().tobytes()
    return hashlib.sha256(seed.to_bytes(8, "little", signed=True) + ids).digest()


def split_examples(
    examples: Sequence[Example], val_fraction: float, seed: int = 0
) -> tuple[list[Example], list[Example]]:
    """Deterministic train / validation split by conversation.

    Conversations are ordered by a seeded hash of their tokens and the first
    ``ceil(val_fraction * n)`` (at least one when ``val_fraction > 0``) go to validation, so the
    split does not depend on the input order. Returned lists keep the input order."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction}; use a number in [0, 1)")
    if val_fraction == 0 or len(examples) < 2:
        return list(examples), []
    keys = [_example_key(e, seed) for e in examples]
    groups: dict[bytes, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    wanted = min(len(examples) - 1, max(1, math.ceil(val_fraction * len(examples))))
    val_idx: set[int] = set()
    for key in sorted(groups):
        if len(val_idx) >= wanted:
            break
        val_idx.update(groups[key])
    train = [e for i, e in enumerate(examples) if i not in val_idx]
    val = [e for i, e in enumerate(examples) if i in val_idx]
    return train, val


def collate(examples: Sequence[Example], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad a list of examples into a batch.

    Returns input_ids / attention_mask / loss_mask ``[B, T]`` (pads: ``pad_id``, 0, 0) and each
    feature key, derived target key (``DERIVED_KEYS``) and packed rows' position_ids /
    segment_ids present in the examples, padded with zeros to ``[B, T, ...]``."""
    if not examples:
        raise ValueError("collate got an empty list of examples")
    lengths = [len(e["input_ids"]) for e in examples]
    batch_size, width = len(examples), max(lengths)
    input_ids = torch.full((batch_size, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(batch_size, width, dtype=torch.long)
    loss_mask = torch.zeros(batch_size, width, dtype=torch.long)
    for b, (example, length) in enumerate(zip(examples, lengths, strict=True)):
        input_ids[b, :length] = example["input_ids"]
        attention_mask[b, :length] = 1
        loss_mask[b, :length] = example["loss_mask"]
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
    for key in FEATURE_KEYS + DERIVED_KEYS + PACK_KEYS:
        present = [key in e for e in examples]
        if not any(present):
            continue
        if not all(present):
            raise ValueError(f"collate: some examples have {key!r} features and some do not")
        first = examples[0][key]
        padded = first.new_zeros((batch_size, width, *first.shape[1:]))
        for b, (example, length) in enumerate(zip(examples, lengths, strict=True)):
            padded[b, :length] = example[key]
        batch[key] = padded
    return batch


def pack_examples(examples: Sequence[Example], row_tokens: int) -> list[Example]:
    """Concatenate examples into rows of at most ``row_tokens`` tokens (first-fit decreasing,
    so rows are nearly full); an example longer than ``row_tokens`` gets a row of its own.

    Each row holds every key of its examples concatenated along time, plus ``position_ids``
    ``[T]`` (0, 1, ... within each example) and ``segment_ids`` ``[T]`` (1, 2, ... by example).
    Deterministic: the same examples in the same order give the same rows."""
    if row_tokens < 1:
        raise ValueError(f"pack_examples: row_tokens={row_tokens}; use 1 or more")
    lengths = [len(e["input_ids"]) for e in examples]
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(examples)), key=lambda i: -lengths[i]):  # stable: ties keep order
        fits = next((r for r, left in enumerate(room) if lengths[i] <= left), None)
        if fits is None:
            rows.append([i])
            room.append(row_tokens - lengths[i])
        else:
            rows[fits].append(i)
            room[fits] -= lengths[i]
    return [_concat([examples[i] for i in row]) for row in rows]


def _concat(examples: Sequence[Example]) -> Example:
    """One packed row from whole examples (see pack_examples)."""
    keys = [k for k in SEQUENCE_KEYS + FEATURE_KEYS + DERIVED_KEYS if k in examples[0]]
    row = {k: torch.cat([e[k] for e in examples]) for k in keys}
    lengths = [len(e["input_ids"]) for e in examples]
    row["position_ids"] = torch.cat([torch.arange(n) for n in lengths])
    row["segment_ids"] = torch.cat([torch.full((n,), s + 1) for s, n in enumerate(lengths)])
    return row


def packed_collate(
    collate_fn: Callable[[list], dict], row_tokens: int, examples: Sequence[Example]
) -> dict[str, torch.Tensor]:
    """``collate_fn`` over packed rows: bind the first two arguments with functools.partial to
    get a collate function (picklable, for DataLoader workers)."""
    return collate_fn(pack_examples(examples, row_tokens))


class ExampleDataset(torch.utils.data.Dataset):
    """A map-style dataset over a list of examples (use ``collate`` as the collate_fn)."""

    def __init__(self, examples: Sequence[Example]) -> None:
        self.examples = list(examples)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> Example:
        return self.examples[index]

    def lengths(self) -> list[int]:
        """Token count per example (for length-grouped samplers)."""
        return [len(e["input_ids"]) for e in self.examples]


class EveryTokenLabelled(torch.utils.data.Dataset):
    """`base`'s examples with every token after the first a label (`data.train_on_prompts`):
    loss_mask is 1 from position 1 on, prompts and template tokens included. Position 0 has no
    earlier position in its conversation to be predicted from. Only the mask changes, so cached
    features and derived targets are shared with the answer-only view."""

    def __init__(self, base: torch.utils.data.Dataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Example:
        example = self.base[index]
        mask = torch.ones_like(example["loss_mask"])
        mask[:1] = 0
        return {**example, "loss_mask": mask}
