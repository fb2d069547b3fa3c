"""llama.cpp as an engine, with the real `llama-server` built by scripts/setup_llama_cpp.sh.

- the engine module's failure paths: no binary, a model file it cannot load (the error quotes
  the server's log), a server that stops on exit and on an exception;
- a tiny random Llama (SmolLM2's tokenizer, so llama.cpp's converter knows its pre-tokenizer)
  and a tiny EAGLE-3 draft trained on it for a few steps, both converted to GGUF with the pinned
  converter: llama.cpp's speculative output equals its plain output, plain output equals HF
  greedy on the same weights, and the draft's acceptance in llama.cpp equals our harness's for
  the same chain (the parity that catches a wrong aux-layer convention, feature norm, fc order,
  rope or d2t direction in training or export).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from data.engines import llama_cpp
from data.engines.llama_cpp import EngineError, LlamaServer, ServerConfig
from eval.bench.harness import top2_gaps
from eval.engine.generator import first_difference
from tests._stand_in_server import openai_stand_in
from tests.conftest import save_tiny_hf_model, train_tiny_draft

CONF = Path(__file__).resolve().parents[1] / "conf"
PROMPTS = [
    "Tell me about the moon.",
    "How do I bake bread?",
    "Write a haiku about rain.",
    "What is a prime number?",
    "Name three rivers in Europe.",
    "Why is the sky blue?",
]
NEW_TOKENS = 48
CHAIN = 3
AUX = [1, 3, 6]  # not the engines' default [2, N//2, N-3]: the export must carry them
# f32 logits of a batched and a one-token forward differ by less than this, relative to the
# logit's size (the tiny random target amplifies rounding through its 8 layers)
NEAR_TIE = 2e-4


def _need_server() -> None:
    if not llama_cpp.available():  # a failure, not a skip: set-up builds it
        pytest.fail("llama.cpp is not built here: run bash scripts/setup_llama_cpp.sh")


def test_missing_binary_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTSMITH_LLAMA_SERVER", str(tmp_path / "nope" / "llama-server"))
    with pytest.raises(EngineError, match="setup_llama_cpp.sh"):
        llama_cpp.server_binary()


@pytest.mark.integration
def test_the_build_leaves_out_the_amx_backend():
    """setup_llama_cpp.sh builds without ggml's AMX backend, whose matmul segfaults on Q4_0 and
    Q4_1 weights on CPUs with AMX (llama.cpp issue 20824): the server carries none of its code,
    and the build records the tag whose absence makes set-up rebuild an older build."""
    _need_server()
    assert b"ggml_backend_amx_buffer" not in llama_cpp.server_binary().read_bytes()
    script = (CONF.parent / "scripts" / "setup_llama_cpp.sh").read_text()
    tag = script.split("BUILD_TAG=", 1)[1].split()[0]
    info = json.loads((llama_cpp.llama_cpp_home() / "build_info.json").read_text())
    assert info["build_tag"] == tag


def test_config_refuses_bad_settings(tmp_path):
    model = tmp_path / "m.gguf"
    with pytest.raises(EngineError, match="does not exist"):
        ServerConfig(model=str(model))
    model.write_bytes(b"x")
    with pytest.raises(EngineError, match="spec_type"):
        ServerConfig(model=str(model), spec_type="medusa")
    with pytest.raises(EngineError, match="needs a draft GGUF"):
        ServerConfig(model=str(model), spec_type="draft-eagle3")


def test_draft_threads_reach_the_draft_model_alone(tmp_path):
    """llama_cpp.draft_threads sets the draft model's -td/-tbd and leaves the target's -t/-tb;
    unset, the draft runs at the target's threads."""
    from eval.bench.llama_cpp import LlamaCppSettings, _server_config

    model, draft = tmp_path / "m.gguf", tmp_path / "d.gguf"
    model.write_bytes(b"x")
    draft.write_bytes(b"x")

    def flags(cfg):
        args = cfg.args(8080)
        return {f: args[args.index(f) + 1] for f in ("-t", "-tb", "-td", "-tbd")}

    settings = LlamaCppSettings(
        target_gguf=str(model), draft_gguf=str(draft), spec_type="draft-eagle3", threads=2
    )
    same = _server_config("llama_cpp_draft", str(model), settings)
    assert flags(same) == {"-t": "2", "-tb": "2", "-td": "2", "-tbd": "2"}
    settings.draft_threads = 1
    one = _server_config("llama_cpp_draft", str(model), settings)
    assert flags(one) == {"-t": "2", "-tb": "2", "-td": "1", "-tbd": "1"}
    with pytest.raises(EngineError, match="draft_threads=0"):
        ServerConfig(model=str(model), draft=str(draft), spec_type="draft-eagle3", draft_threads=0)


@pytest.mark.parametrize(
    ("amx", "avx512_bf16", "expected"),
    [(False, False, "f32"), (False, True, "bf16"), (True, False, "bf16")],
)
def test_fast_float_is_bf16_only_where_the_cpu_multiplies_bf16(
    monkeypatch, amx, avx512_bf16, expected
):
    from heads.interop.gguf import TargetGGUF

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    assert TargetGGUF.parse("fast_float") == TargetGGUF(own=False, outtype=expected)


