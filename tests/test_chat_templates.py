"""Loss masks on the real chat templates of four families: Llama-3.1, Qwen2.5, Gemma-3, SmolLM2.

The templates are verbatim copies (tests/fixtures/chat_templates/README.md says whence). Each
family gets a small BPE tokenizer trained here, in milliseconds, on the test conversations and
built like its real one: byte-level BPE with Llama-3's or Qwen2's split regex, Gemma's
``GemmaTokenizer`` (spaces as "▁", byte fallback), GPT-2 byte-level for SmolLM2; Llama-3's and
Gemma's add BOS when asked to, as the real ones do, so a doubled BOS would show. One integration
test repeats the checks with the embedded SmolLM2's real tokenizer.

For every template and conversation (with and without a system message):
1. the tokens with ``loss_mask == 1``, decoded, are each assistant answer followed by the
   template's end-of-turn token (what the draft must learn to emit after an answer), and
   nothing else: no header, prompt, system text or generation prompt;
2. the example's ids are the tokenization of the whole rendered conversation, and the ids that
   ``ChatEncoder.prompt`` gives for the turns before each answer are a prefix of them, its
   answer's first token the first label after it (the incremental rendering agrees with the
   whole);
3. the ids hold exactly one BOS where the template writes one, none where it does not.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from data.chat import ChatEncoder, render

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"

# Llama-3's and Qwen2's pre-tokenizer regexes, as in their tokenizer.json files.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)

SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one line."}
CHAT = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2 + 2 = 4."},
    {"role": "user", "content": "Write it in Python, then say it in French."},
    {"role": "assistant", "content": "```python\nprint(2 + 2)\n```\n\nQuatre, c'est tout."},
]
CONVERSATIONS = {"system": [SYSTEM, *CHAT], "no_system": CHAT}


@dataclass(frozen=True)
class Family:
    """A chat template, the tokenizer that goes with it, and what the template writes."""

    template: str  # file name under fixtures/chat_templates
    build: Any  # (corpus: list[str]) -> a fast tokenizer knowing the template's special tokens
    end_of_turn: str  # the token after each assistant answer
    bos: str | None  # the BOS the template writes, or None when it writes none
    trims: bool  # the template strips whitespace around each message

    def tokenizer(self):
        corpus = [m["content"] for m in (SYSTEM, *CHAT)] + ["system user assistant model"]
        return self.build(corpus)

    def encoder(self, tokenizer) -> ChatEncoder:
        return ChatEncoder(tokenizer, str(TEMPLATES / self.template))


def _byte_level(corpus, specials, bos, eos, split=None, add_bos=False):
    """A byte-level BPE (Llama-3 / Qwen2 / GPT-2 style) trained on `corpus`; with `add_bos` it
    prepends BOS when asked for special tokens, as Llama-3's post-processor does."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    if split is None:  # GPT-2's own regex
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    if add_bos:
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    others = [t for t in specials if t not in (bos, eos)]
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, additional_special_tokens=others
    )


def llama3_tokenizer(corpus):
    specials = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|python_tag|>",
    ]
    return _byte_level(corpus, specials, "<|begin_of_text|>", "<|eot_id|>", LLAMA3_SPLIT, True)


def qwen2_tokenizer(corpus):
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return _byte_level(corpus, specials, None, "<|im_end|>", QWEN2_SPLIT)


def smollm2_tokenizer(corpus):
    """SmolLM2's tokenizer calls <|im_start|> its BOS but adds none; its template writes none."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return _byte_level(corpus, specials, "<|im_start|>", "<|im_end|>")


def gemma3_tokenizer(corpus):
    """transformers' GemmaTokenizer (spaces as "▁", byte fallback, adds <bos>) with a vocabulary
    trained here; <start_of_turn> and <end_of_turn> are special, as in Gemma's own."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    base = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    turns = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>"]
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    # SentencePiece-like pieces for training: "▁word", newlines on their own.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split("\n", behavior="isolated"),
            pre_tokenizers.Split("▁", behavior="merged_with_next"),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=900,
        special_tokens=base + turns + bytes_,
        show_progress=False,
        initial_alphabet=list(string.printable.replace(" ", "▁")),
    )
    tok.train_from_iterator(corpus, trainer)
    trained = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    return GemmaTokenizer(
        vocab=trained["vocab"], merges=merges, additional_special_tokens=turns, add_bos_token=True
    )


FAMILIES = {
    "llama3": Family("llama3.jinja", llama3_tokenizer, "<|eot_id|>", "<|begin_of_text|>", True),
    "qwen2_5": Family("qwen2_5.jinja", qwen2_tokenizer, "<|im_end|>", None, False),
    "gemma3": Family("gemma3.jinja", gemma3_tokenizer, "<end_of_turn>", "<bos>", True),
    "smollm2": Family("smollm2.jinja", smollm2_tokenizer, "<|im_end|>", None, False),
}


