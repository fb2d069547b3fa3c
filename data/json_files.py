"""Strict readers for .json and .jsonl data files.

The bytes must be UTF-8 (a leading byte-order mark, as Windows editors write, is dropped; CRLF
line ends are fine). Whatever else goes wrong becomes a :class:`DataFormatError` whose message
names the file, the line (or byte offset) and what to change: bytes that are not UTF-8, UTF-16
text, binary files, malformed JSON, nesting deeper than the parser's recursion limit, and an
object that repeats a key (JSON would silently keep only the last value).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

from data.errors import DraftsmithError

BOM = b"\xef\xbb\xbf"
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
_HEAD_BYTES = 8192  # enough of a file's start to tell text from binary
# A JSON string (escapes included) or one bracket: enough to measure nesting depth.
_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


class DataFormatError(DraftsmithError, ValueError):
    """A data file or row that cannot be read; the message says where and how to fix it."""


def check_file(path: str) -> None:
    """Raise unless ``path`` is an existing regular file (a directory gets its own message)."""
    if os.path.isdir(path):
        raise DataFormatError(
            f"{path}: is a directory, not a data file; point the source at a .json or .jsonl "
            "file inside it (a dataset folder is loaded by its name without the extension)"
        )
    if not os.path.isfile(path):
        raise DataFormatError(f"{path}: file not found; check the data source path")


def iter_jsonl(path: str) -> Iterator[tuple[str, Any]]:
    """Yield ``(where, value)`` for every non-blank line of a JSON Lines file, read as bytes so
    that an encoding error can name its line and byte offset."""
    check_file(path)
    offset = 0
    with open(path, "rb") as f:
        check_head(f.read(_HEAD_BYTES), path)
        f.seek(0)
        for lineno, raw in enumerate(f, start=1):
            text = decode(raw, path, offset, lineno)
            offset += len(raw)
            if text.strip():
                yield f"{path} line {lineno}", parse(text, path, lineno)


def read_json(path: str) -> Any:
    """The whole document of a .json file."""
    check_file(path)
    with open(path, "rb") as f:
        raw = f.read()
    check_head(raw[:_HEAD_BYTES], path)
    return parse(decode(raw, path, 0, None), path, None)


def check_head(head: bytes, path: str) -> None:
    """Refuse a file whose first bytes show it is UTF-16 or binary rather than UTF-8 JSON."""
    if head.startswith(_UTF16_BOMS):
        raise DataFormatError(
            f"{path}: UTF-16 text (it starts with the byte-order mark "
            f"{head[:2].hex(' ').upper()}); save the file as UTF-8"
        )
    if b"\x00" in head:
        _refuse_binary(path, None, head, 0)


def decode(raw: bytes, path: str, offset: int, lineno: int | None) -> str:
    """UTF-8 bytes -> text. ``raw`` is line ``lineno`` of a JSON Lines file, or a whole file
    (``lineno`` None); ``offset`` is where it starts in the file. A byte-order mark at the start
    of the file is dropped."""
    if offset == 0 and raw.startswith(BOM):
        raw, offset = raw[len(BOM) :], len(BOM)
    if b"\x00" in raw:
        _refuse_binary(path, lineno, raw, offset)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataFormatError(
            f"{_line(path, lineno, raw, e.start)}: not UTF-8 (byte 0x{raw[e.start]:02x} at "
            f"offset {offset + e.start}); save the file as UTF-8 (e.g. `iconv -f latin1 "
            "-t utf-8 IN > OUT`)"
        ) from None


def _refuse_binary(path: str, lineno: int | None, raw: bytes, offset: int) -> None:
    nul = raw.index(b"\x00")
    raise DataFormatError(
        f"{_line(path, lineno, raw, nul)}: binary data (a NUL byte at offset {offset + nul}), "
        "not JSON text; point the source at a .json or .jsonl text file"
    )


def _line(path: str, lineno: int | None, raw: bytes, index: int) -> str:
    """ "PATH line N" for byte ``index`` of ``raw`` (line ``lineno``, or a whole file)."""
    if lineno is None:
        lineno = raw.count(b"\n", 0, index) + 1
    return f"{path} line {lineno}"


def parse(text: str, path: str, lineno: int | None) -> Any:
    """Parse a JSON Lines line (``lineno``) or a whole .json file (None), refusing repeated
    keys and nesting past the recursion limit."""
    repeated: list[tuple[dict, str]] = []
    try:
        value = json.loads(text, object_pairs_hook=lambda pairs: _object(pairs, repeated))
    except RecursionError:
        depth, line = _deepest(text)
        raise DataFormatError(
            f"{path} line {lineno or line}: JSON nested {depth} levels deep, past Python's "
            "recursion limit; a row needs only a few levels: remove or flatten that value"
        ) from None
    except json.JSONDecodeError as e:
        raise DataFormatError(_malformed(text, path, lineno, e)) from None
    if repeated:
        obj, key = repeated[0]
        inside = locate(value, obj)
        where = path if lineno is None else f"{path} line {lineno}"
        where = f"{where} {inside.lstrip('.')}" if inside else where
        raise DataFormatError(
            f"{where}: key {key!r} appears twice in one object and JSON keeps only the last "
            "value; remove or rename one of them"
        )
    return value


def _malformed(text: str, path: str, lineno: int | None, e: json.JSONDecodeError) -> str:
    if lineno is not None:
        hint = ""
        if lineno == 1 and text.lstrip().startswith("["):
            hint = " (it looks like one JSON array: rename the file to .json)"
        return (
            f"{path} line {lineno}: malformed JSON ({e.msg} at column {e.colno}); each line "
            f"of a .jsonl file must be one complete JSON object{hint}"
        )
    hint = ""
    if text.lstrip().startswith("{") and "\n{" in text:
        hint = " (it looks like JSON Lines: rename it to .jsonl)"
    return (
        f"{path} line {e.lineno}: malformed JSON ({e.msg} at column {e.colno}); a .json file "
        f"must hold one JSON array of row objects{hint}"
    )


def _object(pairs: list[tuple[str, Any]], repeated: list[tuple[dict, str]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs) and not repeated:
        seen: set[str] = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        repeated.append((obj, key))
    return obj


def locate(value: Any, target: Any) -> str:
    """Where ``target`` sits inside ``value``, e.g. ``[3].messages[1]`` ("" for the top)."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:  # iterative: the document may be deep
        node, path = stack.pop()
        if node is target:
            return path
        if isinstance(node, dict):
            stack += [(v, f"{path}.{k}") for k, v in node.items()]
        elif isinstance(node, list):
            stack += [(v, f"{path}[{i}]") for i, v in enumerate(node)]
    return ""


def _deepest(text: str) -> tuple[int, int]:
    """(greatest bracket depth, its line) of a JSON text, strings skipped."""
    raw = text.encode("utf-8")
    depth = best = best_at = 0
    for token in _JSON_TOKEN.finditer(raw):
        char = token.group()[:1]
        if char in b"[{":
            depth += 1
            if depth > best:
                best, best_at = depth, token.start()
        elif char in b"]}":
            depth -= 1
    return best, raw.count(b"\n", 0, best_at) + 1
