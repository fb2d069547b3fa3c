"""The benchmark harness: end to end on a tiny random Llama, metrics, report, Hydra config."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from eval.bench.harness import (
    FP32_TIE_FLOOR,
    BenchConfig,
    BenchRun,
    encode_chat,
    near_tie_threshold,
    rounding_step,
    run_benchmark,
    top2_gaps,
)
from eval.bench.methods import Record, build_methods
from eval.bench.report import DEFINITIONS
from eval.engine.generator import first_difference
from eval.engine.tau import TauEvaluator
from eval.engine.tree_spec import resolve_tree
from heads.medusa import MedusaConfig, MedusaHeads

CONF = Path(__file__).resolve().parents[1] / "conf"
TREE = [[0], [1], [0, 0]]  # depth 2: fits a 2-head Medusa
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_prompts(path: Path) -> Path:
    rows = [
        {"question_id": 1, "category": "alpha", "turns": ["abc abc abc", "and again?"]},
        {"question_id": 2, "category": "beta", "turns": ["Hello there"]},
        {"id": 3, "category": "alpha", "prompt": "xyz xyz"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def medusa(target, num_heads: int = 2) -> MedusaHeads:
    torch.manual_seed(0)
    return MedusaHeads.for_target(MedusaConfig(num_heads=num_heads), target).eval()


@pytest.fixture
def bench_run(tiny_llama, tmp_path):
    """One benchmark of all four methods over 3 questions (4 requests) x 12 tokens."""
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    names = ["plain", "hf_generate", "hf_prompt_lookup", "head"]
    methods = build_methods(tiny_llama, names, medusa(tiny_llama), resolve_tree(TREE))
    cfg = BenchConfig(name="tiny", path=str(prompts), max_new_tokens=12, warmup=1)
    out = tmp_path / "run"
    summary = run_benchmark(tiny_llama, methods, cfg, out)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return summary, rows, out


def test_outputs_and_summary(bench_run):
    summary, rows, out = bench_run
    for name in ("results.jsonl", "summary.json", "report.md"):
        assert (out / name).is_file(), name
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert len(rows) == 4 * 4  # (2 + 1 + 1 turns) x 4 methods
    assert {r["turn"] for r in rows if r["question_id"] == 1} == {1, 2}
    methods = summary["methods"]
    assert list(methods) == ["plain", "hf_generate", "hf_prompt_lookup", "head"]
    for entry in methods.values():
        assert set(entry["categories"]) == {"alpha", "beta"}
        for key in (
            "tau",
            "tau_per_request",
            "tokens_per_s",
            "speedup_vs_plain",
            "speedup_vs_hf_generate",
            "accept_rate_by_depth",
            "greedy_mismatches",
            "near_tie_mismatches",
            "requests",
        ):
            assert key in entry["overall"], key
        assert entry["overall"]["requests"] == 4
    assert summary["meta"]["num_requests"] == 4 and summary["meta"]["threads"] >= 1


def test_lossless_and_tau(bench_run):
    summary, rows, _ = bench_run
    m = summary["methods"]
    for name in ("plain", "head", "hf_prompt_lookup"):
        assert m[name]["overall"]["greedy_mismatches"] == 0, name
    assert all(r["greedy_match"] for r in rows if r["method"] in ("plain", "head"))
    assert m["plain"]["overall"]["tau"] == 1.0 and m["hf_generate"]["overall"]["tau"] == 1.0
    assert m["head"]["overall"]["tau"] >= 1.0 and m["head"]["overall"]["tau_per_request"] >= 1.0
    # every method saw the same prompt for each request (turn 2 continues HF's answer)
    for q, turn in {(r["question_id"], r["turn"]) for r in rows}:
        lengths = {r["prompt_tokens"] for r in rows if (r["question_id"], r["turn"]) == (q, turn)}
        assert len(lengths) == 1
    # tau: decode tokens over decode forwards, pooled
    head = [r for r in rows if r["method"] == "head"]
    tokens = sum(r["new_tokens"] - r["prefill_tokens"] for r in head)
    forwards = sum(r["target_forwards"] - 1 for r in head)
    assert m["head"]["overall"]["tau"] == pytest.approx(tokens / forwards)
    rates = m["head"]["overall"]["accept_rate_by_depth"]
    assert len(rates) == 2 and 1 >= rates[0] >= rates[1] >= 0
    assert len(m["hf_prompt_lookup"]["overall"]["accept_rate_by_depth"]) == 10


def test_second_turn_continues_hf_answer(bench_run, tiny_llama):
    _, rows, _ = bench_run
    first = next(r for r in rows if (r["question_id"], r["turn"], r["method"]) == (1, 1, "plain"))
    second = next(r for r in rows if (r["question_id"], r["turn"]) == (1, 2))
    hf = next(
        r for r in rows if (r["question_id"], r["turn"], r["method"]) == (1, 1, "hf_generate")
    )
    answer = tiny_llama.tokenizer.decode(hf["tokens"], skip_special_tokens=True)
    messages = [
        {"role": "user", "content": "abc abc abc"},
        {"role": "assistant", "content": answer},
    ]
    ids = encode_chat(tiny_llama.tokenizer, messages + [{"role": "user", "content": "and again?"}])
    assert second["prompt_tokens"] == ids.shape[1] > first["prompt_tokens"] + len(hf["tokens"])


def test_hf_forward_accounting(bench_run):
    _, rows, _ = bench_run
    for r in rows:
        assert r["target_forwards"] == 1 + len(r["accept_lengths"])
        if r["method"].startswith("hf_"):  # observed from the cache: exact
            assert r["prefill_tokens"] + sum(r["accept_lengths"]) == r["new_tokens"]
        else:  # the engine counts a step's tokens before cutting at max_new_tokens
            assert r["prefill_tokens"] + sum(r["accept_lengths"]) >= r["new_tokens"]
        if r["method"] in ("plain", "hf_generate"):
            assert set(r["accept_lengths"]) <= {1}


def test_speedups_are_ratios_of_measured_throughput(bench_run):
    summary, rows, _ = bench_run
    m = summary["methods"]

    def tps(method, category=None):
        mine = [r for r in rows if r["method"] == method and category in (None, r["category"])]
        return sum(r["new_tokens"] for r in mine) / sum(r["seconds"] for r in mine)

    for name, entry in m.items():
        assert entry["overall"]["tokens_per_s"] == pytest.approx(tps(name))
        assert entry["overall"]["speedup_vs_plain"] == pytest.approx(tps(name) / tps("plain"))
        speedup = entry["categories"]["beta"]["speedup_vs_hf_generate"]
        assert speedup == pytest.approx(tps(name, "beta") / tps("hf_generate", "beta"))
    assert m["plain"]["overall"]["speedup_vs_plain"] == pytest.approx(1.0)


def test_report_and_plots(bench_run):
    import matplotlib.image

    _, _, out = bench_run
    text = (out / "report.md").read_text()
    assert "## Definitions" in text and "## Method `head`" in text
    for key, definition in DEFINITIONS.items():
        assert f"**{key}**: {definition}" in text
    pngs = ["accept_length_hist.png", "accept_rate_by_depth.png", "tokens_per_s.png"]
    for name in pngs:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
        assert matplotlib.image.imread(out / name).ndim == 3
        assert f"]({name})" in text


class Corrupt:
    """Greedy plain decoding with new token 2 replaced: a deliberately lossy method."""

    name, max_draft_depth = "corrupt", 0

    def __init__(self, inner, vocab: int):
        self.inner, self.vocab = inner, vocab

    def run(self, input_ids, max_new_tokens) -> Record:
        rec = self.inner.run(input_ids, max_new_tokens)
        rec.tokens[2] = (rec.tokens[2] + 1) % self.vocab
        return rec


@pytest.mark.parametrize("tie", [1e-4, 1e9])
def test_mismatches_are_found_with_their_gap(tiny_llama, tmp_path, tie):
    prompts = write_prompts(tmp_path / "p.jsonl")
    base = build_methods(tiny_llama, ["hf_generate", "plain"])
    methods = [base[0], Corrupt(base[1], tiny_llama.vocab_size)]
    cfg = BenchConfig(path=str(prompts), limit=1, max_new_tokens=6, warmup=0)
    summary = run_benchmark(tiny_llama, methods, BenchRun(cfg, near_tie_gap=tie), tmp_path / "o")
    overall = summary["methods"]["corrupt"]["overall"]
    assert (
        overall["greedy_mismatches"] == 2
        and summary["methods"]["hf_generate"]["overall"]["greedy_mismatches"] == 0
    )
    assert all(m["first_mismatch"] == 2 and m["top2_gap"] >= 0 for m in overall["mismatches"])
    assert overall["near_tie_mismatches"] == (2 if tie > 1 else 0)  # random logits: no ties


def test_the_first_method_can_stand_in_for_the_reference(tiny_llama, tmp_path):
    """reference=first_method: no HF generate per request; outputs compare with the first
    method's, and later turns continue with its answers."""
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    methods = build_methods(tiny_llama, ["plain", "head"], medusa(tiny_llama), resolve_tree(TREE))
    calls = {"n": 0}
    real = methods[0].run

    def counted(ids, max_new):
        calls["n"] += 1
        return real(ids, max_new)

    methods[0].run = counted
    cfg = BenchConfig(name="tiny", path=str(prompts), max_new_tokens=8, warmup=0)
    summary = run_benchmark(
        tiny_llama, methods, BenchRun(cfg, reference="first_method"), tmp_path / "o"
    )
    assert summary["meta"]["reference"] == "plain" and calls["n"] == 4  # one run per request
    rows = [
        json.loads(line) for line in (tmp_path / "o" / "results.jsonl").read_text().splitlines()
    ]
    assert all(r["greedy_match"] for r in rows)  # the head is lossless against plain
    with pytest.raises(ValueError, match="reference='hf'"):
        BenchRun(cfg, reference="hf")