def test_a_target_gguf_setting_names_the_own_file_a_conversion_or_a_path(tmp_path):
    """data.self_distill.gguf, evaluate's llama_cpp.target_gguf and export's --target-outtype
    share one reading (TargetGGUF.parse): unset or "auto" is the target's own file, an outtype
    is its folder converted once, else a path."""
    from heads.interop.gguf import TargetGGUF, gguf_for_target
    from heads.target import TargetConfig, embedded_gguf

    assert TargetGGUF.parse(None) == TargetGGUF.parse("auto") == TargetGGUF()
    assert TargetGGUF().own and TargetGGUF.parse("bf16") == TargetGGUF(own=False, outtype="bf16")
    assert TargetGGUF.parse("/m/t.gguf") == TargetGGUF(file=Path("/m/t.gguf"))
    embedded = TargetConfig(name_or_path="smollm2_135m", cache_dir=str(tmp_path))
    assert gguf_for_target(embedded, TargetGGUF.parse("/m/t.gguf")) == Path("/m/t.gguf")
    assert gguf_for_target(embedded) == embedded_gguf("smollm2_135m")
    (tmp_path / "own.gguf").write_bytes(b"GGUF")
    folder = TargetConfig(name_or_path=str(tmp_path), gguf_file="own.gguf")
    assert gguf_for_target(folder, TargetGGUF.parse("auto")) == tmp_path / "own.gguf"
    hub = TargetConfig(name_or_path="someone/some-model")  # not here: nothing to convert
    with pytest.raises(FileNotFoundError, match="needs the target as GGUF"):
        gguf_for_target(hub, TargetGGUF.parse("f32"))
    # the quantised types: the f32 conversion through llama-quantize (gguf_types), parsed once
    import heads.interop.gguf as types_mod

    assert TargetGGUF.parse("q4_k_m") == TargetGGUF(own=False, outtype="q4_k_m")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(types_mod, "quantized_target_gguf", lambda c, q: Path(f"/cache/{q}.gguf"))
        for q in ("q4_0", "q4_k_m", "q8_0"):
            assert gguf_for_target(embedded, TargetGGUF.parse(q)) == Path(f"/cache/{q}.gguf")


@pytest.mark.integration
def test_unloadable_model_quotes_the_server_log(tmp_path):
    _need_server()
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    server = LlamaServer(ServerConfig(model=str(bad), startup_timeout_s=60))
    with pytest.raises(EngineError) as err:
        server.start()
    text = str(err.value)
    assert "exited with code" in text and "broken.gguf" in text
    assert len(text.splitlines()) > 2  # the log's last lines are quoted
    assert server.proc is not None and server.proc.poll() is not None


# ---- a tiny target and draft, converted once per module --------------------------------------


