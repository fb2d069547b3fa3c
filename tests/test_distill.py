"""Self-distillation (data/distill.py): answers, multi-turn replay, resume, ranks, refusals."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from data import normalize_row
from data.chat import ChatEncoder
from data.distill import DistillConfig, distill, done_keys
from data.engines.hf_generation import HFGenerator
from data.errors import ConfigError
from data.parts import repair_tail
from data.paths import sole_writer
from data.row_checks import RowSkipped
from eval.engine.generator import plain_greedy

ROWS = [
    {"id": "a", "turns": ["Hi there", "And then?"]},
    {"id": "b", "prompt": "Name a colour."},
    {"id": "c", "turns": ["One", "Two", "Three"]},
    {"id": "d", "instruction": "Add 2 and 2.", "input": "quickly"},
    {"id": "e", "prompt": "Tell me about cats"},
]


def write_prompts(path: Path, rows=ROWS) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def config(tmp_path: Path, **kw) -> DistillConfig:
    prompts = kw.pop("prompts", None) or [write_prompts(tmp_path / "prompts.jsonl")]
    base = {"out": str(tmp_path / "sd.jsonl"), "max_new_tokens": 6, "batch_size": 2}
    return DistillConfig(prompts=prompts, **(base | kw))


def rows_of(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_every_turn_is_the_targets_answer(tiny_llama, tmp_path):
    cfg = config(tmp_path)
    stats = distill(tiny_llama, cfg, progress=False)
    rows = rows_of(cfg.out)
    assert [r["id"] for r in rows] == [f"prompts/{k}/0" for k in "abcde"]
    assert stats["rows"] == 5 and stats["new_tokens"] > 0 and stats["tokens_per_s"] > 0
    tok = tiny_llama.tokenizer
    for row, src in zip(rows, ROWS):
        users = [m["content"] for m in row["messages"] if m["role"] == "user"]
        turns = src.get("turns") or [src.get("prompt") or f"{src['instruction']}\n\n{src['input']}"]
        assert users == turns
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["user", "assistant"] * len(turns)
        assert len(row["finish"]) == len(turns)
        # batched with left padding == the same conversation decoded alone, turn by turn
        for t in range(len(turns)):
            history = row["messages"][: 2 * t + 1]
            text = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
            alone = plain_greedy(tiny_llama.model, ids, 6, eos_token_id=3).new_tokens.tolist()
            alone = alone[:-1] if alone and alone[-1] == 3 else alone
            assert row["messages"][2 * t + 1]["content"] == tok.decode(
                alone, skip_special_tokens=True
            )
    meta = json.loads((tmp_path / "sd.jsonl.meta.json").read_text())
    assert meta["target_fingerprint"] == tiny_llama.fingerprint
    assert meta["settings"]["max_new_tokens"] == 6 and meta["settings"]["temperature"] == 0
    # the output is training data as it stands; an answer that decodes to no text (this tiny
    # target's vocabulary is wider than its tokenizer's) is left out by the loader, not trained on
    for row in rows:
        if all(m["content"].strip() for m in row["messages"][1::2]):
            assert normalize_row(row, row["id"]) == row["messages"]
        else:
            with pytest.raises(RowSkipped, match="empty assistant answer"):
                normalize_row(row, row["id"])


def test_eos_cuts_the_answer(tiny_llama, monkeypatch):
    cfg = DistillConfig(prompts=["x"], out="o.jsonl", max_new_tokens=4)
    gen = HFGenerator(tiny_llama, cfg, ChatEncoder(tiny_llama.tokenizer), [3])
    prompt = [[5, 6, 7], [8, 9]]

    def fake_generate(ids, attention_mask, generation_config):
        # shortest prompt first (length-sorted batches), left padded
        assert ids[0, 0] == gen.pad and attention_mask[0].tolist() == [0, 1, 1]
        assert ids[1].tolist() == [5, 6, 7]
        new = torch.tensor([[13, 14, 15, 16], [10, 3, 11, 12]])
        return torch.cat([ids, new], dim=1)

    monkeypatch.setattr(tiny_llama.model, "generate", fake_generate)
    # answers come back in the prompts' order
    assert gen.generate(prompt, seed=0) == [([10], "eos"), ([13, 14, 15, 16], "length")]


def test_a_killed_run_resumes_without_loss_or_duplicates(tiny_llama, tmp_path, monkeypatch):
    (tmp_path / "whole").mkdir()
    # batch 1: chunks of 4 conversations (4 batches, length-sorted), so 5 prompts take two
    whole = config(tmp_path / "whole", batch_size=1)
    distill(tiny_llama, whole, progress=False)
    expected = {r["id"]: r["messages"] for r in rows_of(whole.out)}

    cfg = config(tmp_path, batch_size=1)
    calls = {"n": 0}
    real = HFGenerator.generate

    def dies_on_the_fourth_call(self, prompts, seed):
        calls["n"] += 1
        if calls["n"] == 4:  # the second chunk (the first took 3 turns)
            raise KeyboardInterrupt
        return real(self, prompts, seed)

    monkeypatch.setattr(HFGenerator, "generate", dies_on_the_fourth_call)
    with pytest.raises(KeyboardInterrupt):
        distill(tiny_llama, cfg, progress=False)
    monkeypatch.setattr(HFGenerator, "generate", real)
    first = rows_of(cfg.out)
    assert [r["id"] for r in first] == [f"prompts/{k}/0" for k in "abcd"]  # the first chunk
    with open(cfg.out, "a") as f:  # and a kill in the middle of writing a line
        f.write('{"id": "prompts/e/0", "messa')
    stats = distill(tiny_llama, cfg, progress=False)
    assert stats["rows"] == 1
    rows = rows_of(cfg.out)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == 5
    assert {r["id"]: r["messages"] for r in rows} == expected  # greedy: the same text
    assert distill(tiny_llama, cfg, progress=False)["rows"] == 0  # nothing left to do


def test_a_second_writer_is_refused_and_loses_nothing(tiny_llama, tmp_path):
    cfg = config(tmp_path)
    with sole_writer(Path(cfg.out)):  # as if another run were appending to the same file
        with pytest.raises(ConfigError, match="another process is writing .*sd.jsonl"):
            distill(tiny_llama, cfg, progress=False)
    assert not Path(cfg.out).exists() or rows_of(cfg.out) == []
    assert distill(tiny_llama, cfg, progress=False)["rows"] == 5  # the lock went with the block
    assert len(rows_of(cfg.out)) == 5
    assert not list(tmp_path.glob(".*.lock"))  # no lock file left behind


def test_another_dtype_generates_on_a_cast_copy(tiny_llama, tmp_path):
    """distill.dtype: the hf backend generates on a copy cast to that dtype, the target keeps its
    weights, and the answers are that copy's own greedy answers."""
    assert HFGenerator(tiny_llama, config(tmp_path), None, [3]).model is tiny_llama.model
    gen = HFGenerator(tiny_llama, config(tmp_path, dtype="bfloat16"), None, [3])
    assert gen.model is not tiny_llama.model and gen.model.dtype == torch.bfloat16
    gen.__exit__(None, None, None)
    assert gen.model is None  # the copy is let go when generation ends

    cfg = config(tmp_path, dtype="bfloat16", batch_size=1)
    distill(tiny_llama, cfg, progress=False)
    assert {p.dtype for p in tiny_llama.model.parameters()} == {torch.float32}
    meta = json.loads((tmp_path / "sd.jsonl.meta.json").read_text())
    assert meta["settings"]["dtype"] == "bfloat16"
    bf16 = copy.deepcopy(tiny_llama.model).to(torch.bfloat16)
    tok = tiny_llama.tokenizer
    for row in rows_of(cfg.out):
        history = row["messages"][:1]
        text = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
        new = plain_greedy(bf16, ids, 6, eos_token_id=3).new_tokens.tolist()
        new = new[:-1] if new and new[-1] == 3 else new
        assert row["messages"][1]["content"] == tok.decode(new, skip_special_tokens=True)
    # a file is never continued in another dtype
    with pytest.raises(ValueError, match="settings.*data.self_distill.out"):
        distill(tiny_llama, config(tmp_path, batch_size=1), progress=False)


