"""Apply a tokenizer's chat template and mark which tokens are assistant tokens.

The loss mask is found without the template's ``{% generation %}`` markers (few templates have
them): each assistant turn ``i`` spans the characters between the render of ``messages[:i]``
with the generation prompt (which ends with the assistant header) and the render of
``messages[:i+1]``. The span is cut after its last special token, so it holds the assistant text
and its end-of-turn token (``<|im_end|>``) but neither the header nor template glue after it.
Tokens are then assigned to spans through the fast tokenizer's character offsets.

:class:`ChatEncoder` is the one way messages become token ids: training examples (with the
mask), self-distillation prompts and benchmark prompts (with the assistant header appended).
"""

from __future__ import annotations

from typing import Any

import torch

from data.errors import DraftsmithError
from data.formats import Conversation
from data.paths import resolve_path

# A plain ChatML template (no default system prompt), for targets whose tokenizer has none:
# set `data.chat_template: chatml` and make sure <|im_start|> / <|im_end|> are in the vocabulary.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(DraftsmithError, ValueError):
    """The chat template is missing or renders conversations in a way we cannot mask."""


def resolve_chat_template(tokenizer: Any, chat_template: str | None = None) -> str:
    """The template to use: ``chat_template`` ("chatml", Jinja text or a template file) if given,
    else the tokenizer's own. Raises :class:`ChatTemplateError` when there is none."""
    if chat_template:
        return template_text(chat_template)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # some tokenizers keep several named templates
        template = template.get("default")
    if not template:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ChatTemplateError(
            f"tokenizer {name!r} has no chat template; set `data.chat_template` to a Jinja "
            "template, a .jinja file, or 'chatml'"
        )
    return template


def template_text(chat_template: str) -> str:
    """The template named by ``chat_template``: "chatml", Jinja text (it has ``{{`` or ``{%``),
    or else the path of a template file (relative to the working directory or the repository).
    """
    if chat_template == "chatml":
        return CHATML_TEMPLATE
    if "{{" in chat_template or "{%" in chat_template:
        return chat_template
    path = resolve_path(chat_template)
    if path.is_dir():
        raise ChatTemplateError(
            f"chat template {chat_template!r} is a directory; give a template file in it (e.g. "
            "chat_template.jinja), Jinja template text, or 'chatml'"
        )
    if not path.is_file():
        raise ChatTemplateError(
            f"chat template file {chat_template!r} not found (tried from the working directory "
            "and the repository root) and it is not Jinja text (no {{ or {%); fix the path, or "
            "give the template text or 'chatml'"
        )
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise ChatTemplateError(
            f"chat template file {path}: not UTF-8 (byte 0x{e.object[e.start]:02x} at offset "
            f"{e.start}); save it as UTF-8"
        ) from None


def render(messages: Conversation, tokenizer: Any, template: str, generation: bool) -> str:
    """The template applied to ``messages`` as text (no tokenization)."""
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation, chat_template=template
    )


def special_token_strings(tokenizer: Any) -> list[str]:
    """All special-token strings (bos/eos/pad and added special tokens), longest first."""
    tokens = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(added, "special", False):
            tokens.add(str(added))
    return sorted((t for t in tokens if t), key=len, reverse=True)


def assistant_spans(
    messages: Conversation, tokenizer: Any, template: str
) -> tuple[str, list[tuple[int, int]]]:
    """Render the conversation; return the text and the ``[start, end)`` character span of each
    assistant turn (its content and end-of-turn token)."""
    text = render(messages, tokenizer, template, generation=False)
    specials = special_token_strings(tokenizer)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head = render(messages[:i], tokenizer, template, generation=True)
        upto = render(messages[: i + 1], tokenizer, template, generation=False)
        if not (upto.startswith(head) and text.startswith(upto)):
            raise ChatTemplateError(
                f"the chat template does not render turn {i} as a continuation of the turns "
                "before it (it rewrites earlier turns), so assistant tokens cannot be located; "
                "set `data.chat_template` to a template that renders turns incrementally"
            )
        spans.append((len(head), _cut_after_last_special(text, len(head), len(upto), specials)))
    return text, spans