def _save_tiny_target(folder: Path, family: str = "llama") -> None:
    """A random 8-layer Llama (or Qwen2, whose llama.cpp graph needed the EAGLE-3 hook the
    set-up adds) with SmolLM2's tokenizer, weights drawn wide enough (std 0.1) that its greedy
    answers vary with the context instead of repeating one token."""
    save_tiny_hf_model(folder, family, layers=8, std=0.1, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    """(target, head, target_dir, target.gguf, draft.gguf): the tiny target above and an
    EAGLE-3 draft trained 100 steps on its own greedy answers, both converted to f32 GGUF."""
    return _eagle3_setup(tmp_path_factory.mktemp("llama_cpp"), "llama")


@pytest.fixture(scope="module")
def qwen2_setup(tmp_path_factory):
    """The same on a tiny random Qwen2 (llama.cpp's qwen2 graph, patched by the set-up). It
    borrows SmolLM2's tokenizer, whose pre-tokenizer llama.cpp knows as "smollm"; transformers
    loads it as a Qwen2Tokenizer by the folder's model type, which changes the fingerprint the
    converter recognises pre-tokenizers by, so the converter is told the name."""
    root = tmp_path_factory.mktemp("llama_cpp_qwen2")
    real = llama_cpp.converter_script()
    wrapper = root / "convert_with_smollm_pre.py"
    wrapper.write_text(
        "import runpy, sys\n"
        f"sys.path.insert(0, {str(real.parent)!r})\n"
        "from conversion import base\n"
        "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'smollm'\n"
        f"sys.argv[0] = {str(real)!r}\n"
        f"runpy.run_path({str(real)!r}, run_name='__main__')\n"
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llama_cpp, "converter_script", lambda: wrapper)
        return _eagle3_setup(root, "qwen2")


def _eagle3_setup(root: Path, family: str):
    _need_server()
    from hydra.utils import instantiate

    import heads
    from heads.interop.gguf import export_gguf, target_gguf
    from heads.target import load_target

    target_dir = root / "target"
    _save_tiny_target(target_dir, family)
    options = [f"head.aux_layers={AUX}", "head.draft_vocab_size=null", "head.ttt_steps=2"]
    cfg, result = train_tiny_draft(
        "eagle3_tiny", target_dir, root / "sd.jsonl", root / "run", steps=100, head=options
    )
    target = load_target(instantiate(cfg.model))
    head = heads.from_pretrained(result.head_dir, target)
    target_file = target_gguf(target_dir, root / "target-f32.gguf", "f32")
    draft_file = export_gguf(head, target, target_dir, root / "draft-f32.gguf", "f32")
    return target, head, target_dir, target_file, draft_file


def _prompt_ids(target) -> list[list[int]]:
    from data.chat import resolve_chat_template

    template = resolve_chat_template(target.tokenizer)
    out = []
    for text in PROMPTS:
        ids = target.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            chat_template=template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        out.append(list(ids))
    return out


def _hf_greedy(target, ids: list[int]) -> list[int]:
    from eval.engine.generator import plain_greedy

    result = plain_greedy(target.model, torch.tensor([ids]), NEW_TOKENS)
    return result.new_tokens.tolist()


def _harness_chain(target, head, ids: list[int]):
    from eval.bench.methods import head_method
    from eval.engine.tree_spec import resolve_tree

    method = head_method(target, "head", head, resolve_tree(CHAIN))
    return method.generator.generate(torch.tensor([ids]), NEW_TOKENS)


def _engine_runs(cfg: ServerConfig, prompts: list[list[int]]):
    with LlamaServer(cfg) as server:
        return [server.complete(ids, NEW_TOKENS) for ids in prompts]


@pytest.mark.integration
@pytest.mark.parametrize("setup", ["tiny_setup", "qwen2_setup"])
def test_llama_cpp_speculative_equals_plain_and_acceptance_matches(setup, request):
    target, head, _, target_file, draft_file = request.getfixturevalue(setup)
    prompts = _prompt_ids(target)
    plain = _engine_runs(
        ServerConfig(model=str(target_file), cache_type="f32", flash_attn="off"), prompts
    )
    spec = _engine_runs(
        ServerConfig(
            model=str(target_file),
            draft=str(draft_file),
            spec_type="draft-eagle3",
            draft_n_max=CHAIN,
            cache_type="f32",
            flash_attn="off",
        ),
        prompts,
    )
    # llama.cpp is lossless with our draft: the same tokens as its own plain decoding, except
    # where its batched verify rounds differently from a one-token step at a near tie (f32
    # kernels of another batch size): such a divergence must sit at a tiny top-2 gap
    for ids, a, b in zip(prompts, plain, spec):
        index = first_difference(a.tokens, b.tokens)
        if index is not None:
            gap, top1 = top2_gaps(target.model, torch.tensor([ids]), a.tokens)[index]
            assert gap < NEAR_TIE * max(1.0, abs(top1)), (
                f"llama.cpp draft changed the output at token {index}: top-2 gap {gap}, "
                f"top-1 logit {top1}"
            )
    # its f32 plain decoding is HF greedy on the same weights
    hf = [_hf_greedy(target, ids) for ids in prompts]
    same = sum(a.tokens == h[: len(a.tokens)] for a, h in zip(plain, hf))
    assert same >= len(prompts) - 1, f"llama.cpp f32 differs from HF greedy on {6 - same} prompts"
    # the draft is accepted in llama.cpp as in our harness (same chain, same prompts)
    harness = [_harness_chain(target, head, ids) for ids in prompts]
    # counted as llama.cpp counts: within the budget (new tokens - the prefill's - steps)
    h_acc = sum(r.new_tokens.numel() - 1 - len(r.accept_lengths) for r in harness)
    e_acc = sum(c.draft_accepted for c in spec)
    h_steps = sum(len(r.accept_lengths) for r in harness)
    assert h_acc > 0.2 * h_steps, f"the tiny draft barely learned ({h_acc} in {h_steps} steps)"
    assert abs(e_acc - h_acc) <= max(3, 0.1 * h_acc), (
        f"accepted draft tokens: llama.cpp {e_acc}, harness {h_acc}"
    )
    (Path(target_file).parent / "parity.json").write_text(
        json.dumps({"harness_accepted": h_acc, "llama_cpp_accepted": e_acc})
    )


@pytest.mark.integration
def test_server_stops_on_exception(tiny_setup):
    _, _, _, target_file, _ = tiny_setup
    server = LlamaServer(ServerConfig(model=str(target_file)))
    with pytest.raises(RuntimeError, match="boom"), server:
        assert server.complete([1, 2, 3], 2).tokens
        raise RuntimeError("boom")
    assert server.proc.poll() is not None
    with pytest.raises(EngineError):
        server.post("/health", {}, timeout_s=2)


@pytest.mark.integration
def test_server_dies_with_a_killed_parent(tiny_setup, tmp_path):
    """A Python process killed outright (SIGKILL: no atexit, no finally) takes its llama-server
    with it instead of leaving it holding the CPU."""
    import os
    import signal
    import subprocess
    import sys
    import time

    _, _, _, target_file, _ = tiny_setup
    script = (
        "import sys, time\n"
        "from data.engines.llama_cpp import LlamaServer, ServerConfig\n"
        f"s = LlamaServer(ServerConfig(model={str(target_file)!r})).start()\n"
        "print(s.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    server_pid = int(parent.stdout.readline())
    os.kill(server_pid, 0)  # running
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    for _ in range(100):
        try:  # gone, or a zombie waiting for init to reap it
            if Path(f"/proc/{server_pid}/stat").read_text().split(") ")[1][0] == "Z":
                break
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.1)
    else:
        os.kill(server_pid, signal.SIGKILL)
        raise AssertionError("llama-server outlived its killed parent")


# ---- self-distillation through a server ------------------------------------------------------


def _distill_cfg(out, rows: int, **engine):
    from data.distill import DistillConfig

    prompts = [{"path": "data/corpora/oa_prompts_en/prompts.jsonl", "skip": 16, "max_rows": rows}]
    return DistillConfig(prompts=prompts, out=str(out), max_new_tokens=16, batch_size=3, **engine)


@pytest.mark.integration
def test_llama_cpp_distillation_resumes_without_duplicates(tiny_setup, tmp_path, monkeypatch):
    import data.distill as distill_mod
    from data.distill import distill
    from data.parts import read_rows

    target, _, _, target_file, _ = tiny_setup
    out = tmp_path / "sd.jsonl"
    # one slot: conversations are written one by one as they finish, in the prompts' order
    engine = {"backend": "llama_cpp", "gguf": str(target_file), "parallel": 1}
    real_append, calls = distill_mod.append_rows, []

    def crash_after_first_batch(path, rows):
        calls.append(path)
        if len(calls) > 2:  # rows and skipped of the first conversation were written
            raise KeyboardInterrupt
        real_append(path, rows)

    monkeypatch.setattr(distill_mod, "append_rows", crash_after_first_batch)
    with pytest.raises(KeyboardInterrupt):
        distill(target, _distill_cfg(out, 6, **engine), progress=False)
    monkeypatch.setattr(distill_mod, "append_rows", real_append)
    first = [row["id"] for row in read_rows(out)]
    assert 0 < len(first) < 6
    stats = distill(target, _distill_cfg(out, 6, **engine), progress=False)
    keys = [row["id"] for row in read_rows(out)]
    assert len(keys) == len(set(keys)) == 6 and keys[: len(first)] == first
    assert stats["rows"] == 6 - len(first)
    # the same prompts through HF generate: f32 llama.cpp (its default f16 KV cache) writes
    # the same answers but where a near tie of the random tiny target rounds the other way
    hf_out = tmp_path / "hf.jsonl"
    distill(target, _distill_cfg(hf_out, 6), progress=False)
    by_key = {r["id"]: r["messages"] for r in read_rows(hf_out)}
    same = sum(by_key[r["id"]] == r["messages"] for r in read_rows(out))
    assert same >= 4, f"only {same} of 6 llama.cpp answers equal HF's"


@pytest.mark.integration
def test_prompt_synthesis_through_llama_server_is_seeded(tiny_setup, tmp_path):
    """Synthesis candidates sampled in llama-server (temperature 1, one seed per request): the
    same seeds write the same text, and the filters judge it (this random tiny target never ends
    a turn within 4 tokens, so every candidate is 'cut at max_new_tokens')."""
    from data.distill import DistillConfig, distill
    from data.parts import read_rows
    from data.synthesize import SynthesisSpec, candidates_path

    target, _, _, target_file, _ = tiny_setup
    synth = {"synthesize": 1, "max_candidates": 32, "max_new_tokens": 4}
    texts = []
    for name in ("a", "b"):
        out = tmp_path / name / "sd.jsonl"
        out.parent.mkdir()
        cfg = DistillConfig(prompts=[{"synthesize": synth}], out=str(out), backend="llama_cpp",
                            gguf=str(target_file), parallel=1)  # fmt: skip
        assert distill(target, cfg, progress=False)["rows"] == 0
        rows = list(read_rows(candidates_path(out, SynthesisSpec(**synth))))
        assert [r["i"] for r in rows] == list(range(32))
        assert {r["reject"] for r in rows} == {"cut at max_new_tokens"}
        texts.append([r["text"] for r in rows])
    assert texts[0] == texts[1] and len(set(texts[0])) > 16


@pytest.mark.integration
def test_distillation_refuses_mixing_backends(tiny_setup, tmp_path):
    from data.distill import distill

    target, _, _, target_file, _ = tiny_setup
    out = tmp_path / "sd.jsonl"
    distill(target, _distill_cfg(out, 2), progress=False)
    engine = {"backend": "llama_cpp", "gguf": str(target_file)}
    with pytest.raises(ValueError, match="settings"):
        distill(target, _distill_cfg(out, 2, **engine), progress=False)


def test_openai_backend_against_a_stand_in_server(tiny_llama, tmp_path):
    """Any OpenAI-compatible server (vLLM, SGLang): the rendered prompt goes out as text, the
    answer's text comes back and is tokenized; finish_reason "stop" means EOS."""
    from data.distill import distill
    from data.parts import read_rows

    with openai_stand_in(lambda body: "Hello there") as (url, seen):
        engine = {"backend": "openai", "server_url": url, "server_model": "m", "parallel": 2}
        stats = distill(tiny_llama, _distill_cfg(tmp_path / "o.jsonl", 3, **engine), progress=False)
    rows = list(read_rows(tmp_path / "o.jsonl"))
    assert stats["rows"] == 3 and len(seen) == 3
    assert all(r["messages"][-1] == {"role": "assistant", "content": "Hello there"} for r in rows)
    assert all(r["finish"] == ["eos"] for r in rows)
    assert all(b["model"] == "m" and "<|im_start|>user" in b["prompt"] for b in seen)


def test_server_slots_do_not_wait_for_a_slow_conversation(tiny_llama, tmp_path):
    """A server's conversations stream through its slots: while one slot holds a slow answer the
    other serves every later prompt (no chunk barrier), and the file keeps the prompts' order."""
    import threading
    import time

    from data.distill import distill
    from data.formats import read_prompts
    from data.parts import read_rows

    arrived, lock = [], threading.Lock()
    first_prompt = read_prompts("data/corpora/oa_prompts_en/prompts.jsonl")[16]["turns"][0]

    def answer(body):
        slow = first_prompt in body["prompt"]
        with lock:
            arrived.append(("slow" if slow else "fast", time.monotonic()))
        if slow:
            time.sleep(1.5)
        return "slow answer" if slow else "fast answer"

    with openai_stand_in(answer) as (url, _):
        engine = {"backend": "openai", "server_url": url, "server_model": "m", "parallel": 2}
        t0 = time.monotonic()
        distill(tiny_llama, _distill_cfg(tmp_path / "o.jsonl", 12, **engine), progress=False)
    assert len(arrived) == 12 and [k for k, _ in arrived].count("slow") == 1
    slow_done = next(t for k, t in arrived if k == "slow") + 1.5
    # all 11 fast requests reached the server while the slow one was still being answered
    assert max(t for k, t in arrived if k == "fast") < slow_done, arrived
    assert time.monotonic() - t0 < 1.5 * 2  # a barrier of 4 per slot would wait twice
    rows = list(read_rows(tmp_path / "o.jsonl"))
    assert rows[0]["messages"][-1]["content"] == "slow answer"
    assert [r["prompt_id"] for r in rows] == sorted(r["prompt_id"] for r in rows)


# ---- the benchmark's llama.cpp methods -------------------------------------------------------


def test_accept_lengths_are_rebuilt_from_the_servers_counters():
    from data.engines.llama_cpp import Completion
    from eval.bench.llama_cpp import accept_lengths

    # 10 steps after the prefill token: 3 accepted 3, 2 accepted 1, 5 accepted nothing
    done = Completion(list(range(1 + 10 + 11)), "", "limit", {"draft_n_accepted": 11})
    log = "slot ... acc per pos = (0.500, 0.300, 0.300)\n"
    lengths = accept_lengths(done, log, 3)
    assert sorted(lengths, reverse=True) == [4, 4, 4, 2, 2] + [1] * 5
    assert sum(lengths) == len(done.tokens) - 1
    nothing = Completion(list(range(8)), "", "limit", {"draft_n_accepted": 0})
    assert accept_lengths(nothing, "", 3) == [1] * 7
    with pytest.raises(EngineError, match="verbosity"):
        accept_lengths(done, "", 3)


def test_best_draft_length_trades_acceptance_for_verify_cost():
    from eval.bench.llama_cpp import best_draft_length

    at_least = [0.6, 0.3, 0.1, 0.01]
    # cheap verification: drafting more pays until acceptance runs out
    k, speed = best_draft_length(at_least, {0: 10.0, 4: 11.0})
    assert k == 3 and speed[3] > speed[0]
    # verification that costs 65% more per drafted token: drafting does not pay
    k, _ = best_draft_length(at_least, {0: 10.0, 4: 36.0})
    assert k == 0


@pytest.mark.integration
def test_benchmark_runs_llama_cpp_methods_beside_hf(tiny_setup, tmp_path):
    from eval.bench.harness import BenchConfig, BenchRun, run_benchmark
    from eval.bench.llama_cpp import LlamaCppSettings, build_llama_cpp_methods
    from eval.bench.methods import build_methods

    target, _, _, target_file, draft_file = tiny_setup
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": i, "turns": [p]}) + "\n" for i, p in enumerate(PROMPTS[:3]))
    )
    from data.engines.llama_tools import quantize_gguf

    # two target types in one run: f32 (faithful) and q8_0, each method once per type
    q8 = quantize_gguf(target_file, tmp_path / "target-q8_0.gguf", "q8_0", threads=1)
    settings = LlamaCppSettings(
        target_gguf={"f32": str(target_file), "q8_0": str(q8)},
        resolved_types={"f32": "f32", "q8_0": "q8_0"},
        draft_gguf=str(draft_file),
        cache_type="f32",  # faithful: the random tiny target has near ties a f16 cache flips
        flash_attn="off",
    )
    names = ["llama_cpp_plain", "llama_cpp_draft", "llama_cpp_ngram"]
    methods = build_methods(target, ["plain", "hf_generate"])
    methods += build_llama_cpp_methods(names, settings)
    bench = BenchConfig(path=str(prompts), max_new_tokens=NEW_TOKENS, warmup=1)
    run = BenchRun(bench, meta={"llama_cpp": asdict(settings)})
    try:
        summary = run_benchmark(target, methods, run, tmp_path / "out")
    finally:
        for m in methods:
            getattr(m, "close", lambda: None)()
    got = summary["methods"]
    draft = got["llama_cpp_draft@f32"]["overall"]
    assert got["llama_cpp_draft@f32"]["baseline"] == "llama_cpp_plain@f32"
    assert got["llama_cpp_draft@q8_0"]["baseline"] == "llama_cpp_plain@q8_0"
    assert (
        draft["baseline_mismatches"] == 0
        and got["llama_cpp_ngram@f32"]["overall"]["baseline_mismatches"] == 0
    )
    assert draft["tau"] > 1.0 and draft["speedup_vs_plain"] is not None
    assert got["llama_cpp_plain@f32"]["overall"]["tau"] == 1.0
    assert len(draft["accept_rate_by_depth"]) == CHAIN
    # every llama.cpp method is also compared with the faster of the two plain types
    fastest = summary["meta"]["fastest_plain"]
    rates = {t: got[f"llama_cpp_plain@{t}"]["overall"]["tokens_per_s"] for t in ("f32", "q8_0")}
    assert fastest["type"] == max(rates, key=rates.get)
    assert fastest["method"] == f"llama_cpp_plain@{fastest['type']}"
    expected = draft["tokens_per_s"] / rates[fastest["type"]]
    assert draft["speedup_vs_fastest_plain"] == pytest.approx(expected)
    report = (tmp_path / "out" / "report.md").read_text()
    assert f"GGUF type {fastest['type']}" in report


