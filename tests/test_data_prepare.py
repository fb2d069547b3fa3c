"""data/config.py and data/prepare.py: the typed data settings, their checks, and data preparation
without train/; data/chat.py's one prompt encoder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from data import ChatTemplateError, DataConfig, DataSource, SelfDistillSettings, prepare_data
from data.chat import ChatEncoder, tokenize_conversation
from data.errors import ConfigError
from data.prepare import token_budget

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"


def write_rows(path: Path, n: int) -> str:
    rows = [{"instruction": f"question {i}", "output": f"answer number {i}"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def compose_data(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides)).data


# ------------------------------------------------------------------------------ DataConfig


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sources": []}, "data.sources is empty: list at least one file"),
        ({"features": "ram"}, "data.features='ram': use one of memory, disk, online."),
        ({"feature_dtype": "fp8"}, "data.feature_dtype='fp8': use one of float16, bfloat16"),
        ({"feature_dtype": "int8"}, "data.feature_dtype=int8 needs data.features=disk"),
        ({"feature_autocast": "fp8"}, "feature_autocast='fp8': use null, fast_bfloat16 or one of"),
        ({"val_fraction": 1.0}, "data.val_fraction=1.0: use a share in [0, 1)"),
        ({"max_length": 0}, "data.max_length=0: give the tokens per conversation"),
        ({"max_train_tokens": -5}, "data.max_train_tokens=-5: use a count, or null."),
        ({"sources": [{"pth": "x.jsonl"}]}, "unexpected keyword argument 'pth'"),
        (
            {"self_distill": {"enabled": True, "prompts": ["p.jsonl"], "temperature": -1}},
            "data.self_distill.temperature=-1: use 0 (greedy) or > 0.",
        ),
        (
            {"self_distill": {"enabled": True, "prompts": [{"path": "p", "rows": 2}]}},
            "data.self_distill.prompts entry",
        ),
        (
            {"self_distill": {"enabled": True, "prompts": ["p.jsonl"], "dtype": "bf16"}},
            "data.self_distill.dtype='bf16': use one of float32, bfloat16, float16",
        ),
        (
            {
                "self_distill": {
                    "enabled": True,
                    "prompts": ["p.jsonl"],
                    "dtype": "bfloat16",
                    "backend": "llama_cpp",
                }
            },
            "data.self_distill.dtype applies to the hf backend",
        ),
    ],
)
def test_data_config_says_what_to_change(kwargs, message):
    with pytest.raises((ConfigError, TypeError)) as err:
        DataConfig(**{"sources": ["rows.jsonl"], **kwargs})
    assert message in str(err.value)


@pytest.mark.parametrize("fast", [True, False])
def test_fast_bfloat16_feature_autocast_picks_bf16_only_where_it_is_fast(monkeypatch, fast):
    import data.hardware

    monkeypatch.setattr(data.hardware, "cpu_has_fast_bf16", lambda: fast)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = DataConfig(sources=["rows.jsonl"], feature_autocast="fast_bfloat16")
    assert cfg.feature_autocast == ("bfloat16" if fast else None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU multiplies bf16 fast
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert DataConfig(sources=["r.jsonl"], feature_autocast="fast_bfloat16").feature_autocast == (
        "bfloat16"
    )


def test_data_config_reads_sources_and_self_distill_given_as_plain_values():
    cfg = DataConfig(
        sources=["a.jsonl", {"path": "b.json", "max_rows": 3}, DataSource("c.jsonl")],
        self_distill={"enabled": False},
    )
    assert [s.path for s in cfg.sources] == ["a.jsonl", "b.json", "c.jsonl"]
    assert cfg.sources[1].max_rows == 3 and isinstance(cfg.self_distill, SelfDistillSettings)
    assert DataConfig(self_distill={"enabled": True, "prompts": ["p.jsonl"]}).sources == []
    with pytest.raises(ChatTemplateError, match="'no/such.jinja' not found"):
        DataConfig(sources=["a.jsonl"], chat_template="no/such.jinja")


@pytest.mark.parametrize("group", sorted(p.stem for p in (CONF / "data").glob("*.yaml")))
def test_every_data_group_builds_a_data_config(group):
    cfg = instantiate(compose_data(f"data={group}"), _convert_="all")
    assert isinstance(cfg, DataConfig) and isinstance(cfg.self_distill, SelfDistillSettings)
    assert cfg.sources and all(isinstance(s, DataSource) for s in cfg.sources)


@pytest.mark.parametrize(
    "overrides, digest",
    [
        (["+experiment=medusa_tiny"], "efac016af7f7"),
        (["+experiment=eagle_llama"], "264eca5b9cc8"),
        (["+experiment=eagle_llama", "data=smollm2_distilled_full"], "c7eb394c630e"),
        # an int temperature keys apart from 0.0, as it did
        (
            [
                "+experiment=medusa_tiny",
                "data.self_distill.temperature=0",
                "data.self_distill.max_rows=6",
            ],
            "4b2bae787909",
        ),
    ],
)
def test_self_distilled_file_keeps_its_name(overrides, digest, monkeypatch, tmp_path):
    """The default output is named as before DataConfig existed, so earlier runs' generated
    answers are found again (digests computed with the code of that time)."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    cfg = instantiate(compose_data(*overrides), _convert_="all")
    out = Path(cfg.self_distill.default_out("0123456789abcdef"))
    assert out == tmp_path / "distill" / f"0123456789ab-{digest}.jsonl"
    # another generation dtype is another file
    cfg.self_distill.dtype = "bfloat16"
    assert Path(cfg.self_distill.default_out("0123456789abcdef")) != out


