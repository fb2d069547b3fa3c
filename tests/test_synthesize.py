"""Prompts written by the target (data/synthesize.py): filters, de-duplication, determinism,
resume, follow-up turns, sharding, the server backend, and the error without a chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from data.distill import DistillConfig, distill
from data.parts import read_rows
from data.synthesize import (
    BLOCK,
    Deduplicator,
    SynthesisSpec,
    candidates_path,
    reject_reason,
    select,
)
from tests._stand_in_server import openai_stand_in
from tests.conftest import make_llama, make_tokenizer


def writer_target(tokenizer=None, eos_bias: float = 2.5):
    """A tiny random Llama that writes printable characters and ends its turns after about six
    of them (a bias on EOS), so sampled user turns pass the (loosened) filters."""
    from heads.target import Target

    tokenizer = tokenizer or make_tokenizer()
    model = make_llama()
    weight = model.lm_head.weight.data
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=True)
    head.weight.data = weight.clone()
    head.bias.data.zero_()
    head.bias.data[len(tokenizer.get_vocab()) :] = -30  # ids the tokenizer cannot decode
    head.bias.data[:3] = -30  # pad, unk, <|im_start|>
    head.bias.data[3] = eos_bias  # <|im_end|>
    model.lm_head = head
    return Target.from_model(model, tokenizer, name_or_path="tiny-writer")


@pytest.fixture
def writer():
    return writer_target()


LOOSE = {"min_chars": 3, "min_words": 1, "max_new_tokens": 40}


def cfg_for(tmp_path: Path, synth: dict, **kw) -> DistillConfig:
    base = {"out": str(tmp_path / "sd.jsonl"), "max_new_tokens": 6, "batch_size": 4}
    return DistillConfig(prompts=[{"synthesize": synth}] if "synthesize" not in synth else [synth],
                         **(base | kw))  # fmt: skip


def rows_of(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


# ---- filters and de-duplication ---------------------------------------------------------------


def test_filters_name_each_reason():
    spec = SynthesisSpec(synthesize=1, min_chars=10, max_chars=60, min_words=3)
    ok = "How do I bake sourdough bread at home?"
    assert reject_reason(ok, "eos", spec) == ""
    assert reject_reason("   \n", "eos", spec) == "empty"
    assert reject_reason(ok, "length", spec) == "cut at max_new_tokens"
    assert reject_reason(ok, "eos", spec, special_ids=True) == "template markers"
    assert reject_reason("Why is the sky\x07 blue?", "eos", spec) == "non-printable characters"
    assert reject_reason("Hi there", "eos", spec) == "too short"
    assert reject_reason("Helloooooooo", "eos", spec) == "too short"  # one word
    assert reject_reason("word " * 20, "eos", spec) == "too long"
    looping = "tell me more about it " * 8
    assert reject_reason(looping, "eos", SynthesisSpec(synthesize=1)) == "repeated text"
    lines = "Write a poem.\nWrite a poem.\nWrite a poem."
    assert reject_reason(lines, "eos", SynthesisSpec(synthesize=1)) == "repeated text"


def test_dedup_refuses_exact_and_near_duplicates_only():
    dedup = Deduplicator(0.7)
    assert dedup.check("What is the capital of France?") == ""
    assert dedup.check("what is the CAPITAL of france") == "exact duplicate"
    long = "Can you explain how photosynthesis works in green plants and why it matters?"
    assert dedup.check(long) == ""
    near = "Can you explain how photosynthesis works in green plants and why it matters so much?"
    assert dedup.check(near) == "near duplicate"
    assert dedup.check("Explain how photosynthesis works.") == ""  # shares too little
    assert Deduplicator(1.0).check(near) == ""  # threshold 1.0 keeps near duplicates


def test_select_keeps_the_first_n_survivors_in_candidate_order():
    spec = SynthesisSpec(synthesize=2)
    rows = [
        {"i": 3, "text": "Tell me a story about dragons.", "reject": ""},
        {"i": 0, "text": "How do magnets work in motors?", "reject": ""},
        {"i": 1, "text": "x", "reject": "too short"},
        {"i": 2, "text": "how do magnets work in motors", "reject": ""},
        {"i": 4, "text": "What should I cook tonight?", "reject": ""},
    ]
    kept, reasons = select(rows, spec)
    assert [r["i"] for r in kept] == [0, 3]
    assert reasons == {"too short": 1, "exact duplicate": 1}


def test_top_k_bounds_hf_sampling_and_no_cut_files_keep_their_names(writer):
    """top_k reaches the HF sampler (top_k 1 samples the argmax: every row alike, where no cut
    samples rows apart), and a spec without a cut (top_k 0, as before top_k existed) keeps
    its candidate file name."""
    import hashlib

    from data.chat import ChatEncoder
    from data.engines.hf_generation import HFGenerator

    cfg = DistillConfig(prompts=["x"], out="o.jsonl", max_new_tokens=12, batch_size=8)
    gen = HFGenerator(writer, cfg, ChatEncoder(writer.tokenizer), [3])
    prefix = ChatEncoder(writer.tokenizer).user_prefix([])
    rows = {k: gen.generate([prefix] * 8, 0, temperature=1.0, top_p=1.0, top_k=k) for k in (0, 1)}
    assert len({tuple(ids) for ids, _ in rows[1]}) == 1
    assert len({tuple(ids) for ids, _ in rows[0]}) > 1
    assert SynthesisSpec(synthesize=4).top_k == 0
    old, new = SynthesisSpec(synthesize=4), SynthesisSpec(synthesize=4, top_k=50)
    fields = {k: v for k, v in old.__dict__.items() if k not in ("top_k", "openings")}
    legacy = hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:10]
    assert old.digest() == legacy != new.digest()


def test_spec_refuses_bad_settings_and_unknown_keys():
    from data.errors import ConfigError

    with pytest.raises(ConfigError, match="synthesize must be >= 1"):
        SynthesisSpec(synthesize=0)
    with pytest.raises(ConfigError, match="temperature must be > 0"):
        SynthesisSpec(synthesize=3, temperature=0)
    with pytest.raises(ConfigError, match="unknown keys \\['folow_ups'\\]"):
        DistillConfig(prompts=[{"synthesize": 3, "folow_ups": 1}], out="o.jsonl")


# ---- synthesis through distill -----------------------------------------------------------------


def test_synthesised_conversations_are_deterministic_for_a_seed(writer, tmp_path):
    synth = {"synthesize": 12, **LOOSE}
    runs = []
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        (tmp_path / name).mkdir()
        cfg = cfg_for(tmp_path / name, synth | {"seed": seed})
        stats = distill(writer, cfg, progress=False)
        assert stats["rows"] == 12
        runs.append(rows_of(cfg.out))
    a, b, c = runs
    assert [r["messages"] for r in a] == [r["messages"] for r in b]
    assert [r["messages"][0] for r in a] != [r["messages"][0] for r in c]
    users = [r["messages"][0]["content"] for r in a]
    assert len(set(users)) == 12 and all(len(u) >= 3 for u in users)
    # the conversation opens with the user turn the target wrote (the template's own system)
    assert [m["role"] for m in a[0]["messages"]] == ["user", "assistant"]
    assert [r["id"] for r in a] == [f"synth/{r['prompt_id']}/0" for r in a]


def test_user_turn_is_sampled_after_the_templates_user_header(writer):
    from data.chat import ChatEncoder

    enc = ChatEncoder(writer.tokenizer)
    text = writer.tokenizer.decode(enc.user_prefix([]))
    assert text == "<|im_start|>system\nYou are a tiny test model.<|im_end|>\n<|im_start|>user\n"
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    text = writer.tokenizer.decode(enc.user_prefix(history))
    assert text.endswith("<|im_start|>assistant\nYo<|im_end|>\n<|im_start|>user\n")


def test_resume_after_a_kill_gives_the_uninterrupted_result(writer, tmp_path, monkeypatch):
    import data.synthesize as synthesize_mod

    synth = {"synthesize": 40, **LOOSE}  # 40 kept needs two blocks of 32 candidates
    (tmp_path / "whole").mkdir()
    whole = cfg_for(tmp_path / "whole", synth)
    distill(writer, whole, progress=False)

    (tmp_path / "cut").mkdir()
    cut = cfg_for(tmp_path / "cut", synth)
    real_append, calls = synthesize_mod.append_rows, []

    def die_on_second_block(path, rows):
        calls.append(path)
        if len(calls) == 2:  # the first block of candidates was written, not the second
            raise KeyboardInterrupt
        real_append(path, rows)

    monkeypatch.setattr(synthesize_mod, "append_rows", die_on_second_block)
    with pytest.raises(KeyboardInterrupt):
        distill(writer, cut, progress=False)
    monkeypatch.setattr(synthesize_mod, "append_rows", real_append)
    spec = SynthesisSpec(**synth)
    written = list(read_rows(candidates_path(Path(cut.out), spec)))
    assert len(written) == BLOCK and not Path(cut.out).exists()
    distill(writer, cut, progress=False)
    got, want = rows_of(cut.out), rows_of(whole.out)
    assert [r["id"] for r in got] == [r["id"] for r in want]
    assert [r["messages"] for r in got] == [r["messages"] for r in want]
    assert len({r["id"] for r in got}) == 40
    cands = [r["i"] for r in read_rows(candidates_path(Path(cut.out), spec))]
    assert cands == list(range(len(cands)))  # every candidate once, none lost


def test_follow_ups_make_multi_turn_conversations(writer, tmp_path):
    cfg = cfg_for(tmp_path, {"synthesize": 8, "follow_ups": 2, **LOOSE})
    distill(writer, cfg, progress=False)
    rows = rows_of(cfg.out)
    assert len(rows) == 8
    lengths = [len(r["messages"]) for r in rows]
    assert max(lengths) == 6 and min(lengths) >= 2  # up to 3 user turns, each answered
    for r in rows:
        roles = [m["role"] for m in r["messages"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2)
        assert len(r["finish"]) == len(roles) // 2


def test_system_message_opens_every_conversation(writer, tmp_path):
    cfg = cfg_for(tmp_path, {"synthesize": 3, "system": "Be brief.", **LOOSE})
    distill(writer, cfg, progress=False)
    for r in rows_of(cfg.out):
        assert r["messages"][0] == {"role": "system", "content": "Be brief."}
        assert r["messages"][1]["role"] == "user"


def test_openings_start_each_first_turn_in_candidate_order(writer, tmp_path):
    openings = ["Write a function", "Solve:"]
    cfg = cfg_for(tmp_path, {"synthesize": 6, "openings": openings, "follow_ups": 1, **LOOSE})
    distill(writer, cfg, progress=False)
    rows = rows_of(cfg.out)
    assert len(rows) == 6
    for r in rows:  # candidate i continues openings[i % 2]; the opening stays in the prompt
        first = r["messages"][0]["content"]
        assert first.startswith(openings[int(r["prompt_id"]) % 2])
        assert len(first) > len(openings[int(r["prompt_id"]) % 2])  # the target wrote more
    # without openings the same seed writes other first turns
    (tmp_path / "free").mkdir()
    free = cfg_for(tmp_path / "free", {"synthesize": 6, "follow_ups": 1, **LOOSE})
    distill(writer, free, progress=False)
    assert not all(
        r["messages"][0]["content"].startswith(("Write a", "Solve")) for r in rows_of(free.out)
    )


def test_user_prefix_ends_with_the_opening(writer):
    from data.chat import ChatEncoder

    enc = ChatEncoder(writer.tokenizer)
    text = writer.tokenizer.decode(enc.user_prefix([], "Solve this"))
    assert text.endswith("<|im_start|>user\nSolve this")
    assert enc.user_prefix([], "") == enc.user_prefix([])


def test_openings_are_checked_and_old_candidate_files_keep_their_names():
    from data.errors import ConfigError

    with pytest.raises(ConfigError, match="openings must be a non-empty list"):
        SynthesisSpec(synthesize=3, openings=[])
    for bad, k in (([""], 0), (["ok", "  "], 1), (["ok", {"A puzzle": None}], 1)):
        with pytest.raises(ConfigError, match=f"openings\\[{k}\\]=.* quote an opening"):
            SynthesisSpec(synthesize=3, openings=bad)
    # digests (candidate file names) of specs written before `openings` existed are unchanged
    assert SynthesisSpec(synthesize=3).digest() == "a5831f5944"
    assert SynthesisSpec(synthesize=160, follow_ups=1).digest() == "602f439be1"
    steered = SynthesisSpec(synthesize=3, openings=["Solve"])
    assert steered.digest() != SynthesisSpec(synthesize=3).digest()
    assert steered.digest() != SynthesisSpec(synthesize=3, openings=["Write"]).digest()
    assert [steered.opening(i) for i in range(2)] == ["Solve", "Solve"]
    assert SynthesisSpec(synthesize=3).opening(4) == ""


def test_changed_synthesis_settings_are_refused_for_the_same_output(writer, tmp_path):
    distill(writer, cfg_for(tmp_path, {"synthesize": 3, **LOOSE}), progress=False)
    with pytest.raises(ValueError, match="settings"):
        distill(writer, cfg_for(tmp_path, {"synthesize": 3, "seed": 5, **LOOSE}), progress=False)


def test_a_target_without_a_chat_template_gets_a_clear_error(tmp_path):
    from data.chat import ChatTemplateError

    target = writer_target(make_tokenizer(chat_template=None))
    with pytest.raises(ChatTemplateError, match="no chat template.*data.chat_template"):
        distill(target, cfg_for(tmp_path, {"synthesize": 3, **LOOSE}), progress=False)
    # with a template given, it works
    cfg = cfg_for(tmp_path, {"synthesize": 3, **LOOSE})
    distill(target, cfg, chat_template="chatml", progress=False)
    assert len(rows_of(cfg.out)) == 3


def test_synthesis_through_a_stand_in_openai_server(tiny_llama, tmp_path):
    """The server backend samples user turns from the rendered user header (temperature and
    top_p of the spec), answers them greedily, and filters what the server writes."""
    questions = ["How do tides work?", "how do tides work", "Name three rivers in Asia.",
                 "ok", "What is a prime number?", "Suggest a name for a cat."]  # fmt: skip

    def answer(body):
        if body["prompt"].endswith("<|im_start|>user\n"):
            return questions[body["seed"] % len(questions)]
        return "Sure, here it is."

    with openai_stand_in(answer) as (url, seen):
        cfg = cfg_for(tmp_path, {"synthesize": 4, "top_p": 0.9, "top_k": 50}, backend="openai",
                      server_url=url, parallel=2)  # fmt: skip
        distill(tiny_llama, cfg, progress=False)
    rows = rows_of(cfg.out)
    users = sorted(r["messages"][0]["content"] for r in rows)
    assert users == sorted(q for q in questions if q not in ("ok", "how do tides work"))
    asks = [b for b in seen if b["prompt"].endswith("<|im_start|>user\n")]
    assert len(asks) == BLOCK and all(b["temperature"] == 1.0 and b["top_p"] == 0.9 for b in asks)
    # the spec's top_k bounds the sampled turns; greedy answers send none
    assert all(b["top_k"] == 50 for b in asks)
    answers = [b for b in seen if not b["prompt"].endswith("<|im_start|>user\n")]
    assert len(answers) == 4 and all(b["temperature"] == 0.0 and "top_k" not in b for b in answers)


@pytest.mark.integration
def test_sharded_synthesis_under_accelerate_launch(tmp_path):
    """Two CPU processes: each writes its own blocks of candidates; the kept prompts and the
    conversations equal one process's (the same seed), every key once, part files merged."""
    import os
    import subprocess
    import sys

    from tests.test_multiprocess import REPO, free_port

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}  # fmt: skip
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
              "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no", "--main_process_port", str(free_port())]  # fmt: skip
    outs = {}
    for name, prefix in (("two", launch), ("one", [sys.executable])):
        out = tmp_path / name / "sd.jsonl"
        out.parent.mkdir()
        proc = subprocess.run(
            [*prefix, "tests/_synth_mp_script.py", str(out)],
            env=env, capture_output=True, text=True, timeout=300, cwd=REPO,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        outs[name] = out
    two, one = rows_of(outs["two"]), rows_of(outs["one"])
    assert len(two) == 40 and len({r["id"] for r in two}) == 40
    assert not list((tmp_path / "two").glob("*.rank*"))
    assert sorted(r["id"] for r in two) == sorted(r["id"] for r in one)
    first = {r["id"]: r["messages"][0] for r in one}  # the sampled user turn
    assert all(r["messages"][0] == first[r["id"]] for r in two)


def test_data_config_takes_a_synthesis_entry():
    from data.config import SelfDistillSettings

    settings = SelfDistillSettings(enabled=True, prompts=[{"synthesize": 5, "follow_ups": 1}])
    cfg = settings.distill_config("o.jsonl")
    assert cfg.settings()["synthesize"][0]["follow_ups"] == 1
    other = SelfDistillSettings(enabled=True, prompts=[{"synthesize": 6, "follow_ups": 1}])
    assert settings.default_out("f" * 16) != other.default_out("f" * 16)

    steered = SelfDistillSettings(enabled=True, prompts=[{"synthesize": 5, "openings": ["Solve"]}])
    assert steered.distill_config("o.jsonl").settings()["synthesize"][0]["openings"] == ["Solve"]
    assert steered.default_out("f" * 16) != settings.default_out("f" * 16)


@pytest.mark.parametrize(
    ("data", "count", "corpus_entries"),
    [("smollm2_corpus_tasks", 160, 3), ("smollm2_corpus_steered", 100, 2)],
)
def test_the_steered_data_configs_compose_with_their_openings(data, count, corpus_entries):
    from hydra import compose, initialize_config_dir

    from data.synthesize import synthesis_spec

    conf = Path(__file__).resolve().parent.parent / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("config", ["+experiment=eagle3_llama", f"data={data}"])
    prompts = cfg.data.self_distill.prompts
    entries = [p for p in prompts if "synthesize" in p]
    assert len(entries) == 1 and len(prompts) - 1 == corpus_entries
    spec = synthesis_spec(dict(entries[0]))  # the openings file is read here
    assert spec.synthesize == count and spec.follow_ups == 1 and len(spec.openings) == 40
    assert len(set(spec.openings)) == 40 and spec.openings[:2] == [
        "Write a Python function",
        "Solve",
    ]
    # the file holds the list the tasks config held inline: its candidate files keep their name
    assert SynthesisSpec(
        synthesize=160, name="tasks", follow_ups=1, openings=spec.openings
    ).digest() == ("dea6a61fde")


def test_openings_can_be_read_from_a_file(tmp_path):
    from data.errors import ConfigError

    listed = tmp_path / "openings.txt"
    listed.write_text("# kinds of request\n\nSolve\n  Write a poem  \n# done\n", encoding="utf-8")
    from_file = SynthesisSpec(synthesize=3, openings=str(listed))
    assert from_file.openings == ["Solve", "Write a poem"]  # comments and blanks skipped, stripped
    assert (
        from_file.digest()
        == SynthesisSpec(synthesize=3, openings=["Solve", "Write a poem"]).digest()
    )
    with pytest.raises(ConfigError, match="openings file .*missing.txt' not found"):
        SynthesisSpec(synthesize=3, openings=str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("# nothing\n\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="lists no openings"):
        SynthesisSpec(synthesize=3, openings=str(tmp_path / "empty.txt"))


def test_writer_target_is_not_degenerate(writer):
    """The fixture's guard: its sampled turns are printable text that usually ends."""
    from data.chat import ChatEncoder
    from data.engines.hf_generation import HFGenerator

    cfg = DistillConfig(prompts=["x"], out="o.jsonl", max_new_tokens=40, batch_size=8)
    gen = HFGenerator(writer, cfg, ChatEncoder(writer.tokenizer), [3])
    prefix = ChatEncoder(writer.tokenizer).user_prefix([])
    torch.manual_seed(0)
    answers = gen.generate([prefix] * 8, 0, temperature=1.0, top_p=1.0)
    assert sum(why == "eos" for _, why in answers) >= 6


def test_synthesis_logs_where_it_stands_before_each_round_of_blocks(writer, tmp_path, caplog):
    """A block of candidates takes minutes at 1.5B on a CPU: the log says how many prompts are
    kept so far before each round, so a user sees the step move."""
    caplog.set_level("INFO", logger="data.synthesize")
    distill(writer, cfg_for(tmp_path, {"synthesize": 3, **LOOSE}), progress=False)
    rounds = [r.getMessage() for r in caplog.records if "more blocks" in r.getMessage()]
    assert rounds and rounds[0].startswith("synthesis synth: 0 of 3 prompts kept from 0 candidates")
    assert any("kept 3 of" in r.getMessage() for r in caplog.records)
    blocks = [r.getMessage() for r in caplog.records if " written, " in r.getMessage()]
    assert blocks and blocks[0].startswith("synthesis synth: block 1 of ")


def test_a_synthesis_name_taken_by_an_earlier_source_fails_before_any_generation(tmp_path):
    """The clash used to surface after the synthesis had run (12 minutes at 1.5B)."""
    code = tmp_path / "code.jsonl"
    code.write_text('{"id": "a", "prompt": "hi"}\n')
    twice = [{"path": str(code)}, {"synthesize": 4, "name": "code"}]  # as conf/data writes it
    with pytest.raises(ValueError, match="two prompt sources are named 'code'"):
        DistillConfig(prompts=twice, out=str(tmp_path / "o.jsonl"))
    # another name, or the file after the synthesis (it is renamed), is fine
    DistillConfig(prompts=[twice[0], {"synthesize": 4, "name": "written"}],
                  out=str(tmp_path / "o.jsonl"))  # fmt: skip
    DistillConfig(prompts=twice[::-1], out=str(tmp_path / "o.jsonl"))