@pytest.mark.integration
def test_gguf_export_of_a_run_is_proved_in_llama_cpp(tiny_setup, tmp_path):
    import importlib.util

    from eval.publish.gguf_export import export_gguf_run

    _, _, _, target_file, _ = tiny_setup
    run_dir = Path(target_file).parent / "run"
    out = tmp_path / "gguf"
    doc = export_gguf_run(run_dir, out, target_outtype="f32", check_prompts=3, check_tokens=24)
    assert (out / "draft-f32.gguf").is_file() and (out / "target-f32.gguf").is_file()
    check = doc["check"]
    assert check["identical"] + len(check["near_tie_divergences"]) == 3
    assert abs(check["llama_cpp_accepted"] - check["harness_accepted"]) <= 3
    assert json.loads((out / "export.json").read_text())["spec_type"] == "draft-eagle3"
    # the command line refuses an existing folder without --overwrite, in one line
    spec = importlib.util.spec_from_file_location("export_cli", CONF.parent / "scripts/export.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.main([str(run_dir), "--format", "gguf", "--out", str(out)]) == 1


# ---- DFlash: a block drafter through llama.cpp's converter and --spec-type draft-dflash ----------

DFLASH_BLOCK = 8
DFLASH_IDS = [1, 5]  # z-lab ids (decoder-layer outputs); the GGUF records them + 1


def _tiny_block_draft(root: Path, experiment: str, head_overrides: list[str]):
    """(target, head, target_dir, target.gguf, draft.gguf): the tiny target above and a block
    draft (`experiment`, 2 layers) trained 80 steps on its own greedy answers, both converted to
    f32 GGUF through llama.cpp's converter."""
    _need_server()
    from hydra.utils import instantiate

    import heads
    from heads.interop.gguf import export_gguf, target_gguf
    from heads.target import load_target

    target_dir = root / "target"
    _save_tiny_target(target_dir)
    options = ["head.num_layers=2", "head.num_anchors=32", f"head.target_layer_ids={DFLASH_IDS}",
               *head_overrides]  # fmt: skip
    cfg, result = train_tiny_draft(
        experiment, target_dir, root / "sd.jsonl", root / "run", steps=80, head=options
    )
    target = load_target(instantiate(cfg.model))
    head = heads.from_pretrained(result.head_dir, target).eval()
    target_file = target_gguf(target_dir, root / "target-f32.gguf", "f32")
    draft_file = export_gguf(head, target, target_dir, root / "draft-f32.gguf", "f32")
    return target, head, target_dir, target_file, draft_file


@pytest.fixture(scope="module")
def dflash_setup(tmp_path_factory):
    """The tiny target and a DFlash draft (block 8, a learned MASK vector, the target's full
    vocabulary), the draft converted from the z-lab layout with mask_embedding.pt."""
    return _tiny_block_draft(
        tmp_path_factory.mktemp("llama_cpp_dflash"),
        "dflash_tiny",
        [
            f"head.block_size={DFLASH_BLOCK}",
            "head.learn_mask=true",
            # as measured (67 of 215 accepted); a MASK vector started from row 16 learned less
            # in these 80 steps (31 of 251)
            "head.mask_token_id=2",
        ],
    )


REDUCED_VOCAB = 1024


@pytest.fixture(scope="module", params=["dflash", "dspark"])
def reduced_block_setup(request, tmp_path_factory):
    """The tiny target and a block draft over a reduced vocabulary (its own lm_head over the
    1,024 most frequent answer tokens and d2t), converted through llama.cpp's DSpark converter:
    a DFlash draft (block 8, 7 drafts from slot 1) and a DSpark draft (block 7, 7 drafts from
    the anchor, rank-8 Markov head, confidence head)."""
    extra = {
        "dflash": [f"head.block_size={DFLASH_BLOCK}"],
        "dspark": ["head.block_size=7", "head.markov_rank=8"],
    }[request.param]
    return _tiny_block_draft(
        tmp_path_factory.mktemp(f"llama_cpp_{request.param}_reduced"),
        f"{request.param}_tiny",
        [*extra, "head.mask_token_id=2", f"head.draft_vocab_size={REDUCED_VOCAB}"],
    )


@pytest.mark.integration
def test_dflash_gguf_records_the_block_layers_and_mask(dflash_setup):
    """llama.cpp's DFlashModel (conversion/qwen.py) writes dflash.block_size, dflash.target_layers
    = z-lab ids + 1 and tokenizer.ggml.mask_token_id; with mask_embedding.pt it emits the target's
    embedding, the learned vector in the mask row, and the target's lm_head as output."""
    import gguf

    target, head, _, _, draft_file = dflash_setup
    reader = gguf.GGUFReader(str(draft_file))
    fields = {name: field.contents() for name, field in reader.fields.items()}
    assert fields["general.architecture"] == "dflash"
    assert fields["dflash.block_size"] == DFLASH_BLOCK
    assert fields["dflash.target_layers"] == [i + 1 for i in DFLASH_IDS]
    assert fields["dflash.block_count"] == 2
    assert fields["tokenizer.ggml.mask_token_id"] == head.config.mask_token_id
    tensors = {t.name: t for t in reader.tensors}
    per_layer = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm",
                 "attn_k_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]  # fmt: skip
    want = {f"blk.{i}.{n}.weight" for i in range(2) for n in per_layer}
    want |= {"fc.weight", "enc.output_norm.weight", "output_norm.weight"}
    want |= {"token_embd.weight", "output.weight"}  # from mask_embedding.pt and the target
    assert set(tensors) == want
    H, V = target.hidden_size, target.vocab_size
    assert tensors["fc.weight"].shape.tolist() == [len(DFLASH_IDS) * H, H]  # ggml {in, out}
    embed = torch.from_numpy(tensors["token_embd.weight"].data.copy()).reshape(V, H)
    assert torch.equal(embed[head.config.mask_token_id], head.mask_embedding.detach().float())
    others = torch.ones(V, dtype=torch.bool)
    others[head.config.mask_token_id] = False
    assert torch.equal(embed[others], target.embed_tokens.weight.detach().float()[others])


@pytest.mark.integration
def test_llama_cpp_dflash_speculative_equals_plain_and_acceptance_matches(dflash_setup):
    target, head, _, target_file, draft_file = dflash_setup
    counts = _chain_parity(target, head, target_file, draft_file, "draft-dflash", DFLASH_BLOCK - 1)
    h_acc, h_steps = counts["harness_accepted"], counts["steps"]
    assert h_acc > 0.2 * h_steps, f"the tiny draft barely learned ({h_acc} in {h_steps} steps)"
    (Path(target_file).parent / "parity.json").write_text(json.dumps(counts))


def _chain_parity(target, head, target_file, draft_file, spec_type: str, chain: int) -> dict:
    """Greedy llama-server runs of the tiny target alone and with `draft_file`: the draft must
    not change llama.cpp's own output (beyond near ties of a batched verify), and llama.cpp must
    accept as many drafted tokens as our harness on the same chain. Returns the counts."""
    from eval.bench.methods import head_method
    from eval.engine.tree_spec import resolve_tree

    prompts = _prompt_ids(target)
    engine = {"cache_type": "f32", "flash_attn": "off"}
    plain = _engine_runs(ServerConfig(model=str(target_file), **engine), prompts)
    spec = _engine_runs(
        ServerConfig(
            model=str(target_file),
            draft=str(draft_file),
            spec_type=spec_type,
            draft_n_max=chain,
            **engine,
        ),
        prompts,
    )
    for ids, a, b in zip(prompts, plain, spec):
        index = first_difference(a.tokens, b.tokens)
        if index is not None:
            gap, top1 = top2_gaps(target.model, torch.tensor([ids]), a.tokens)[index]
            assert gap < NEAR_TIE * max(1.0, abs(top1)), (
                f"llama.cpp {spec_type} draft changed the output at token {index}: top-2 gap {gap}"
            )
    method = head_method(target, "head", head, resolve_tree(chain))
    harness = [method.generator.generate(torch.tensor([ids]), NEW_TOKENS) for ids in prompts]
    h_acc = sum(r.new_tokens.numel() - 1 - len(r.accept_lengths) for r in harness)
    e_acc = sum(c.draft_accepted for c in spec)
    h_steps = sum(len(r.accept_lengths) for r in harness)
    assert abs(e_acc - h_acc) <= max(3, 0.1 * h_acc), (
        f"accepted draft tokens: llama.cpp {e_acc}, harness {h_acc}"
    )
    return {"harness_accepted": h_acc, "llama_cpp_accepted": e_acc, "steps": h_steps}


@pytest.mark.integration
def test_reduced_vocabulary_block_drafts_convert_with_d2t(reduced_block_setup):
    """llama.cpp's DSpark converter (conversion/qwen.py `DSparkModel`) writes the draft's own
    D-row output head and d2t as absolute target ids (I64), and dflash.sample_from_anchor: false
    for DFlash (drafts from slot 1, no Markov tensors) and true for DSpark (drafts from the
    anchor, markov_w1 [V, r] and markov_w2 [D, r], the confidence projection)."""
    import gguf

    from heads.interop.gguf import spec_type_for, spec_type_of_gguf

    target, head, _, target_file, draft_file = reduced_block_setup
    # evaluate.py's llama_cpp.spec_type=null reads the serving type back from the file
    assert spec_type_of_gguf(draft_file) == spec_type_for(head)
    with pytest.raises(ValueError, match="llama_cpp.spec_type"):
        spec_type_of_gguf(target_file)  # a target, not a draft
    reader = gguf.GGUFReader(str(draft_file))
    fields = {name: field.contents() for name, field in reader.fields.items()}
    tensors = {t.name: t for t in reader.tensors}
    dspark = head.method == "dspark"
    assert fields["general.architecture"] == "dflash"
    assert fields["dflash.sample_from_anchor"] is dspark
    assert fields["dflash.target_layers"] == [i + 1 for i in DFLASH_IDS]
    assert fields["dflash.block_size"] == head.block_size
    d2t = torch.from_numpy(tensors["d2t"].data.copy()).reshape(-1)
    # ours holds offsets (EAGLE-3's convention); the converter writes absolute target ids
    absolute = head.draft_to_target(torch.arange(REDUCED_VOCAB)).cpu()
    assert d2t.dtype == torch.int64 and torch.equal(d2t, absolute)
    H = target.hidden_size
    assert tensors["output.weight"].shape.tolist() == [H, REDUCED_VOCAB]  # ggml {in, out}
    markov = {n for n in tensors if "markov" in n or "conf" in n}
    if dspark:
        assert any("markov_w1" in n for n in markov) and any("markov_w2" in n for n in markov)
        assert any("conf" in n for n in markov)
    else:
        assert not markov
    # the runtime borrows the target's embedding, unless the draft learned its MASK vector:
    # then the draft carries the target's table with that vector in the mask row
    assert head.mask_embedding is not None
    embed = torch.from_numpy(tensors["token_embd.weight"].data.copy())
    embed = embed.reshape(target.vocab_size, H)
    mask_id = head.config.mask_token_id
    assert torch.equal(embed[mask_id], head.mask_embedding.detach().float())
    assert torch.equal(embed[:mask_id], target.embed_tokens.weight.detach().float()[:mask_id])


@pytest.mark.integration
def test_llama_cpp_serves_reduced_vocabulary_block_drafts_losslessly(reduced_block_setup):
    target, head, _, target_file, draft_file = reduced_block_setup
    from heads.interop.gguf import spec_type_for

    counts = _chain_parity(
        target, head, target_file, draft_file, spec_type_for(head), head.max_draft_depth
    )
    assert counts["harness_accepted"] > 0.05 * counts["steps"], (
        f"the tiny reduced-vocabulary draft barely learned: {counts}"
    )
    (Path(draft_file).parent / "parity.json").write_text(json.dumps(counts))


# ---- target types, quantised drafts, the engine ceiling --------------------------------------

TARGET_TYPES = ["q4_0", "q4_k_m", "q8_0", "bf16", "f32", "auto"]
# the gguf type each choice gives the tiny folder (auto: a folder without a GGUF of its own is
# converted to f16)
TYPE_NAMES = {"q4_0": "q4_0", "q4_k_m": "q4_k_m", "q8_0": "q8_0", "bf16": "bf16", "f32": "f32",
              "auto": "f16"}  # fmt: skip
# a quantised target's batched verify and one-token step take different kernels (repacked
# multi-row matmuls against one-row dot products, activations rounded per batch), so greedy
# outputs may part where llama.cpp's own top-2 log-probabilities are this close
TYPE_NEAR_TIE = 0.02


def _tiny_cfg(tiny_setup):
    from heads.target import TargetConfig

    _, _, target_dir, target_file, _ = tiny_setup
    return TargetConfig(name_or_path=str(target_dir), cache_dir=str(Path(target_file).parent))


@pytest.mark.integration
@pytest.mark.parametrize("target_type", TARGET_TYPES)
def test_each_target_type_serves_the_draft_without_changing_its_output(tiny_setup, target_type):
    """Every llama_cpp.target_gguf type is made once (cached), loads in llama-server, and its
    drafted output equals its own plain output: exactly for f32, elsewhere up to counted near
    ties of its own plain run."""
    from eval.publish.gguf_export import llama_cpp_proof
    from heads.interop.gguf import gguf_type_name, target_gguf_of_type

    target, _, _, _, draft_file = tiny_setup
    path = target_gguf_of_type(_tiny_cfg(tiny_setup), target_type)
    assert gguf_type_name(path) == TYPE_NAMES[target_type]
    stamp = path.stat().st_mtime_ns
    assert target_gguf_of_type(_tiny_cfg(tiny_setup), target_type).stat().st_mtime_ns == stamp
    prompts = _prompt_ids(target)
    proof = llama_cpp_proof(str(path), str(draft_file), "draft-eagle3", prompts, NEW_TOKENS,
                            CHAIN, TYPE_NEAR_TIE, faithful=True)  # fmt: skip
    ties = proof["near_tie_divergences"]
    if target_type == "f32":
        assert not ties and proof["identical"] == len(prompts)
    assert proof["identical"] + len(ties) == len(prompts)
    assert proof["llama_cpp_accepted"] > 0, f"{target_type}: the draft accepted nothing"
    (path.parent / f"proof-{target_type}.json").write_text(json.dumps(proof))


# A quantised draft may accept differently from the f32 draft only where its rounded weights flip
# a proposal, i.e. at the draft's own near ties; each flip moves at most one step's accepted
# count, by at most the chain. The band below is that of the f32 parity (engine against
# harness, whose kernels also round differently), widened by one chain per flipped step on 4%
# of the steps (q8_0 rounds each weight by up to 1/254 of its block's largest).
QUANT_SHARE = 0.04


def _drafted(target_file, draft_file, spec_type: str, chain: int, prompts):
    engine = {"cache_type": "f32", "flash_attn": "off"}
    cfg = ServerConfig(model=str(target_file), draft=str(draft_file), spec_type=spec_type,
                       draft_n_max=chain, **engine)  # fmt: skip
    return _engine_runs(cfg, prompts)


def _quantised_draft_parity(setup, outtype: str, spec_type: str, chain: int) -> dict:
    """The draft of `setup` exported as `outtype`: smaller, lossless in llama.cpp (the f32
    target's own plain output), and accepting as the f32 draft does within the band above."""
    import gguf

    from heads.interop.gguf import export_gguf

    target, head, target_dir, target_file, f32_draft = setup
    draft = export_gguf(head, target, target_dir, Path(f32_draft).parent / f"d-{outtype}.gguf",
                        outtype)  # fmt: skip
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(str(draft)).tensors}
    assert outtype.upper() in kinds, f"no {outtype} tensor in the draft: {kinds}"
    assert draft.stat().st_size < Path(f32_draft).stat().st_size
    prompts = _prompt_ids(target)
    plain = _engine_runs(
        ServerConfig(model=str(target_file), cache_type="f32", flash_attn="off"), prompts
    )
    ref = _drafted(target_file, f32_draft, spec_type, chain, prompts)
    got = _drafted(target_file, draft, spec_type, chain, prompts)
    for ids, a, b in zip(prompts, plain, got):
        index = first_difference(a.tokens, b.tokens)
        if index is not None:
            gap, top1 = top2_gaps(target.model, torch.tensor([ids]), a.tokens)[index]
            assert gap < NEAR_TIE * max(1.0, abs(top1)), f"{outtype} draft changed token {index}"
    f32_acc = sum(c.draft_accepted for c in ref)
    q_acc = sum(c.draft_accepted for c in got)
    steps = sum(len(c.tokens) - 1 - c.draft_accepted for c in ref)
    band = max(3, 0.1 * f32_acc) + chain * QUANT_SHARE * steps
    assert abs(q_acc - f32_acc) <= band, f"{outtype}: accepted {q_acc}, f32 draft {f32_acc}"
    return {"outtype": outtype, "accepted": q_acc, "f32_accepted": f32_acc, "steps": steps,
            "band": band, "bytes": draft.stat().st_size}  # fmt: skip