def test_top2_gaps_and_first_difference(tiny_llama):
    ids = torch.tensor([[2, 10, 11, 12]])
    new = build_methods(tiny_llama, ["plain"])[0].run(ids, 5).tokens
    logits = tiny_llama.model(input_ids=torch.tensor([ids[0].tolist() + new])).logits[0]
    top = logits[3:8].topk(2, dim=-1).values
    gaps, top1 = zip(*top2_gaps(tiny_llama.model, ids, new))
    assert list(gaps) == pytest.approx((top[:, 0] - top[:, 1]).tolist())
    assert list(top1) == pytest.approx(top[:, 0].tolist())
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_near_tie_threshold_follows_the_dtype():
    # bf16 keeps 8 significant bits: logits in [8, 16) are stored to steps of 0.0625, [16, 32)
    # to 0.125 (the gaps measured on SmolLM2's bf16 divergences)
    assert near_tie_threshold(12.0, torch.bfloat16) == 0.0625
    assert near_tie_threshold(20.0, torch.bfloat16) == 0.125
    assert near_tie_threshold(20.0, torch.float16) == 2.0**-6
    assert near_tie_threshold(20.0, torch.float32) == FP32_TIE_FLOOR  # never below the floor
    assert near_tie_threshold(20.0, torch.bfloat16, fixed=0.5) == 0.5
    assert rounding_step(-3.0, torch.bfloat16) == 2.0**-6


