"""Shared fixtures: tiny random targets (Llama and Qwen2) with a tiny ChatML tokenizer.

Everything is built in-process with fixed seeds: no downloads, seconds to run.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)

CHATML = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TINY_VOCAB = 256


def make_tokenizer(chat_template: str | None = CHATML):
    """A character-level fast tokenizer with ChatML specials (ids: pad 0, unk 1, start 2, end 3);
    the same one the GPU check saves (eval.bench.gpu_check.build_char_tokenizer)."""
    from eval.bench.gpu_check import build_char_tokenizer

    return build_char_tokenizer(chat_template)


def make_llama(seed: int = 0, hidden: int = 64, layers: int = 2, vocab: int = TINY_VOCAB):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=3,
        bos_token_id=2,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).eval()


def make_qwen2(seed: int = 0, hidden: int = 64, layers: int = 2, vocab: int = TINY_VOCAB):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=3,
        bos_token_id=2,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(cfg).eval()


def fit(head, batch, feats, optimizer, steps: int = 15):
    """(the loss before training, the last step's LossOutput) of `steps` optimizer steps of
    `head.loss` on one batch: the tests' "a loss that falls" loop."""
    first = head.loss(batch, feats).loss.item()
    for _ in range(steps):
        optimizer.zero_grad()
        out = head.loss(batch, feats)
        out.loss.backward()
        optimizer.step()
    return first, out


def diverse(model, std=0.4, seed=1):
    """Re-draw the weight matrices larger: at the default init a tiny model repeats one token."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, std)
    return model


@pytest.fixture
def tokenizer():
    return make_tokenizer()


@pytest.fixture
def tiny_llama(tokenizer):
    from heads.target import Target

    return Target.from_model(make_llama(), tokenizer, name_or_path="tiny-llama")


@pytest.fixture
def tiny_qwen2(tokenizer):
    from heads.target import Target

    return Target.from_model(make_qwen2(), tokenizer, name_or_path="tiny-qwen2")


@pytest.fixture(params=["llama", "qwen2"])
def tiny_target(request, tokenizer):
    from heads.target import Target

    model = make_llama() if request.param == "llama" else make_qwen2()
    return Target.from_model(model, tokenizer, name_or_path=f"tiny-{request.param}")