def test_other_settings_or_target_are_refused(tiny_llama, tiny_qwen2, tmp_path):
    distill(tiny_llama, config(tmp_path), progress=False)
    with pytest.raises(ValueError, match="max_new_tokens.*data.self_distill.out"):
        distill(tiny_llama, config(tmp_path, max_new_tokens=7), progress=False)
    with pytest.raises(ValueError, match="target_fingerprint"):
        distill(tiny_qwen2, config(tmp_path), progress=False)


def test_ranks_write_parts_that_rank0_merges(tiny_llama, tmp_path):
    cfg = config(tmp_path)
    one = distill(tiny_llama, cfg, rank=1, world_size=2, progress=False)
    part = tmp_path / "sd.jsonl.rank1.jsonl"
    assert one["rows"] == 2 and len(rows_of(part)) == 2  # items 1 and 3 of 5
    zero = distill(tiny_llama, cfg, rank=0, world_size=2, progress=False)
    assert zero["rows"] == 3 and not part.exists()
    ids = sorted(r["id"] for r in rows_of(cfg.out))
    assert ids == sorted(f"prompts/{k}/0" for k in "abcde")
    assert distill(tiny_llama, cfg, progress=False)["rows"] == 0  # another world size: done


def test_long_prompts_end_the_conversation_or_are_skipped(tiny_llama, tmp_path):
    rows = [{"id": "short", "turns": ["Hi", "x" * 300]}, {"id": "long", "prompt": "y" * 400}]
    cfg = config(tmp_path, prompts=[write_prompts(tmp_path / "p.jsonl", rows)])
    cfg.max_prompt_tokens = 200
    stats = distill(tiny_llama, cfg, progress=False)
    assert stats["rows"] == 1 and stats["skipped"] == 1
    (row,) = rows_of(cfg.out)
    assert row["id"] == "p/short/0" and len(row["messages"]) == 2  # the 2nd turn did not fit
    (skip,) = rows_of(tmp_path / "sd.jsonl.skipped.jsonl")
    assert skip["id"] == "p/long/0" and "max_prompt_tokens" in skip["reason"]
    assert done_keys(Path(cfg.out)) == {"p/short/0", "p/long/0"}  # a rerun skips both