def _cut_after_last_special(text: str, start: int, end: int, specials: list[str]) -> int:
    """End the span after its last special token (the end-of-turn token), if it has one."""
    best = -1
    for token in specials:
        found = text.rfind(token, start, end)
        if found >= 0:
            best = max(best, found + len(token))
    return best if best > start else end


class ChatEncoder:
    """Messages -> token ids through the chat template: the one place where training examples,
    self-distillation prompts and benchmark prompts are rendered and tokenised.

    The rendered template already holds BOS and the turn markers, so the tokenizer never adds
    special tokens of its own."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.template = resolve_chat_template(tokenizer, chat_template)

    def encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(self, messages: Conversation) -> list[int]:
        """Ids of ``messages`` followed by the assistant header: what generation continues."""
        return self.encode_text(render(messages, self.tokenizer, self.template, generation=True))

    def user_prefix(self, messages: Conversation, opening: str = "") -> list[int]:
        """Ids of ``messages`` followed by the opening of a new user turn (its header, then
        ``opening``, the first words of the request, if any): what a model continues with a
        user request of its own (data/synthesize.py).

        Found with any template by rendering a user turn holding a marker and cutting there."""
        marker = "\u2063DRAFTSMITH-USER-TURN\u2063"
        text = render(
            [*messages, {"role": "user", "content": marker}],
            self.tokenizer,
            self.template,
            generation=False,
        )
        cut = text.find(marker)
        if cut < 0:
            raise ChatTemplateError(
                "the chat template does not write a user message's text verbatim, so the start "
                "of a user turn cannot be found for prompt synthesis; set `data.chat_template` "
                "to one that does, or give prompt files instead of {synthesize: N}"
            )
        return self.encode_text(text[:cut] + opening)

    def example(self, messages: Conversation, max_length: int) -> dict[str, torch.Tensor] | None:
        """A training example, ``{"input_ids", "loss_mask"}`` (LongTensor[T], T <= max_length,
        the mask 1 exactly on assistant tokens), or None when truncation leaves no assistant
        token (the caller counts and drops it)."""
        text, spans = assistant_spans(messages, self.tokenizer, self.template)
        ids, mask = _tokenize_with_spans(text, spans, self.tokenizer)
        ids, mask = ids[:max_length], mask[:max_length]
        if not any(mask):
            return None
        return {
            "input_ids": torch.tensor(ids, dtype=torch.long),
            "loss_mask": torch.tensor(mask, dtype=torch.long),
        }


def tokenize_conversation(
    messages: Conversation, tokenizer: Any, max_length: int, chat_template: str | None = None
) -> dict[str, torch.Tensor] | None:
    """One conversation as a training example (see :meth:`ChatEncoder.example`)."""
    return ChatEncoder(tokenizer, chat_template).example(messages, max_length)


def _tokenize_with_spans(
    text: str, spans: list[tuple[int, int]], tokenizer: Any
) -> tuple[list[int], list[int]]:
    """Token ids of ``text`` and a 0/1 mask: 1 where a token starts inside an assistant span."""
    if getattr(tokenizer, "is_fast", False):
        # The template already holds BOS etc., so the tokenizer must not add its own.
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = [int(any(s <= start < e for s, e in spans)) for start, _ in enc["offset_mapping"]]
        return ids, mask
    # Slow tokenizers have no offsets: tokenize the pieces between span boundaries separately.
    ids, mask, pos = [], [], 0
    for start, end in [*spans, (len(text), len(text))]:
        for piece, label in ((text[pos:start], 0), (text[start:end], 1)):
            if piece:
                piece_ids = tokenizer.encode(piece, add_special_tokens=False)
                ids += piece_ids
                mask += [label] * len(piece_ids)
        pos = end
    return ids, mask
