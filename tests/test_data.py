"""data/: formats, chat-template masks, truncation, errors, split and collate."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from data import (
    ChatTemplateError,
    DataFormatError,
    DataSource,
    ExampleDataset,
    build_examples,
    collate,
    load_conversations,
    read_conversations,
    read_prompts,
    split_examples,
    tokenize_conversation,
)
from data.chat import _tokenize_with_spans, assistant_spans, resolve_chat_template

CORPORA = Path(__file__).resolve().parents[1] / "data" / "corpora"

# The SmolLM2 template: ChatML with a default system prompt when the first turn is not system.
SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_chat_tokenizer(chat_template: str | None = SMOL_TEMPLATE):
    """A tiny byte-level BPE tokenizer (lossless decode) with ChatML special tokens, trained
    in-process on a few sentences. Vocab ~300."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(
        ["hello world, how are you today?", "I am fine, thank you.", "The cat sat on the mat."],
        trainer=trainer,
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    hf.chat_template = chat_template
    return hf


@pytest.fixture(scope="module")
def chat_tokenizer():
    return make_chat_tokenizer()


CHAT = [
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "I am fine, thank you."},
    {"role": "user", "content": "how are you today?"},
    {"role": "assistant", "content": "The cat sat on the mat."},
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------ formats


def test_sharegpt_openai_alpaca_rows_normalise(tmp_path):
    sharegpt = {
        "system": "Be brief.",
        "conversations": [
            {"from": "gpt", "value": "Hi! (greeting before any prompt: dropped)"},
            {"from": "human", "value": "q1"},
            {"from": "gpt", "value": "a1"},
            {"from": "user", "value": "q2"},
            {"from": "chatgpt", "value": "a2"},
        ],
    }
    openai = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    alpaca = {"instruction": "Do it", "input": "with this", "output": "done"}
    alpaca_response = {"instruction": "Do it", "input": "", "response": "ok"}
    path = write_jsonl(tmp_path / "mix.jsonl", [sharegpt, openai, alpaca, alpaca_response])
    convs = read_conversations(str(path))
    assert convs[0] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
    ]
    assert convs[1] == openai["messages"]
    assert convs[2] == [
        {"role": "user", "content": "Do it\n\nwith this"},
        {"role": "assistant", "content": "done"},
    ]
    assert convs[3][0]["content"] == "Do it" and convs[3][1]["content"] == "ok"
    assert len(read_conversations(str(path), max_rows=2)) == 2


def test_json_array_and_hf_dataset(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows * 3), encoding="utf-8")
    assert len(read_conversations(str(path))) == 3

    import datasets

    ds = datasets.Dataset.from_list([{"instruction": "i", "output": "o"}] * 2)
    convs = read_conversations(ds, format="alpaca")
    assert convs == [[{"role": "user", "content": "i"}, {"role": "assistant", "content": "o"}]] * 2
    with pytest.raises(DataFormatError, match="pick one split"):
        read_conversations(datasets.DatasetDict({"train": ds}))


@pytest.mark.parametrize(
    "content, filename, expected",
    [
        (
            '{"instruction": "q", "output": "a"}\n\n{"messages": [\n',
            "bad.jsonl",
            ["line 3", "malformed JSON"],
        ),
        ('[{"instruction": "a",\n "output": }]', "bad.json", ["line 2", "malformed JSON"]),
        ("", "empty.jsonl", ["empty dataset"]),
        ('{"a": 1}', "obj.json", ["expected a JSON array"]),
    ],
)
def test_bad_files_name_the_line_and_fix(tmp_path, content, filename, expected):
    path = tmp_path / filename
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataFormatError) as err:
        read_conversations(str(path))
    assert str(path) in str(err.value)
    for text in expected:
        assert text in str(err.value)


GOOD = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}


@pytest.mark.parametrize(
    "row, expected",
    [
        (
            {"conversations": [{"from": "robot", "value": "x"}]},
            ["line 2", "'robot'", "allowed", "human", "gpt"],
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, ["line 2", "'tool'", "assistant"]),
        (
            {"messages": [{"role": "user", "content": "only a question"}]},
            ["line 2", "no assistant turn", "self-distillation"],
        ),
        ({"text": "plain", "id": 3}, ["line 2", "['id', 'text']", "ShareGPT", "Alpaca"]),
    ],
)
def test_bad_rows_name_the_line_and_fix(tmp_path, row, expected):
    path = write_jsonl(tmp_path / "rows.jsonl", [GOOD, row])
    with pytest.raises(DataFormatError) as err:
        read_conversations(str(path))
    for text in expected:
        assert text in str(err.value)