def test_sampling_writes_several_answers_per_prompt(tiny_llama, tmp_path):
    cfg = config(tmp_path, temperature=1.0, num_samples=2, max_rows=2, max_new_tokens=8)
    distill(tiny_llama, cfg, progress=False)
    rows = rows_of(cfg.out)
    assert [r["id"] for r in rows] == ["prompts/a/0", "prompts/a/1", "prompts/b/0", "prompts/b/1"]
    answers = [r["messages"][1]["content"] for r in rows]
    assert answers[0] != answers[1] or answers[2] != answers[3]  # samples differ
    with pytest.raises(ValueError, match="temperature"):
        DistillConfig(prompts=["p"], out="o", num_samples=2)


def test_repair_tail(tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_text('{"id": 1}\n{"id": 2}\n{"id"')
    assert repair_tail(path) == 5
    assert path.read_text() == '{"id": 1}\n{"id": 2}\n'
    assert repair_tail(path) == 0


@pytest.mark.integration
def test_accelerate_launch_two_processes_then_resume(tmp_path):
    """scripts/self_distill.py under `accelerate launch` with 2 CPU processes (tiny random Llama
    with SmolLM2's tokenizer): every prompt once, parts merged; a rerun finds nothing to do."""
    import os
    import subprocess
    import sys

    from tests.test_multiprocess import REPO, free_port

    prompts = write_prompts(tmp_path / "prompts.jsonl")
    out = tmp_path / "sd.jsonl"
    args = ["scripts/self_distill.py", "model=tiny_random_llama", f"distill.prompts=[{prompts}]",
            f"distill.out={out}", "distill.max_new_tokens=4", "distill.batch_size=2",
            f"hydra.run.dir={tmp_path / 'hydra'}"]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}  # fmt: skip
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
              "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no", "--main_process_port", str(free_port())]  # fmt: skip
    proc = subprocess.run(
        [*launch, *args], env=env, capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    ids = [r["id"] for r in rows_of(out)]
    assert sorted(ids) == sorted(f"prompts/{k}/0" for k in "abcde")
    assert not list(tmp_path.glob("sd.jsonl.rank*"))
    proc = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "0 to go" in proc.stderr + proc.stdout
    assert [r["id"] for r in rows_of(out)] == ids


def test_training_on_self_distilled_data_generates_once(tmp_path):
    """data.self_distill.enabled: train.run regenerates the answers first, then reuses them."""
    from hydra import compose, initialize_config_dir

    from tests.test_experiments import CONF
    from train.run import run

    out = tmp_path / "sd.jsonl"
    overrides = ["+experiment=medusa_tiny", "trainer.max_steps=2", "trainer.eval_every=0",
                 "logger.mode=disabled", "data.self_distill.enabled=true",
                 "data.self_distill.max_rows=6", "data.self_distill.max_new_tokens=8",
                 # sampled: this random target's greedy answers are only newlines, which the
                 # loader skips as empty
                 "data.self_distill.temperature=1.0",
                 f"data.self_distill.out={out}", "data.max_val_examples=2",
                 "evaluators=[]"]  # fmt: skip
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    result = run(cfg, run_dir=tmp_path / "run")
    assert result.step == 2
    rows = rows_of(out)
    assert len(rows) == 12  # 6 prompts from each of the two default sources
    assert all(r["messages"][1]["role"] == "assistant" for r in rows)
    before = out.read_bytes()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        again = compose("config", overrides=[*overrides, "trainer.max_steps=3"])
    run(again, run_dir=tmp_path / "run2")
    assert out.read_bytes() == before  # reused, nothing generated twice


def test_prompt_entries_take_a_slice_of_their_source(tmp_path):
    from data.distill_work import work_items

    path = write_prompts(tmp_path / "prompts.jsonl")
    other = write_prompts(tmp_path / "other.jsonl")
    cfg = config(tmp_path, prompts=[{"path": path, "skip": 1, "max_rows": 2}, other], max_rows=3)
    keys = [item.key for item in work_items(cfg)]
    # the mapping's own max_rows wins over the global one; a bare path takes the global max_rows
    assert keys == ["prompts/b/0", "prompts/c/0", "other/a/0", "other/b/0", "other/c/0"]
    with pytest.raises(ValueError, match="unknown keys: \\['rows'\\]"):
        config(tmp_path, prompts=[{"path": path, "rows": 2}])
    with pytest.raises(ValueError, match="skip must be >= 0"):
        config(tmp_path, prompts=[{"path": path, "skip": -1}])


def test_a_prompt_entry_picks_a_dataset_split(tmp_path):
    from data.distill_work import work_items

    folder = tmp_path / "ultrachat_like"
    (folder / "data").mkdir(parents=True)  # split files named as on the Hub (UltraChat's)
    for split, row in (
        ("train_sft", {"id": "s1", "prompt": "Hi"}),
        ("test_sft", {"id": "t1", "prompt": "Yo"}),
    ):
        (folder / "data" / f"{split}-00000-of-00001.jsonl").write_text(json.dumps(row) + "\n")
    path = str(folder)
    cfg = config(tmp_path, prompts=[{"path": path, "split": "test_sft"}])
    assert [item.key for item in work_items(cfg)] == ["ultrachat_like/t1/0"]


def _items(turn_counts):
    """Work items with (given user turns, user turns the target writes) each."""
    from data.distill_work import WorkItem

    return [
        WorkItem(f"s/{i}/0", "s", str(i), 0, ["u"] * users + [None] * follow_ups)
        for i, (users, follow_ups) in enumerate(turn_counts)
    ]


def test_a_server_stream_starts_the_longest_conversations_first_window_by_window():
    from data.distill import generations, start_order

    items = _items([(1, 0), (2, 1), (1, 0), (3, 0), (2, 1), (1, 0), (4, 0)])
    # an answer per user turn, plus each user turn the target writes (None)
    assert [generations(i) for i in items] == [1, 4, 1, 3, 4, 1, 4]
    # one window: most generations first, ties in file order
    assert start_order(items, 16) == [1, 4, 6, 3, 0, 2, 5]
    # windows of 3: each window sorted on its own, never an item started before an earlier window
    assert start_order(items, 3) == [1, 0, 2, 4, 3, 5, 6]
    assert sorted(start_order(items, 2)) == list(range(len(items)))


def test_a_server_stream_writes_in_file_order_whatever_order_it_starts(monkeypatch):
    """The stream starts conversations longest first, but yields them (so the file is written)
    in the prompts' order, and a window bounds how far ahead of the file it runs."""
    import threading
    from types import SimpleNamespace

    import data.distill as distill_mod

    items = _items([((i * 7) % 4 + 1, i % 2) for i in range(40)])
    started, lock = [], threading.Lock()

    def fake_run_batch(gen, batch, cfg, meta):
        with lock:
            started.append(batch[0].key)
        return [{"id": batch[0].key}], [], 1

    monkeypatch.setattr(distill_mod, "run_batch", fake_run_batch)
    cfg = SimpleNamespace(parallel=1)  # one slot: starts happen in submission order
    written = []
    distill_mod._stream_each(None, items, cfg, {}, lambda rows, *_: written.append(rows[0]["id"]))
    assert written == [i.key for i in items]
    window = 16 * cfg.parallel
    assert started == [items[i].key for i in distill_mod.start_order(items, window)]
    assert started != written  # the order really changed
    first_window = {i.key for i in items[:window]}
    assert set(started[:window]) == first_window  # nothing of a later window ran ahead


def test_an_interrupted_server_stream_keeps_every_finished_conversation(monkeypatch):
    """Ctrl-C while the first conversation still runs: the stream stops waiting at once, keeps
    the conversations that finished behind it (in order), drops the running one, and lets the
    KeyboardInterrupt through."""
    import threading
    import time
    from types import SimpleNamespace

    import data.distill as distill_mod

    items = _items([(1, 0)] * 6)
    release = threading.Event()

    def fake_run_batch(gen, batch, cfg, meta):
        if batch[0].key == items[0].key:
            release.wait(30)  # the slow head of the file
        return [{"id": batch[0].key}], [], 1

    def tick(finished):  # Ctrl-C once everything but the head has finished
        if finished == len(items) - 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(distill_mod, "run_batch", fake_run_batch)
    monkeypatch.setattr(distill_mod, "TICK_S", 0.05)
    kept, t0 = [], time.monotonic()
    keep = lambda rows, *_: kept.append(rows[0]["id"])  # noqa: E731
    with pytest.raises(KeyboardInterrupt):
        distill_mod._stream_each(None, items, SimpleNamespace(parallel=3), {}, keep, tick)
    assert time.monotonic() - t0 < 10  # did not wait for the head
    release.set()
    assert kept == [i.key for i in items[1:]]