def labelled_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    """The maximal runs of ids whose mask is 1, in order."""
    runs, current = [], []
    for token, label in zip(ids, mask):
        if label:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return [*runs, current] if current else runs


def check_masks(family: Family, tokenizer, messages) -> dict:
    """Assertions 1-3 of the module docstring on one conversation; returns the example."""
    encoder = family.encoder(tokenizer)
    example = encoder.example(messages, max_length=10_000)
    ids, mask = example["input_ids"].tolist(), example["loss_mask"].tolist()

    # 1. labels: each answer and its end-of-turn token, nothing else
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    expected = [(a.strip() if family.trims else a) + family.end_of_turn for a in answers]
    assert [tokenizer.decode(run) for run in labelled_runs(ids, mask)] == expected
    assert len(example["input_ids"]) == len(example["loss_mask"])

    # 2. the whole rendering, and each answer's prompt a prefix of it
    text = render(messages, tokenizer, encoder.template, generation=False)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = encoder.prompt(messages[:i])
        assert ids[: len(prompt)] == prompt
        assert mask[len(prompt)] == 1 and mask[len(prompt) - 1] == 0

    # 3. exactly one BOS, the template's; the tokenizer adds none of its own
    assert tokenizer.decode(ids) == text  # nothing added before, after or between
    if family.bos is not None:
        bos_id = tokenizer.convert_tokens_to_ids(family.bos)
        assert ids[0] == bos_id and ids.count(bos_id) == 1
        prompt = encoder.prompt(messages[:-1])
        assert prompt[0] == bos_id and prompt.count(bos_id) == 1
    return example


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("name", FAMILIES)
def test_masks_on_real_chat_templates(name, conversation):
    family = FAMILIES[name]
    check_masks(family, family.tokenizer(), CONVERSATIONS[conversation])


@pytest.mark.parametrize("name", ["llama3", "gemma3"])
def test_the_tokenizers_would_double_bos_if_asked(name):
    """The check of one BOS above means something: these tokenizers add BOS of their own when
    asked for special tokens, so a rendered template tokenized that way starts with two."""
    family = FAMILIES[name]
    tokenizer = family.tokenizer()
    text = render(CHAT, tokenizer, family.encoder(tokenizer).template, generation=False)
    bos_id = tokenizer.convert_tokens_to_ids(family.bos)
    assert tokenizer(text)["input_ids"][:2] == [bos_id, bos_id]


def test_gemma3_folds_the_system_message_into_the_first_user_turn():
    """Gemma-3 has no system turn: the system text opens the first user turn, unlabelled."""
    family = FAMILIES["gemma3"]
    tokenizer = family.tokenizer()
    example = check_masks(family, tokenizer, [SYSTEM, *CHAT])
    ids, mask = example["input_ids"].tolist(), example["loss_mask"].tolist()
    text = tokenizer.decode(ids)
    first_user = f"<start_of_turn>user\n{SYSTEM['content']}\n\n{CHAT[0]['content']}<end_of_turn>"
    assert text.startswith("<bos>" + first_user)
    assert "system" not in text
    unlabelled = tokenizer.decode([t for t, label in zip(ids, mask) if not label])
    assert SYSTEM["content"] in unlabelled


def test_llama3_labels_no_system_header_or_date():
    """Llama-3.1 writes a system header (knowledge and today's date) even without a system
    message: none of it, nor the assistant header, is a label."""
    family = FAMILIES["llama3"]
    tokenizer = family.tokenizer()
    example = check_masks(family, tokenizer, CHAT)
    ids, mask = example["input_ids"].tolist(), example["loss_mask"].tolist()
    labelled = tokenizer.decode([t for t, label in zip(ids, mask) if label])
    for header in ("Cutting Knowledge", "<|start_header_id|>", "assistant", "<|begin_of_text|>"):
        assert header not in labelled


@pytest.mark.integration
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_masks_with_the_embedded_smollm2_tokenizer(conversation):
    """The same checks with SmolLM2-135M-Instruct's real tokenizer (the embedded target's) and
    the template it ships with (the fixture is a copy of it)."""
    from heads.target import TargetConfig, load_tokenizer

    tokenizer = load_tokenizer("smollm2_135m", TargetConfig(name_or_path="tiny"))
    assert tokenizer.chat_template == (TEMPLATES / "smollm2.jinja").read_text(encoding="utf-8")
    check_masks(FAMILIES["smollm2"], tokenizer, CONVERSATIONS[conversation])
