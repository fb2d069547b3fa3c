"""What a conversation must hold to be trained on, and the loader's tally of rows it skipped or
mended. The choices, per kind of degenerate row:

- an assistant turn that is empty or whitespace only (Alpaca ``output: ""`` included) would train
  on nothing but the end-of-turn token: the row is skipped and counted;
- a turn holding NUL or another control character (C0 except tab, newline and carriage return;
  DEL) comes from a binary or mis-encoded source: the row is skipped and counted;
- consecutive turns of one role (two user turns in a row) are merged into one turn, the texts
  joined by a blank line: many chat templates refuse roles that do not alternate, and merging
  keeps every word; the row is counted as mended.

Repeated JSON keys are refused when the file is read (data/json_files.py). Each count reaches
the log as one warning per source that names the first row of each kind.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

from data.json_files import DataFormatError

log = logging.getLogger("data.formats")

Message = dict[str, str]
CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
EMPTY_ANSWER = "an empty assistant answer"
CONTROL_CHARS = "control characters"


class RowSkipped(DataFormatError):
    """A row the loader leaves out (and counts) rather than train on; ``reason`` is its kind."""

    def __init__(self, where: str, reason: str, detail: str) -> None:
        super().__init__(f"{where}: {detail}")
        self.reason = reason


def check_text(text: str, where: str, label: str) -> str:
    """``text`` unchanged, or :class:`RowSkipped` when it holds a control character."""
    found = CONTROL.search(text)
    if found:
        raise RowSkipped(
            where,
            CONTROL_CHARS,
            f"{label} holds control character U+{ord(found.group()):04X} at character "
            f"{found.start()}; remove it (binary or mis-encoded text?)",
        )
    return text


def check_answer(text: str, where: str, label: str) -> None:
    """:class:`RowSkipped` for an assistant turn with nothing to learn."""
    if not text.strip():
        raise RowSkipped(
            where, EMPTY_ANSWER, f"{label} is an empty assistant answer; write it or drop the row"
        )


def merge_repeated_roles(messages: list[Message]) -> tuple[list[Message], bool]:
    """Join consecutive user (or assistant) turns into one; returns (messages, merged?)."""
    merged: list[Message] = []
    for message in messages:
        last = merged[-1] if merged else None
        if last and last["role"] == message["role"] and message["role"] != "system":
            merged[-1] = {**last, "content": f"{last['content']}\n\n{message['content']}"}
        else:
            merged.append(message)
    return merged, len(merged) != len(messages)


@dataclass
class RowReport:
    """Per-source tally: rows read, rows skipped (count and first message per reason) and rows
    whose repeated turns were merged (count and first row)."""

    rows: int = 0
    skipped: dict[str, tuple[int, str]] = field(default_factory=dict)
    merged: tuple[int, str] = (0, "")

    def skip(self, error: RowSkipped) -> None:
        count, first = self.skipped.get(error.reason, (0, str(error)))
        self.skipped[error.reason] = (count + 1, first)

    def merge(self, where: str) -> None:
        self.merged = (self.merged[0] + 1, self.merged[1] or where)

    @property
    def num_skipped(self) -> int:
        return sum(count for count, _ in self.skipped.values())

    def describe_skips(self) -> str:
        return "; ".join(
            f"{count} with {reason} (first: {first})"
            for reason, (count, first) in self.skipped.items()
        )

    def log(self, source: str) -> None:
        if self.skipped:
            log.warning(
                "%s: skipped %d of %d rows: %s",
                source,
                self.num_skipped,
                self.rows,
                self.describe_skips(),
            )
        if self.merged[0]:
            log.warning(
                "%s: merged consecutive turns of one role (joined by a blank line) in %d of %d "
                "rows (first: %s)",
                source,
                self.merged[0],
                self.rows,
                self.merged[1],
            )