# ------------------------------------------------------------------------------ prepare_data


class TokenizerOnly:
    """prepare_data needs only the target's tokenizer when it does not self-distil."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer


def test_prepare_data_splits_and_cuts(tokenizer, tmp_path):
    path = write_rows(tmp_path / "rows.jsonl", 12)
    cfg = DataConfig(sources=[path], max_length=128, val_fraction=0.25, max_val_examples=2)
    data = prepare_data(cfg, TokenizerOnly(tokenizer))
    assert len(data.train) == 9 and len(data.val) == 2
    cut = prepare_data(
        DataConfig(sources=[path], max_length=128, max_train_examples=4, max_train_tokens=30),
        TokenizerOnly(tokenizer),
    )
    assert len(cut.train) <= 4 and sum(int(e["loss_mask"].sum()) for e in cut.train) == 30


def test_prepare_data_self_distils_with_the_ranks_it_is_given(tokenizer, tmp_path, monkeypatch):
    import data.distill

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    calls = []

    def fake_distill(target, cfg, rank, world, chat_template, barrier, progress):
        calls.append((cfg.out, rank, world, barrier, progress))
        write_rows(Path(cfg.out), 4)
        return {}

    monkeypatch.setattr(data.distill, "distill", fake_distill)
    target = TokenizerOnly(tokenizer)
    target.fingerprint = "fedcba9876543210"
    settings = {"enabled": True, "prompts": ["prompts.jsonl"], "out": None}
    (tmp_path / "distill").mkdir()
    cfg = DataConfig(sources=[], max_length=128, val_fraction=0, self_distill=settings)
    prepared = prepare_data(cfg, target, process_ranks=lambda: (1, 2, print))
    ((out, rank, world, barrier, progress),) = calls
    assert out == cfg.self_distill.default_out(target.fingerprint)
    assert (rank, world, barrier, progress) == (1, 2, print, False)
    assert len(prepared.train) == 4


def test_token_budget_keeps_the_first_examples_and_cuts_the_last():
    def example(answer: int) -> dict:
        mask = torch.tensor([0, 0] + [1] * answer + [0])
        return {"input_ids": torch.arange(len(mask)), "loss_mask": mask}

    examples = [example(4), example(5), example(6)]
    kept = token_budget(examples, 7)
    assert [int(e["loss_mask"].sum()) for e in kept] == [4, 3]
    assert kept[1]["loss_mask"].tolist() == [0, 0, 1, 1, 1, 0, 0, 0]  # the first 3 answer tokens
    assert examples[1]["loss_mask"].sum() == 5  # the input is not changed
    assert len(token_budget(examples, 100)) == 3


def test_preparing_data_imports_no_training_code():
    code = (
        "import sys, data.prepare, data.config\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('train', 'eval', 'heads'))\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


# ------------------------------------------------------------------------------ one encoder


def test_one_encoder_for_training_distillation_and_benchmark(tokenizer):
    from eval.bench.harness import encode_chat

    chat = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi there"},
        {"role": "user", "content": "and now?"},
    ]
    encoder = ChatEncoder(tokenizer)
    prompt = encoder.prompt(chat)
    assert encode_chat(tokenizer, chat).tolist() == [prompt]
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
    # the prompt is exactly the start of the training example that answers it
    answered = [*chat, {"role": "assistant", "content": "fine"}]
    example = tokenize_conversation(answered, tokenizer, max_length=10_000)
    assert example["input_ids"][: len(prompt)].tolist() == prompt
    assert example["loss_mask"][: len(prompt)].sum() == len("hi there") + 1  # and <|im_end|>
    assert ChatEncoder(tokenizer, "chatml").prompt(chat[:1]) != encoder.prompt(chat[:1])


def test_val_sources_fix_the_held_out_set(tmp_path):
    """data.val_sources: validation is exactly those conversations, whatever the training
    data; a training conversation equal to a held-out one is dropped from training."""
    from data.config import DataConfig
    from data.prepare import prepare_data
    from tests.conftest import make_tokenizer

    def conv(i):
        return {"messages": [{"role": "user", "content": f"q{i}"},
                             {"role": "assistant", "content": f"answer {i}"}]}  # fmt: skip

    train_file, val_file = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train_file.write_text("".join(json.dumps(conv(i)) + "\n" for i in range(10)))
    val_file.write_text("".join(json.dumps(conv(i)) + "\n" for i in (3, 20, 21)))

    class Target:
        tokenizer = make_tokenizer()

    cfg = DataConfig(sources=[str(train_file)], val_sources=[str(val_file)], max_val_examples=0)
    data = prepare_data(cfg, Target())
    assert len(data.val) == 3 and len(data.train) == 9  # q3 is held out, not trained on
    tok = Target.tokenizer
    texts = [tok.decode(e["input_ids"]) for e in data.val]
    assert ["q3" in texts[0], "q20" in texts[1], "q21" in texts[2]] == [True] * 3
    assert not any("q3<" in tok.decode(e["input_ids"]) for e in data.train)


def _write_convs(path, ids, answer="answer"):
    def row(i):
        return {"messages": [{"role": "user", "content": f"q{i}"},
                             {"role": "assistant", "content": f"{answer} {i}"}]}  # fmt: skip

    rows = [row(i) for i in ids]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_mix_sources_train_only_and_uncapped(tmp_path):
    """data.mix_sources join the training split after the split and the caps: validation and
    max_train_examples see only the main data, and a mixed conversation equal to a held-out one
    is dropped."""
    from data.config import DataConfig
    from data.prepare import prepare_data
    from tests.conftest import make_tokenizer

    main = _write_convs(tmp_path / "main.jsonl", range(20))
    mix = _write_convs(tmp_path / "mix.jsonl", (100, 200, 201, 202), answer="human")

    class Target:
        tokenizer = make_tokenizer()

    tok = Target.tokenizer
    plain = prepare_data(DataConfig(sources=[main], max_train_examples=5), Target())
    mixed = prepare_data(
        DataConfig(sources=[main], mix_sources=[mix], max_train_examples=5), Target()
    )
    assert [tok.decode(e["input_ids"]) for e in mixed.val] == [
        tok.decode(e["input_ids"]) for e in plain.val
    ]
    assert len(plain.train) == 5 and len(mixed.train) == 5 + 4
    assert sum("human 20" in tok.decode(e["input_ids"]) for e in mixed.train) == 3
    # a mixed conversation identical to a held-out one is not trained on
    held = prepare_data(
        DataConfig(sources=[main], val_sources=[mix], mix_sources=[mix], max_val_examples=0),
        Target(),
    )
    assert len(held.val) == 4 and len(held.train) == 20


def test_mix_sources_bad_entry_names_the_key():
    from data.config import DataConfig
    from data.errors import ConfigError

    with pytest.raises(ConfigError, match=r"data\.mix_sources\[0\]"):
        DataConfig(sources=["x.jsonl"], mix_sources=[3])


def test_data_source_skip(tmp_path):
    """DataSource.skip leaves out the first conversations; max_rows counts after it; a skip
    past the end is a one-line error naming the fix."""
    from data.dataset import DataSource, load_conversations
    from data.errors import ConfigError
    from data.json_files import DataFormatError

    path = _write_convs(tmp_path / "rows.jsonl", range(10))
    rows = load_conversations([DataSource(path, skip=3, max_rows=4)])
    assert [r[0]["content"] for r in rows] == ["q3", "q4", "q5", "q6"]
    assert len(load_conversations([DataSource(path, skip=8)])) == 2
    with pytest.raises(DataFormatError, match="lower `skip`"):
        load_conversations([DataSource(path, skip=10)])
    with pytest.raises(ConfigError, match="skip"):
        DataSource(path, skip=-1)
