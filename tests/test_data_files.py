"""Data files that are not what they seem: encodings, binary files, deep nesting, repeated keys,
degenerate rows, template paths. Each error names the file, the line and the fix."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from data import ChatTemplateError, DataFormatError, build_examples, read_conversations
from data.chat import CHATML_TEMPLATE, resolve_chat_template
from data.formats import normalize_row, read_prompts

Q = {"role": "user", "content": "q"}
A = {"role": "assistant", "content": "a"}
GOOD = {"messages": [Q, A]}
GOOD_LINE = json.dumps(GOOD).encode() + b"\n"


def load_error(path: Path) -> str:
    with pytest.raises(DataFormatError) as err:
        read_conversations(str(path))
    return str(err.value)


# ------------------------------------------------------------------------------ encodings


def test_latin1_jsonl_names_line_byte_offset_and_fix(tmp_path):
    path = tmp_path / "latin1.jsonl"
    bad = '{"instruction": "caf\xe9", "output": "ok"}\n'.encode("latin-1")
    path.write_bytes(GOOD_LINE + bad)
    message = load_error(path)
    offset = len(GOOD_LINE) + bad.index(b"\xe9")
    assert message.startswith(f"{path} line 2: not UTF-8 (byte 0xe9 at offset {offset})")
    assert "save the file as UTF-8" in message


def test_latin1_json_counts_the_line(tmp_path):
    path = tmp_path / "latin1.json"
    text = '[\n {"instruction": "q", "output": "a"},\n {"instruction": "\xfc", "output": "a"}\n]'
    path.write_bytes(text.encode("latin-1"))
    assert load_error(path).startswith(f"{path} line 3: not UTF-8 (byte 0xfc at offset")


def test_binary_file_renamed_jsonl(tmp_path):
    path = tmp_path / "weights.jsonl"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00")
    message = load_error(path)
    assert message.startswith(f"{path} line 3: binary data (a NUL byte at offset 8)")
    assert "not JSON text" in message


def test_utf16_file_says_save_as_utf8(tmp_path):
    path = tmp_path / "notepad.json"
    path.write_bytes(json.dumps([GOOD]).encode("utf-16"))  # starts with the FF FE mark
    message = load_error(path)
    assert message.startswith(f"{path}: UTF-16 text") and "save the file as UTF-8" in message


def test_bom_and_crlf_load_as_if_absent(tmp_path):
    rows = [GOOD, {"instruction": "i", "output": "o"}]
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    windows = tmp_path / "windows.jsonl"
    windows.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\r\n" for r in rows).encode())
    array = tmp_path / "windows.json"
    array.write_bytes(b"\xef\xbb\xbf" + json.dumps(rows, indent=1).replace("\n", "\r\n").encode())
    expected = read_conversations(str(plain))
    assert read_conversations(str(windows)) == expected == read_conversations(str(array))
    assert read_prompts(str(windows))[0]["turns"] == ["q"]


# ------------------------------------------------------------------------------ structure


def test_deep_nesting_is_a_data_error_with_its_line(tmp_path):
    deep = "[" * 5000 + "]" * 5000
    jsonl = tmp_path / "deep.jsonl"
    jsonl.write_bytes(GOOD_LINE + ('{"messages": ' + deep + "}\n").encode())
    message = load_error(jsonl)
    assert message.startswith(f"{jsonl} line 2: JSON nested 5001 levels deep")
    assert "remove or flatten" in message
    array = tmp_path / "deep.json"
    array.write_text(f"[\n{json.dumps(GOOD)},\n" + '{"x": ' + deep + "}\n]", encoding="utf-8")
    assert load_error(array).startswith(f"{array} line 3: JSON nested 5002 levels deep")


def test_repeated_keys_are_refused_where_they_are(tmp_path):
    jsonl = tmp_path / "dup.jsonl"
    jsonl.write_bytes(GOOD_LINE + b'{"instruction": "i", "output": "o", "output": ""}\n')
    message = load_error(jsonl)
    assert message.startswith(f"{jsonl} line 2: key 'output' appears twice in one object")
    assert "remove or rename one" in message
    array = tmp_path / "dup.json"
    nested = '{"messages": [{"role": "user", "content": "a", "content": "b"}, ' + json.dumps(A)
    array.write_text(f"[{json.dumps(GOOD)}, {nested}]}}]", encoding="utf-8")
    assert load_error(array).startswith(f"{array} [1].messages[0]: key 'content' appears twice")


def test_a_directory_named_like_a_data_file(tmp_path):
    folder = tmp_path / "rows.jsonl"
    folder.mkdir()
    message = load_error(folder)
    assert message.startswith(f"{folder}: is a directory, not a data file")


@pytest.mark.parametrize("name", ["rows.parquet", "./rows", "sub/rows.txt"])
def test_a_missing_local_file_is_not_looked_up_on_the_hub(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataFormatError) as err:
        read_conversations(name)
    assert str(err.value) == f"{name}: file not found; check the data source path"


@pytest.mark.parametrize(
    "row",
    [GOOD, {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}],
)
def test_json_file_holding_one_conversation(tmp_path, row):
    path = tmp_path / "one.json"
    path.write_text(json.dumps(row, indent=2), encoding="utf-8")
    assert read_conversations(str(path)) == [[Q, A]]


# ------------------------------------------------------------------------------ degenerate rows


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_empty_answers_are_skipped_and_counted(tmp_path, caplog):
    rows = [
        GOOD,
        {"instruction": "say nothing", "output": ""},
        {"messages": [Q, {"role": "assistant", "content": " \n\t"}]},
        {"instruction": "i", "output": "o"},
    ]
    path = write_rows(tmp_path / "rows.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="data.formats"):
        conversations = read_conversations(str(path))
    assert [c[-1]["content"] for c in conversations] == ["a", "o"]
    assert f"{path}: skipped 2 of 4 rows: 2 with an empty assistant answer" in caplog.text
    assert f"(first: {path} line 2: output is an empty assistant answer" in caplog.text


def test_control_characters_skip_the_row(tmp_path, caplog):
    bad = {"messages": [{"role": "user", "content": "he\x00llo"}, A]}
    path = write_rows(tmp_path / "rows.jsonl", [bad, GOOD])
    with caplog.at_level(logging.WARNING, logger="data.formats"):
        assert read_conversations(str(path)) == [[Q, A]]
    assert "skipped 1 of 2 rows: 1 with control characters" in caplog.text
    assert "line 1: messages[0] holds control character U+0000 at character 2" in caplog.text
    tabs = {"messages": [{"role": "user", "content": "a\tb\r\nc"}, A]}  # ordinary whitespace
    assert (
        read_conversations(str(write_rows(tmp_path / "ok.jsonl", [tabs])))[0][0]
        == tabs["messages"][0]
    )


def test_every_row_skipped_is_an_error(tmp_path):
    path = write_rows(tmp_path / "rows.jsonl", [{"instruction": "i", "output": ""}])
    message = load_error(path)
    assert message.startswith(f"{path}: every row was skipped: 1 with an empty assistant answer")


def test_repeated_user_turns_are_merged_and_reported(tmp_path, caplog):
    row = {
        "conversations": [
            {"from": "human", "value": "part one"},
            {"from": "human", "value": "part two"},
            {"from": "gpt", "value": "answer"},
        ]
    }
    path = write_rows(tmp_path / "rows.jsonl", [GOOD, row])
    with caplog.at_level(logging.WARNING, logger="data.formats"):
        conversations = read_conversations(str(path))
    assert conversations[1] == [
        {"role": "user", "content": "part one\n\npart two"},
        {"role": "assistant", "content": "answer"},
    ]
    assert "merged consecutive turns of one role" in caplog.text
    assert f"in 1 of 2 rows (first: {path} line 2)" in caplog.text


def test_alpaca_row_without_output_says_so():
    with pytest.raises(DataFormatError) as err:
        normalize_row({"instruction": "do it", "input": ""}, "a.jsonl line 7")
    message = str(err.value)
    assert message.startswith("a.jsonl line 7: Alpaca row") and "missing 'output'" in message


# ------------------------------------------------------------------------------ chat templates


def test_missing_template_file_is_named_not_used_as_text(tokenizer, tmp_path):
    missing = str(tmp_path / "templates" / "mine.jinja")
    with pytest.raises(ChatTemplateError) as err:
        build_examples([[Q, A]], tokenizer, max_length=64, chat_template=missing)
    assert f"chat template file {missing!r} not found" in str(err.value)
    with pytest.raises(ChatTemplateError, match="is a directory"):
        resolve_chat_template(tokenizer, str(tmp_path))


def test_template_file_of_any_extension_is_read(tokenizer, tmp_path):
    path = tmp_path / "chatml.j2"
    path.write_bytes(b"\xef\xbb\xbf" + CHATML_TEMPLATE.encode())
    assert resolve_chat_template(tokenizer, str(path)) == CHATML_TEMPLATE
    (example,) = build_examples([[Q, A]], tokenizer, max_length=64, chat_template=str(path))
    assert tokenizer.decode(example["input_ids"]).startswith("<|im_start|>user\nq")


def test_self_distillation_output_is_read_as_strictly(tmp_path):
    from data.distill import done_keys

    out = tmp_path / "sd.jsonl"
    out.write_bytes(b'{"id": "a/1/0"}\n{"id": "a/2/0", "note": "\xff"}\n')
    with pytest.raises(DataFormatError) as err:
        done_keys(out)
    assert str(err.value).startswith(f"{out} line 2: not UTF-8 (byte 0xff at offset 41)")
    assert "remove that line and run again" in str(err.value)