def test_json_array_errors_give_the_index(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([GOOD, GOOD, {"prompt": "x"}]), encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"rows.json \[2\]: unknown row format"):
        read_conversations(str(path))


def test_read_prompts(tmp_path):
    rows = [
        {"question_id": 7, "category": "math", "turns": ["a", "b"]},
        {"id": "p1", "prompt": "hello"},
        {"instruction": "do", "input": "this", "response": "ignored"},
        {"conversations": [{"from": "human", "value": "u1"}, {"from": "gpt", "value": "x"}]},
    ]
    prompts = read_prompts(str(write_jsonl(tmp_path / "p.jsonl", rows)))
    assert prompts[0] == {"id": 7, "category": "math", "turns": ["a", "b"]}
    assert prompts[1] == {"id": "p1", "category": "general", "turns": ["hello"]}
    assert prompts[2]["turns"] == ["do\n\nthis"] and prompts[2]["id"] == 2
    assert prompts[3]["turns"] == ["u1"]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"answer": "x"}])
    with pytest.raises(DataFormatError, match="line 1.*'turns'"):
        read_prompts(str(bad))


def test_corpora_in_repo_load():
    convs = read_conversations(str(CORPORA / "oasst_en" / "conversations.jsonl"))
    assert len(convs) == 282
    assert all(c[-1]["role"] == "assistant" and c[0]["role"] == "user" for c in convs)
    mt = read_prompts(str(CORPORA / "mt_bench" / "question.jsonl"))
    assert len(mt) == 80 and {len(p["turns"]) for p in mt} == {2}
    assert len({p["category"] for p in mt}) == 8


# ------------------------------------------------------------------------------ chat + masks


@pytest.mark.parametrize("kind", ["bpe", "conftest_chars"])
def test_mask_is_exactly_the_assistant_turns(chat_tokenizer, tokenizer, kind):
    # Both the byte-level BPE above and the conftest's character-level tokenizer.
    tokenizer = chat_tokenizer if kind == "bpe" else tokenizer
    example = tokenize_conversation(CHAT, tokenizer, max_length=10_000)
    ids, mask = example["input_ids"], example["loss_mask"]
    assert ids.dtype == mask.dtype == torch.long and ids.shape == mask.shape
    # The ids are exactly the template's own tokenization.
    reference = tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=False)
    assert ids.tolist() == list(reference)
    assert tokenizer.decode(ids[mask == 1]) == (
        "I am fine, thank you.<|im_end|>The cat sat on the mat.<|im_end|>"
    )
    unmasked = tokenizer.decode(ids[mask == 0])
    assert "<|im_start|>assistant\n" in unmasked and "<|im_start|>system\nYou are" in unmasked
    # Each assistant turn is one contiguous run of ones.
    runs = (mask[1:] - mask[:-1] == 1).sum() + int(mask[0] == 1)
    assert runs == 2


def test_mask_with_system_turn_and_spans(chat_tokenizer):
    chat = [{"role": "system", "content": "Be kind."}, *CHAT[:2]]
    template = resolve_chat_template(chat_tokenizer)
    text, spans = assistant_spans(chat, chat_tokenizer, template)
    assert text.startswith("<|im_start|>system\nBe kind.<|im_end|>")
    assert [text[s:e] for s, e in spans] == ["I am fine, thank you.<|im_end|>"]


def test_slow_tokenizer_path_matches_offsets(chat_tokenizer):
    class NoOffsets:  # a tokenizer view without offsets, like a slow (Python) tokenizer
        is_fast = False

        def encode(self, text, add_special_tokens=False):
            return chat_tokenizer.encode(text, add_special_tokens=add_special_tokens)

    text, spans = assistant_spans(CHAT, chat_tokenizer, resolve_chat_template(chat_tokenizer))
    assert _tokenize_with_spans(text, spans, NoOffsets()) == _tokenize_with_spans(
        text, spans, chat_tokenizer
    )


def test_truncation(chat_tokenizer):
    full = tokenize_conversation(CHAT, chat_tokenizer, max_length=10_000)
    first_label = int(full["loss_mask"].argmax())
    cut = tokenize_conversation(CHAT, chat_tokenizer, max_length=first_label + 3)
    assert len(cut["input_ids"]) == first_label + 3
    assert torch.equal(cut["input_ids"], full["input_ids"][: first_label + 3])
    assert cut["loss_mask"].sum() == 3
    assert tokenize_conversation(CHAT, chat_tokenizer, max_length=first_label) is None


