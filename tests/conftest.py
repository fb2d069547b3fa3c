"""Shared fixtures: tiny random targets (Llama and Qwen2) with a tiny ChatML tokenizer.

Everything is built in-process with fixed seeds: no downloads, seconds to run.
"""

from __future__ import annotations

import os
from pathlib import Path

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


def save_tiny_hf_model(
    folder: Path, family: str = "llama", *, layers: int = 2, std: float | None = None, **config
) -> Path:
    """A random model of `family` (hidden 64, seed 0) with SmolLM2's tokenizer (the embedded
    target's, so llama.cpp's converter knows its pre-tokenizer), both saved to `folder` as a
    Hugging Face folder. `std`: redraw every weight matrix from N(0, std), so greedy answers vary
    with the context instead of repeating one token; `config`: more HF config keys, or others."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from heads.target import TargetConfig, load_tokenizer

    tokenizer = load_tokenizer("smollm2_135m", TargetConfig(name_or_path="smollm2_135m"))
    settings = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        **config,
    }
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **settings)).eval()
    if std is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 2:
                    p.normal_(0.0, std)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)


def train_tiny_draft(
    experiment: str, target_dir: Path, answers: Path, run_dir: Path, steps: int, head: list[str]
):
    """(config, train.run's result): `experiment` on the saved target in `target_dir`, trained
    `steps` steps (lr 3e-3, seed 0) on the target's own greedy answers to 32 prompts (written once
    to `answers`, then reused), features in memory, no validation, checkpoints or logging.
    `head`: the head's overrides."""
    from hydra import compose, initialize_config_dir

    from train.run import run

    overrides = [
        f"+experiment={experiment}",
        f"model.name_or_path={target_dir}",
        "model.random_init=null",
        "model.tokenizer=null",
        *head,
        "data.sources=[]",
        "+data.self_distill={enabled: true, prompts: [{path: data/corpora/oa_prompts_en/"
        "prompts.jsonl, skip: 16, max_rows: 32}], max_new_tokens: 48, batch_size: 8, "
        f"out: {answers}}}",
        "data.features=memory",
        f"trainer.max_steps={steps}",
        "trainer.lr=3e-3",
        "trainer.eval_every=0",
        "trainer.save_every=0",
        "evaluators=[]",
        "trainer.best_metric=null",
        "logger.mode=disabled",
    ]
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    torch.manual_seed(0)
    return cfg, run(cfg, run_dir=run_dir)


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