@pytest.mark.integration
@pytest.mark.parametrize("outtype", ["f16", "bf16", "q8_0"])
def test_quantised_eagle3_drafts_accept_like_the_f32_draft(tiny_setup, outtype):
    counts = _quantised_draft_parity(tiny_setup, outtype, "draft-eagle3", CHAIN)
    (Path(tiny_setup[3]).parent / f"quant-{outtype}.json").write_text(json.dumps(counts))


def _quantised_block_parity(setup) -> None:
    from heads.interop.gguf import spec_type_for

    head = setup[1]
    counts = _quantised_draft_parity(setup, "q8_0", spec_type_for(head), head.max_draft_depth)
    (Path(setup[3]).parent / "quant-q8_0.json").write_text(json.dumps(counts))


@pytest.mark.integration
def test_quantised_dflash_draft_accepts_like_the_f32_draft(dflash_setup):
    _quantised_block_parity(dflash_setup)


@pytest.mark.integration
def test_quantised_reduced_vocabulary_block_drafts_accept_like_f32(reduced_block_setup):
    _quantised_block_parity(reduced_block_setup)  # DFlash and DSpark over d2t


@pytest.mark.integration
def test_llama_bench_measures_a_verify_cost_curve(tiny_setup):
    from data.engines.llama_tools import verify_cost_curve

    curve = verify_cost_curve(tiny_setup[3], threads=1, batches=(1, 2, 4), depth=16, reps=2)
    assert set(curve.ms) == {1, 2, 4} and all(v > 0 for v in curve.ms.values())
    assert curve.depth == 16 and curve.threads == 1 and curve.info["type_k"] == "f16"