def test_build_examples_drops_and_warns(chat_tokenizer, caplog):
    long_chat = [{"role": "user", "content": "hello world " * 40}, CHAT[1]]
    short = tokenize_conversation(CHAT[:2], chat_tokenizer, max_length=10_000)
    with caplog.at_level(logging.WARNING, logger="data.dataset"):
        examples = build_examples(
            [CHAT[:2], long_chat], chat_tokenizer, max_length=len(short["input_ids"])
        )
    assert len(examples) == 1
    assert "dropped 1 of 2 conversations" in caplog.text and "max_length" in caplog.text
    with pytest.raises(DataFormatError, match="no training examples"):
        build_examples([long_chat], chat_tokenizer, max_length=8)


def test_missing_template_says_set_data_chat_template():
    bare = make_chat_tokenizer(chat_template=None)
    with pytest.raises(ChatTemplateError, match="data.chat_template"):
        tokenize_conversation(CHAT, bare, max_length=64)
    example = tokenize_conversation(CHAT, bare, max_length=10_000, chat_template="chatml")
    ids = example["input_ids"]
    assert bare.decode(ids[example["loss_mask"] == 1]).count("<|im_end|>") == 2
    assert not bare.decode(ids).startswith("<|im_start|>system")  # plain ChatML: no default


def test_template_that_rewrites_history_is_refused(chat_tokenizer):
    # Renders only the last turn: earlier turns are not a prefix of later renders.
    odd = "{{ messages[-1]['content'] }}{% if add_generation_prompt %}>>{% endif %}"
    with pytest.raises(ChatTemplateError, match="continuation"):
        tokenize_conversation(CHAT, chat_tokenizer, max_length=64, chat_template=odd)


# ------------------------------------------------------------------------------ dataset


def test_load_conversations_with_weights(tmp_path):
    rows = [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(4)]
    path = str(write_jsonl(tmp_path / "a.jsonl", rows))
    convs = load_conversations([DataSource(path, weight=1.5), DataSource(path, max_rows=1)])
    assert [c[0]["content"] for c in convs] == ["q0", "q1", "q2", "q3", "q0", "q1", "q0"]
    with pytest.raises(ValueError, match="format"):
        DataSource(path, format="csv")
    with pytest.raises(ValueError, match="weight"):
        DataSource(path, weight=0)


def _fake_examples(n: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    return [
        {
            "input_ids": torch.randint(5, 100, (3 + i % 4,), generator=gen),
            "loss_mask": torch.ones(3 + i % 4, dtype=torch.long),
        }
        for i in range(n)
    ]


def test_split_is_deterministic_disjoint_and_order_free():
    examples = _fake_examples(20)
    train, val = split_examples(examples, val_fraction=0.2, seed=3)
    assert len(val) == 4 and len(train) == 16

    def key(e):
        return tuple(e["input_ids"].tolist())

    assert not {key(e) for e in train} & {key(e) for e in val}
    train2, val2 = split_examples(list(reversed(examples)), val_fraction=0.2, seed=3)
    assert {key(e) for e in val2} == {key(e) for e in val}
    _, val3 = split_examples(examples, val_fraction=0.2, seed=4)
    assert {key(e) for e in val3} != {key(e) for e in val}
    # Duplicates stay on one side.
    train4, val4 = split_examples(examples + examples, val_fraction=0.2, seed=3)
    assert not {key(e) for e in train4} & {key(e) for e in val4}
    assert split_examples(examples, 0.0)[1] == []


def test_collate_right_pads_everything():
    examples = [
        {
            "input_ids": torch.tensor([5, 6, 7]),
            "loss_mask": torch.tensor([0, 1, 1]),
            "hidden": torch.ones(3, 4, dtype=torch.float16),
        },
        {
            "input_ids": torch.tensor([8]),
            "loss_mask": torch.tensor([1]),
            "hidden": torch.full((1, 4), 2.0, dtype=torch.float16),
        },
    ]
    batch = collate(examples, pad_id=9)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch["hidden"].shape == (2, 3, 4) and batch["hidden"].dtype == torch.float16
    assert batch["hidden"][1, 1:].abs().sum() == 0 and batch["hidden"][1, 0, 0] == 2
    assert "aux" not in batch
    with pytest.raises(ValueError, match="'hidden'"):
        collate([examples[0], {k: v for k, v in examples[1].items() if k != "hidden"}])

    dataset = ExampleDataset(examples)
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, collate_fn=collate)
    assert next(iter(loader))["input_ids"].shape == (2, 3)
    assert dataset.lengths() == [3, 1]
