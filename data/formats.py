"""Read chat data from JSON / JSONL files or Hugging Face datasets and normalise it to messages.

Every training row becomes a list of messages ``[{"role": "system"|"user"|"assistant",
"content": str}]``. Three row formats are understood:

- ShareGPT: ``{"conversations": [{"from": "human"|"gpt"|..., "value": str}]}``
- OpenAI messages: ``{"messages": [{"role": "user"|..., "content": str}]}``
- Alpaca: ``{"instruction": str, "input": str (optional), "output"|"response": str}``

Bad input raises :class:`DataFormatError`; its message names the file, the row (JSONL line
number or JSON array index) and what to change. Files are read strictly (data/json_files.py);
rows not worth training on are skipped or mended and counted (data/row_checks.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from data.json_files import DataFormatError, iter_jsonl, read_json
from data.row_checks import (
    Message,
    RowReport,
    RowSkipped,
    check_answer,
    check_text,
    merge_repeated_roles,
)

Conversation = list[Message]

FORMATS = ("auto", "sharegpt", "openai", "alpaca")
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}
_SUPPORTED = (
    "ShareGPT {'conversations': [{'from', 'value'}]}, "
    "OpenAI {'messages': [{'role', 'content'}]}, "
    "Alpaca {'instruction', 'input' (optional), 'output' or 'response'}"
)


# ---------------------------------------------------------------------------------------------
# Raw rows


def iter_rows(source: Any, split: str = "train") -> Iterator[tuple[str, dict]]:
    """Yield ``(where, row)`` pairs from a .json / .jsonl file, a ``datasets.Dataset`` or a
    ``datasets.load_dataset`` spec (hub name or local folder). ``where`` locates the row in error
    messages, e.g. ``"data.jsonl line 12"`` or ``"data.json [3]"``."""
    if not isinstance(source, str | os.PathLike):
        yield from _iter_dataset(source, _dataset_name(source))
        return
    path = os.fspath(source)
    if path.endswith((".json", ".jsonl")) or os.path.isfile(path) or _names_a_file(path):
        if path.endswith(".jsonl"):
            for where, row in iter_jsonl(path):
                yield where, _expect_object(row, where)
        else:
            yield from _iter_json(path)
        return
    import datasets  # imported lazily: it is slow to import and only needed for hub data

    yield from _iter_dataset(datasets.load_dataset(path, split=split), f"{path}[{split}]")


# Suffixes of data files: a missing path with one of them is a missing file, not a hub name.
_FILE_SUFFIXES = (".json", ".jsonl", ".gz", ".parquet", ".csv", ".tsv", ".txt", ".arrow")


def _names_a_file(path: str) -> bool:
    """A path that is no hub dataset name: absolute, ./ or ~ relative, or a file suffix."""
    return not os.path.isdir(path) and (
        os.path.isabs(path) or path.startswith((".", "~")) or path.endswith(_FILE_SUFFIXES)
    )


def _iter_json(path: str) -> Iterator[tuple[str, dict]]:
    data = read_json(path)
    if isinstance(data, dict) and _looks_like_row(data):
        yield path, data  # one conversation, not a list of them
        return
    if isinstance(data, dict):
        # Some files wrap the rows: {"data": [...]} or {"train": [...]}.
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) == 1:
            data = lists[0]
    if not isinstance(data, list):
        raise DataFormatError(
            f"{path}: expected a JSON array of row objects, got {type(data).__name__}; "
            "write the rows as a list, or as JSON Lines in a .jsonl file"
        )
    for index, row in enumerate(data):
        where = f"{path} [{index}]"
        yield where, _expect_object(row, where)


def _looks_like_row(data: dict) -> bool:
    return any(key in data for key in ("conversations", "messages", "instruction"))


def _iter_dataset(dataset: Any, name: str) -> Iterator[tuple[str, dict]]:
    if isinstance(dataset, dict):  # a DatasetDict is a dict of splits
        raise DataFormatError(
            f"{name}: got a DatasetDict with splits {list(dataset.keys())}; pick one split"
        )
    for index, row in enumerate(dataset):
        where = f"{name} row {index}"
        yield where, _expect_object(row, where)


def _dataset_name(dataset: Any) -> str:
    info = getattr(dataset, "info", None)
    return getattr(info, "dataset_name", None) or type(dataset).__name__


def _expect_object(row: Any, where: str) -> dict:
    if not isinstance(row, dict):
        raise DataFormatError(
            f"{where}: expected a JSON object per row, got {type(row).__name__}; supported "
            f"formats: {_SUPPORTED}"
        )
    return row


# ---------------------------------------------------------------------------------------------
# Normalisation


def detect_format(row: dict, where: str) -> str:
    """Return "sharegpt", "openai" or "alpaca" for a row, or raise naming the keys seen."""
    if "conversations" in row:
        return "sharegpt"
    if "messages" in row:
        return "openai"
    if "instruction" in row:
        return "alpaca"
    raise DataFormatError(
        f"{where}: unknown row format with keys {sorted(row)}; supported formats: {_SUPPORTED}. "
        "Rename the fields or convert the file"
    )


def normalize_row(
    row: dict, where: str, format: str = "auto", report: RowReport | None = None
) -> Conversation:
    """Turn one row into a list of messages; it always holds at least one assistant turn.

    Raises :class:`RowSkipped` (a DataFormatError) for a row not worth training on (see
    data/row_checks.py); a row whose repeated turns were merged is counted in ``report``."""
    if format not in FORMATS:
        raise DataFormatError(f"unknown data format {format!r}; use one of {list(FORMATS)}")
    fmt = detect_format(row, where) if format == "auto" else format
    if fmt == "sharegpt":
        turns = _from_sharegpt(row, where)
    elif fmt == "openai":
        turns = _from_openai(row, where)
    else:
        turns = _from_alpaca(row, where)
    messages, merged = merge_repeated_roles(_check_turns(turns, where))
    if merged and report is not None:
        report.merge(where)
    return messages


# A turn before its checks: (role, content as found in the row, label for messages).
_Turn = tuple[str, Any, str]


def _turns(row: dict, key: str, where: str) -> list:
    turns = row.get(key)
    if not isinstance(turns, list):
        raise DataFormatError(
            f"{where}: field {key!r} must be a list of turns, got {type(turns).__name__}; "
            f"supported formats: {_SUPPORTED}"
        )
    return turns


def _system(row: dict) -> list[_Turn]:
    if isinstance(row.get("system"), str) and row["system"]:
        return [("system", row["system"], "system")]
    return []


def _from_sharegpt(row: dict, where: str) -> list[_Turn]:
    turns = _system(row)
    for i, turn in enumerate(_turns(row, "conversations", where)):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise DataFormatError(
                f"{where}: conversations[{i}] must be an object with 'from' and 'value'"
            )
        role = SHAREGPT_ROLES.get(str(turn["from"]).lower())
        if role is None:
            raise DataFormatError(
                f"{where}: conversations[{i}] has unknown role 'from': {turn['from']!r}; "
                f"allowed: {sorted(SHAREGPT_ROLES)}"
            )
        turns.append((role, turn["value"], f"conversations[{i}]"))
    return turns


def _from_openai(row: dict, where: str) -> list[_Turn]:
    turns = []
    for i, turn in enumerate(_turns(row, "messages", where)):
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            raise DataFormatError(
                f"{where}: messages[{i}] must be an object with 'role' and 'content'"
            )
        if turn["role"] not in ROLES:
            raise DataFormatError(
                f"{where}: messages[{i}] has unknown role {turn['role']!r}; allowed: "
                f"{list(ROLES)} (drop tool/function turns before training)"
            )
        turns.append((turn["role"], turn["content"], f"messages[{i}]"))
    return turns


def _from_alpaca(row: dict, where: str) -> list[_Turn]:
    key = "output" if row.get("output") is not None else "response"
    if row.get(key) is None:
        raise DataFormatError(
            f"{where}: Alpaca row (it has 'instruction') is missing 'output' (or 'response'), "
            "the answer to train on; add it, or use the file as self-distillation prompts"
        )
    prompt = _text(row.get("instruction"), where, "instruction")
    extra = row.get("input") or ""
    if extra:
        prompt = f"{prompt}\n\n{_text(extra, where, 'input')}"
    return [*_system(row), ("user", prompt, "instruction"), ("assistant", row[key], key)]


def _text(value: Any, where: str, label: str) -> str:
    """Content must be text; OpenAI-style lists of {"type": "text", "text": ...} parts are
    joined."""
    if isinstance(value, list) and all(isinstance(p, dict) and "text" in p for p in value):
        value = "".join(str(p["text"]) for p in value)
    if not isinstance(value, str):
        raise DataFormatError(
            f"{where}: {label} content must be a string, got {type(value).__name__}"
        )
    return value


def _check_turns(turns: list[_Turn], where: str) -> Conversation:
    # Assistant turns before the first user turn have no prompt to answer (some ShareGPT dumps
    # start with a greeting); chat templates cannot render them as a continuation, so drop them.
    first_user = next((i for i, t in enumerate(turns) if t[0] == "user"), len(turns))
    turns = [t for i, t in enumerate(turns) if i >= first_user or t[0] != "assistant"]
    messages = []
    for role, value, label in turns:
        content = check_text(_text(value, where, label), where, label)
        if role == "assistant":
            check_answer(content, where, label)
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise DataFormatError(
            f"{where}: conversation has no assistant turn after a user turn, so it has nothing "
            "to train on; remove the row, or use it as a prompt for self-distillation"
        )
    return messages


# ---------------------------------------------------------------------------------------------
# Public readers


def read_conversations(
    source: Any, format: str = "auto", max_rows: int | None = None, split: str = "train"
) -> list[Conversation]:
    """Read and normalise up to ``max_rows`` rows of ``source`` (file path, hub spec or
    ``datasets.Dataset``). Degenerate rows are skipped or mended (data/row_checks.py) and
    counted in one warning per source."""
    conversations: list[Conversation] = []
    report = RowReport()
    for where, row in iter_rows(source, split=split):
        if max_rows is not None and len(conversations) >= max_rows:
            break
        report.rows += 1
        try:
            conversations.append(normalize_row(row, where, format, report))
        except RowSkipped as skipped:
            report.skip(skipped)
    report.log(_describe(source))
    if not conversations and report.skipped:
        raise DataFormatError(
            f"{_describe(source)}: every row was skipped: {report.describe_skips()}; fix the rows"
        )
    if not conversations:
        raise DataFormatError(f"{_describe(source)}: empty dataset; point it at a file with rows")
    return conversations


def read_prompts(source: Any, split: str = "train") -> list[dict]:
    """Read benchmark / self-distillation prompts as ``{"id", "category", "turns": [str]}``.

    A row gives its user turns through ``turns`` (MT-bench, Spec-Bench), ``prompt``,
    ``instruction`` (+ ``input``), or the user turns of a ShareGPT / OpenAI conversation."""
    prompts = []
    for index, (where, row) in enumerate(iter_rows(source, split=split)):
        prompts.append(
            {
                "id": row.get("question_id", row.get("id", index)),
                "category": str(row.get("category") or "general"),
                "turns": _prompt_turns(row, where),
            }
        )
    if not prompts:
        raise DataFormatError(f"{_describe(source)}: empty prompt file")
    return prompts


def _prompt_turns(row: dict, where: str) -> list[str]:
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns) or not turns:
            raise DataFormatError(f"{where}: 'turns' must be a non-empty list of strings")
        return list(turns)
    if isinstance(row.get("prompt"), str):
        return [row["prompt"]]
    if isinstance(row.get("instruction"), str):
        extra = row.get("input") or ""
        return [f"{row['instruction']}\n\n{extra}" if extra else row["instruction"]]
    if "conversations" in row or "messages" in row:
        fmt = "sharegpt" if "conversations" in row else "openai"
        raw = _from_sharegpt(row, where) if fmt == "sharegpt" else _from_openai(row, where)
        turns = [_text(value, where, label) for role, value, label in raw if role == "user"]
        if turns:
            return turns
    raise DataFormatError(
        f"{where}: no prompt found in a row with keys {sorted(row)}; a prompt row needs 'turns' "
        "(list of str), 'prompt', 'instruction', or user turns in 'conversations' / 'messages'"
    )


def _describe(source: Any) -> str:
    return os.fspath(source) if isinstance(source, str | os.PathLike) else _dataset_name(source)