@pytest.mark.integration
def test_engine_ceiling_runs_end_to_end_on_the_tiny_target(tiny_setup, tmp_path):
    from eval.bench.engine_ceiling import CeilingSettings, run_ceiling
    from eval.bench.engine_ceiling_report import write

    settings = CeilingSettings(
        types=["f32", "q8_0"], threads=1, batches=[1, 2], depth=16, reps=1,
        draft_gguf=str(tiny_setup[4]), rates=[[0.5], [1.0]], own_chain=1, prompts=2,
        max_new_tokens=24,
    )  # fmt: skip
    summary = run_ceiling(settings, _tiny_cfg(tiny_setup), "test")
    fastest = summary["fastest_plain"]["type"]
    rates = {t: e["plain"]["tokens_per_s"] for t, e in summary["types"].items()}
    assert rates[fastest] == max(rates.values())
    for entry in summary["types"].values():
        half, full = entry["chains"]["1"]["runs"]
        # every drafted token accepted; the last round of an answer may be cut to one token by the
        # token limit (23 tokens after the first = 11 rounds of 2 and one of 1: tau 1.92)
        assert full["tau"] == pytest.approx(2.0, abs=0.1)
        assert 1.2 < half["tau"] < 1.8  # about half of them
        assert entry["chains"]["1"]["break_even_tau_verify_only"] > 0.5
        own = entry["own"]
        assert own["tau"] > 1.0 and own["predicted_speedup"] > 0 and "draft_length" in own
        assert len(entry["verify_curve"]["ms"]) == 2
    report = write(summary, tmp_path / "ceiling")
    assert f"**{fastest}**" in report.read_text()