def test_tau_evaluator(tiny_llama, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl")
    head = medusa(tiny_llama).train()
    evaluate = TauEvaluator(prompts, limit=2, max_new_tokens=8, tree=[[0], [0, 0]])
    result = evaluate(head, tiny_llama)
    assert set(result) == {"tau", "tau_per_request"}
    assert 1.0 <= result["tau"] <= 3.0 and 1.0 <= result["tau_per_request"] <= 3.0
    assert head.training  # mode restored
    assert evaluate(head, tiny_llama) == result  # greedy: deterministic
    chain = TauEvaluator(prompts, limit=2, max_new_tokens=8, tree=2)
    assert chain.tree.paths == ((0,), (0, 0)) and chain(head, tiny_llama) == result


def test_bench_and_verifier_configs_instantiate():
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from eval.engine.verify import GreedyVerifier, SpeculativeSampler, TypicalVerifier

    kinds = {"greedy": GreedyVerifier, "typical": TypicalVerifier, "sampling": SpeculativeSampler}
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for bench in ("mt_bench", "spec_bench"):
            cfg = compose("evaluate", overrides=[f"bench={bench}"])
            assert isinstance(instantiate(cfg.bench, _convert_="all"), BenchConfig)
        for name, cls in kinds.items():
            cfg = compose("evaluate", overrides=[f"verifier={name}"])
            assert isinstance(instantiate(cfg.verifier), cls)
        cfg = compose("evaluate", overrides=["+experiment=medusa_llama", "tree=tree32"])
        assert cfg.model.name_or_path == "smollm2_135m" and len(cfg.tree.paths) == 31
        # `tree=7` (a chain, as the block drafters' docs write it) reaches Hydra as a chain
        import evaluate
        from eval.engine.tree import chain_paths
        from eval.engine.tree_spec import resolve_tree

        argv = evaluate.chain_overrides(["+experiment=dflash_llama", "tree=7", "seed=1"])
        assert argv[0] == "+experiment=dflash_llama" and argv[-1] == "seed=1"
        cfg = compose("evaluate", overrides=argv)
        spec = resolve_tree(OmegaConf.to_container(cfg.tree, resolve=True))
        assert spec.paths == tuple(tuple(p) for p in chain_paths(7)) and spec.depth == 7
        assert evaluate.chain_overrides(["tree=tree16", "tree=0"]) == ["tree=tree16", "tree=0"]


@pytest.mark.integration
def test_evaluate_config_runs_end_to_end(tmp_path):
    """conf/evaluate.yaml + eval.bench.harness.run on model=tiny_random_llama (SmolLM2's
    tokenizer)."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from eval.bench.harness import run
    from heads.target import load_target

    prompts = write_prompts(tmp_path / "p.jsonl")
    overrides = [
        "model=tiny_random_llama",
        "bench=jsonl",
        f"bench.path={prompts}",
        "bench.limit=2",
        "bench.max_new_tokens=8",
        "tree=chain",
        "tree.paths=[[0],[0,0]]",
        f"out_dir={tmp_path / 'out'}",
        "threads=1",
    ]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("evaluate", overrides=overrides)
    target = load_target(instantiate(cfg.model, _convert_="all"))
    medusa(target).save_pretrained(tmp_path / "head")
    cfg.head_path = str(tmp_path / "head")
    summary = run(cfg)
    assert list(summary["methods"]) == ["plain", "hf_generate", "hf_prompt_lookup", "head"]
    assert summary["methods"]["head"]["overall"]["greedy_mismatches"] == 0
    assert summary["meta"]["head_method"] == "medusa"
    assert (tmp_path / "out" / "report.md").is_file()


@pytest.mark.integration
def test_several_heads_in_one_run(tmp_path):
    """evaluate.yaml `heads:`: Medusa (static) and one EAGLE folder twice (static and dynamic),
    each its own lossless method with its own tree; drafting time is measured apart."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from eval.bench.harness import run
    from heads.eagle import EagleConfig, EagleHead
    from heads.target import load_target

    prompts = write_prompts(tmp_path / "p.jsonl")
    overrides = [
        "model=tiny_random_llama",
        "bench=jsonl",
        f"bench.path={prompts}",
        "bench.max_new_tokens=8",
        "methods=[plain,hf_generate]",
        f"out_dir={tmp_path / 'out'}",
        "threads=1",
        f"+heads.medusa={{path: {tmp_path / 'medusa'}, tree: {{paths: [[0], [1], [0, 0]]}}}}",
        f"+heads.eagle1={{path: {tmp_path / 'eagle'}, tree: chain}}",
        f"+heads.eagle2={{path: {tmp_path / 'eagle'}, tree: dynamic}}",
    ]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("evaluate", overrides=overrides)
    target = load_target(instantiate(cfg.model, _convert_="all"))
    medusa(target).save_pretrained(tmp_path / "medusa")
    torch.manual_seed(0)
    EagleHead.for_target(EagleConfig(), target).save_pretrained(tmp_path / "eagle")
    summary = run(cfg)
    methods = summary["methods"]
    assert list(methods) == ["plain", "hf_generate", "medusa", "eagle1", "eagle2"]
    heads = summary["meta"]["heads"]
    assert {n: h["method"] for n, h in heads.items()} == {
        "medusa": "medusa",
        "eagle1": "eagle",
        "eagle2": "eagle",
    }
    assert heads["eagle2"]["tree_nodes"] == 60 and heads["eagle1"]["tree"] == "chain"
    assert methods["eagle2"]["max_draft_depth"] == 6
    for name in ("medusa", "eagle1", "eagle2"):
        overall = methods[name]["overall"]
        assert overall["greedy_mismatches"] == 0, name
        assert overall["draft_ms_per_step"] > 0, name
        assert 0 < overall["draft_seconds"] < overall["seconds"]
    assert methods["plain"]["overall"]["draft_ms_per_step"] == 0
    report = (tmp_path / "out" / "report.md").read_text()
    assert "draft ms/step" in report and "eagle2" in report


def test_head_entries_are_checked():
    from eval.bench.harness import _head_entry

    assert _head_entry("a", "DIR", set()) == {"path": "DIR", "tree": "tree16"}
    with pytest.raises(ValueError, match="already a method"):
        _head_entry("plain", {"path": "DIR"}, set())
    with pytest.raises(ValueError, match="unknown keys"):
        _head_entry("a", {"path": "DIR", "trees": "x"}, set())
    with pytest.raises(ValueError, match="path"):
        _head_entry("a", {"tree": "dynamic"}, set())


def test_resolve_tree_names_and_errors(tmp_path):
    from eval.engine.dynamic_tree import DynamicTreeConfig
    from eval.engine.tree_spec import resolve_tree

    assert resolve_tree(2).paths == ((0,), (0, 0))
    assert isinstance(resolve_tree("dynamic").dynamic, DynamicTreeConfig)
    assert resolve_tree("tree16").num_nodes == 16
    assert resolve_tree({"paths": [[0]]}).paths == ((0,),)
    with pytest.raises(ValueError, match="known"):
        resolve_tree("tree17")
    with pytest.raises(FileNotFoundError):
        resolve_tree(str(tmp_path / "none.yaml"))


def test_per_category_keeps_the_first_questions_of_each(tmp_path):
    from collections import Counter

    from eval.bench.harness import load_bench_prompts

    spec = BenchConfig(path="data/corpora/spec_bench/question.jsonl", per_category=2)
    prompts = load_bench_prompts(spec)
    counts = Counter(p["category"] for p in prompts)
    assert len(counts) == 13 and set(counts.values()) == {2}
    mt = load_bench_prompts(BenchConfig(path="data/corpora/mt_bench/question.jsonl"))
    firsts = {}
    for q in mt:
        firsts.setdefault(q["category"], q["turns"])
    assert all(firsts[p["category"]] == p["turns"] for p in prompts[::2] if p["category"] in firsts)
    only = BenchConfig(path=spec.path, per_category=1, categories=["rag", "qa"], limit=1)
    assert [p["category"] for p in load_bench_prompts(only)] == ["qa"]
    with pytest.raises(ValueError, match="per_category"):
        BenchConfig(path=spec.path, per_category=0)


@pytest.mark.integration
def test_a_medusa2_head_runs_alone_on_its_adapted_target(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from eval.bench.harness import run
    from heads.medusa2 import Medusa2Config, Medusa2Head
    from heads.target import load_target

    prompts = write_prompts(tmp_path / "p.jsonl")
    overrides = ["model=tiny_random_llama", "bench=jsonl", f"bench.path={prompts}",
                 "bench.limit=2", "bench.max_new_tokens=6", "methods=[plain,hf_generate]",
                 "threads=1", "tree=chain", "tree.paths=[[0],[0,0]]"]  # fmt: skip
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(
            "evaluate",
            overrides=[*overrides, f"out_dir={tmp_path / 'a'}", "methods=[plain,hf_generate,head]"],
        )
        both = compose(
            "evaluate",
            overrides=[*overrides, f"out_dir={tmp_path / 'b'}",
                       f"+heads.m2={{path: {tmp_path / 'm2'}, tree: 2}}",
                       f"+heads.m1={{path: {tmp_path / 'm1'}, tree: 2}}"],
        )  # fmt: skip
    target = load_target(instantiate(cfg.model, _convert_="all"))
    medusa(target).save_pretrained(tmp_path / "m1")
    Medusa2Head.for_target(Medusa2Config(num_heads=2, lora_rank=2), target).save_pretrained(
        tmp_path / "m2"
    )
    cfg.head_path = str(tmp_path / "m2")
    summary = run(cfg)
    assert summary["meta"]["target_adapted"] is True
    assert summary["methods"]["head"]["overall"]["greedy_mismatches"] == 0
    with pytest.raises(ValueError, match="run of its own"):
        run(both)


@pytest.mark.integration
def test_rows_are_kept_when_a_run_stops_early_and_the_report_rebuilds(tiny_llama, tmp_path):
    import subprocess
    import sys

    prompts = write_prompts(tmp_path / "prompts.jsonl")
    methods = build_methods(tiny_llama, ["plain", "hf_generate"])
    calls = {"n": 0}
    real = methods[0].run

    def stops_at_the_fourth_request(ids, max_new):
        calls["n"] += 1
        if calls["n"] == 5:  # warm-up + 3 requests (questions 1 and 2), then a stop
            raise KeyboardInterrupt
        return real(ids, max_new)

    methods[0].run = stops_at_the_fourth_request
    cfg = BenchConfig(name="tiny", path=str(prompts), max_new_tokens=6, warmup=1)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        run_benchmark(tiny_llama, methods, cfg, out)
    early = json.loads((out / "summary.json").read_text())  # written by the stopped run itself
    assert early["meta"]["stopped_early"] == "after 3 requests (Ctrl-C)"
    assert early["methods"]["plain"]["overall"]["requests"] == 3
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {(r["question_id"], r["method"]) for r in rows} == {
        (q, m) for q in (1, 2) for m in ("plain", "hf_generate")
    }
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "scripts/bench_report.py", str(out), "--group", "a=alpha"],
        capture_output=True, text=True, cwd=repo, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "### a" in proc.stdout and "| plain | 2 | 1.00 |" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["methods"]["hf_generate"]["overall"]["requests"] == 3
    assert (out / "report.md").is_file()


@pytest.mark.integration
def test_evaluate_logs_metrics_report_and_plots_to_wandb_offline(tmp_path, monkeypatch):
    from PIL import Image

    from eval.bench.harness import log_to_tracker
    from train.tracking import LoggerConfig

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens there
    Image.new("RGB", (8, 8), "blue").save(tmp_path / "tokens_per_s.png")
    (tmp_path / "report.md").write_text("| method | tau |\n")
    summary = {
        "methods": {"plain": {"overall": {"tau": 1.0}}, "medusa": {"overall": {"tau": 1.75}}}
    }
    logger = LoggerConfig(mode="offline", dir=str(tmp_path / "wb"))
    log_to_tracker(summary, tmp_path, logger, {"bench": {"name": "mt_bench"}})
    (run_dir,) = (tmp_path / "wb" / "wandb").glob("offline-run-*")

    def records() -> bytes:
        return b"".join(p.read_bytes() for p in run_dir.glob("*.wandb"))

    # wandb's writer process may still be flushing the offline file after finish() on a
    # loaded machine (seen with four CPU-bound jobs beside the suite); wait for it, bounded
    deadline = time.monotonic() + 30
    while b"bench/tokens_per_s" not in records() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert b"bench/medusa/tau" in records() and b"bench/tokens_per_s" in records()
    assert (run_dir / "files" / "report.md").is_file()
    # disabled: nothing is written
    log_to_tracker(summary, tmp_path / "off", LoggerConfig(mode="disabled"), {})
    assert not (tmp_path / "off" / "wandb").exists()
