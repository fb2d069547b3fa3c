"""OpenVINO GenAI as a second CPU engine, with the real `openvino-genai` wheel (extra [openvino]).

A tiny random Llama (4 layers, the ChatML character tokenizer of conftest.py) and an EAGLE-3
head fitted for a few seconds to the target's own greedy answers are exported with
heads/interop/openvino.py; then
- the target IR computes HF's logits, the draft IR records our layer ids and d2t;
- GenAI's plain decoding equals HF greedy, and GenAI drafting with our head (a chain, and an
  EAGLE-2 tree: branching_factor / tree_depth) returns the same tokens with the harness's
  acceptance on the same prompts, step by step within the tolerance justified at TAU_TOL (the
  parity that catches a wrong hidden-layer convention, fc placement, norm, rope or d2t
  direction in the export; a negative control with layer ids off by one shows it does);
- the benchmark runs both methods beside the HF ones; bad settings, heads GenAI cannot serve
  (not EAGLE-3, fc_norm, norm_output) and a missing extra fail with one line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY_VOCAB, diverse, make_llama, make_tokenizer

ROOT = Path(__file__).resolve().parents[1]
AUX = [1, 2, 3]  # HF hidden_states indices: GenAI's layer ids are these - 1
PROMPT_LEN, NEW_TOKENS, FIT_PROMPTS, PARITY_PROMPTS = 6, 40, 16, 6
CHAIN, TREE = 3, {"depth": 3, "top_k": 2, "total_tokens": 7}  # GenAI: branching_factor 2
# Acceptance tolerance. Both engines compute in f32 (INFERENCE_PRECISION_HINT and
# KV_CACHE_PRECISION f32 against torch f32), so they differ by rounding only (other kernels and
# summation orders: ~1e-6 relative on a logit). Rounding changes a draft token only at a near tie
# of the draft's top two logits; that changes one step's accept length (by at most the depth)
# and shifts the rest of that prompt. So at most one prompt of PARITY_PROMPTS may differ step by
# step, and the pooled tau (~58 steps: one flipped step of at most 3 tokens moves it by ~0.05)
# by at most TAU_TOL, about two such flips. Measured: 0 prompts differ and tau is equal (chain
# 3.259, tree 3.316); the negative control below (layer ids off by one) differs in 5 of 6
# prompts, tau 2.39 against 3.26.
MAX_DIVERGED, TAU_TOL = 1, 0.1


def _tiny_target():
    """Logits scaled up 10x (final norm) so that the target's softmax is peaked: a head fitted
    to it for a few steps learns its argmax instead of a near-uniform distribution."""
    from heads.target import Target

    model = diverse(make_llama(layers=4), std=0.15)
    with torch.no_grad():
        model.model.norm.weight.mul_(10.0)
    return Target.from_model(model, make_tokenizer(), name_or_path="tiny-llama-4")


def _fit_head(target, prompts: torch.Tensor, steps: int):
    """An EAGLE-3 head (reduced vocabulary, so d2t is not the identity) fitted to the target's
    greedy answers to `prompts`: acceptance well between none and all on those prompts."""
    from heads.eagle3 import Eagle3Config, Eagle3Head

    ones = torch.ones_like(prompts)
    with torch.no_grad():
        ids = target.model.generate(
            prompts,
            attention_mask=ones,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, PROMPT_LEN:] = 1
    counts = torch.bincount(ids.flatten(), minlength=TINY_VOCAB).float()
    config = Eagle3Config(aux_layers=AUX, draft_vocab_size=TINY_VOCAB // 2, ttt_steps=3)
    torch.manual_seed(0)
    head = Eagle3Head.for_target(config, target, counts)
    features = target.features(ids, torch.ones_like(ids), layers=AUX)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        loss = head.loss(batch, features).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


@pytest.fixture(scope="module")
def ov_setup(tmp_path_factory):
    """(target, head, prompts, target_dir, draft_dir), exported once per module."""
    from heads.interop.openvino import export_openvino_draft, openvino_target_dir

    root = tmp_path_factory.mktemp("openvino")
    torch.manual_seed(0)
    target = _tiny_target()
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(4, TINY_VOCAB, (FIT_PROMPTS, PROMPT_LEN), generator=gen)
    head = _fit_head(target, prompts, steps=40)
    target_dir = openvino_target_dir(target, root / "cache")
    draft_dir = export_openvino_draft(head, target, root / "draft")
    return target, head, prompts[:PARITY_PROMPTS], target_dir, draft_dir


def _settings(**kw):
    from eval.bench.openvino import OpenVinoSettings

    return OpenVinoSettings(threads=1, **kw)


def _clip(lengths: list[int], budget: int) -> list[int]:
    """Accept lengths as emitted within `budget` decode tokens (the last step may be cut)."""
    out, left = [], budget
    for n in lengths:
        if left <= 0:
            break
        out.append(min(n, left))
        left -= out[-1]
    return out


def _feed(request, ids: torch.Tensor, past: int = 0) -> torch.Tensor:
    """Logits of the stateful target IR for `ids` ([1, n]) after `past` tokens already fed."""
    import numpy as np

    n = ids.shape[1]
    out = request.infer(
        {
            "input_ids": ids.numpy().astype(np.int64),
            "attention_mask": np.ones((1, past + n), dtype=np.int64),
            "position_ids": np.arange(past, past + n, dtype=np.int64)[None],
            "beam_idx": np.zeros(1, dtype=np.int32),
        }
    )
    return torch.from_numpy(out["logits"].copy())


@pytest.mark.integration
def test_target_ir_computes_hf_logits_and_the_draft_ir_carries_our_layout(ov_setup):
    import openvino as ov

    from heads.interop.openvino import MODEL_XML

    target, head, prompts, target_dir, draft_dir = ov_setup
    exact = {"INFERENCE_PRECISION_HINT": ov.Type.f32, "KV_CACHE_PRECISION": ov.Type.f32}
    compiled = ov.Core().compile_model(str(target_dir / MODEL_XML), "CPU", exact)
    request = compiled.create_infer_request()
    ids = prompts[:1]
    n = ids.shape[1]
    got = _feed(request, ids)
    with torch.no_grad():
        want = target.model(ids).logits
    assert torch.allclose(got, want, atol=1e-3, rtol=1e-4), (got - want).abs().max()
    # one more token through the stateful cache
    nxt = int(want[0, -1].argmax())
    got = _feed(request, torch.tensor([[nxt]]), past=n)
    with torch.no_grad():
        want = target.model(torch.cat([ids, torch.tensor([[nxt]])], 1)).logits[:, -1:]
    assert torch.allclose(got, want, atol=1e-3, rtol=1e-4)

    draft = ov.Core().read_model(str(draft_dir / MODEL_XML))
    assert draft.get_rt_info(["eagle3_mode"]).astype(str) == "True"
    layer_ids = draft.get_rt_info(["hidden_layers_list"]).astype(str).split()
    assert [int(i) for i in layer_ids] == [0, 1, 2]
    d2t = draft.output("d2t").get_node().input_value(0).get_node()
    assert d2t.get_friendly_name() == "d2t"
    assert torch.equal(torch.from_numpy(d2t.get_data().copy()), head.d2t)
    assert not torch.equal(head.d2t, torch.zeros_like(head.d2t))  # a real mapping, not identity
    config = json.loads((draft_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draftsmith"]["openvino_hidden_layers_list"] == [0, 1, 2]


@pytest.mark.integration
def test_target_folder_is_cached_by_weights(ov_setup, tmp_path):
    from heads.interop.openvino import MODEL_XML, openvino_target_dir, weights_digest

    target, _, _, target_dir, _ = ov_setup
    stamp = (target_dir / MODEL_XML).stat().st_mtime_ns
    assert openvino_target_dir(target, target_dir.parents[1]) == target_dir
    assert (target_dir / MODEL_XML).stat().st_mtime_ns == stamp  # not converted again
    assert (target_dir / "openvino_tokenizer.xml").is_file()
    other = _tiny_target()
    with torch.no_grad():
        other.model.model.layers[1].mlp.down_proj.weight.mul_(1.01)
    # the same sign fingerprint, other weights: another folder
    assert other.fingerprint == target.fingerprint
    assert weights_digest(other.model) != weights_digest(target.model)


def _harness(target, head, tree, ids):
    from eval.bench.methods import head_method

    return head_method(target, "head", head, tree).generator.generate(ids, NEW_TOKENS)


@dataclass
class Parity:
    """GenAI drafting against the harness on the same prompts (tau: mean accept length per
    decode step, the bonus token included, pooled over the prompts)."""

    diverged: int  # prompts whose per-step accept lengths are not the harness's, step by step
    harness_tau: float
    genai_tau: float
    steps: int  # the harness's decode steps

    def within_tolerance(self) -> bool:
        return self.diverged <= MAX_DIVERGED and abs(self.genai_tau - self.harness_tau) <= TAU_TOL


def _parity(ov_setup, tree, draft_dir) -> Parity:
    """Run openvino_plain and openvino_draft (draft_dir, `tree`) and the harness on every parity
    prompt; GenAI's tokens must equal HF greedy's (lossless), its acceptance is returned."""
    from data.generation import eos_token_ids
    from eval.bench.openvino import build_openvino_methods
    from eval.engine.generator import plain_greedy
    from eval.engine.tree_spec import resolve_tree

    target, head, prompts, target_dir, _ = ov_setup
    eos = eos_token_ids(target)
    settings = _settings(target_dir=str(target_dir), draft_dir=str(draft_dir), tree=tree)
    names = ["openvino_plain", "openvino_draft"]
    plain, draft = build_openvino_methods(names, settings, None, eos)
    assert draft.baseline == "openvino_plain" and draft.max_draft_depth == resolve_tree(tree).depth
    diverged, harness_all, genai_all = 0, [], []
    try:
        for p in prompts:
            ids = p[None]
            want = plain_greedy(target.model, ids, NEW_TOKENS, eos_token_id=eos)
            want = want.new_tokens.tolist()
            assert plain.run(ids, NEW_TOKENS).tokens == want
            got = draft.run(ids, NEW_TOKENS)
            assert got.tokens == want  # lossless, whatever the draft proposes
            assert got.target_forwards == 1 + len(got.accept_lengths)
            harness = _harness(target, head, resolve_tree(tree), ids)
            mine = _clip(list(harness.accept_lengths), len(want) - 1)
            diverged += got.accept_lengths != mine
            harness_all += mine
            genai_all += got.accept_lengths
    finally:
        plain.close()
        draft.close()
    return Parity(
        diverged,
        sum(harness_all) / len(harness_all),
        sum(genai_all) / len(genai_all),
        len(harness_all),
    )


@pytest.mark.integration
@pytest.mark.parametrize("tree", [CHAIN, TREE], ids=["chain", "tree"])
def test_genai_drafting_matches_the_harness_acceptance(ov_setup, tree):
    from eval.engine.tree_spec import resolve_tree

    got = _parity(ov_setup, tree, ov_setup[4])
    assert got.within_tolerance(), got
    # the head accepts some drafts and rejects others, so the comparison has teeth
    depth = resolve_tree(tree).depth
    assert 1.2 < got.harness_tau < depth + 1 - 0.2, got


@pytest.mark.integration
def test_a_wrong_layer_convention_falls_outside_the_tolerance(ov_setup, tmp_path, monkeypatch):
    """The negative control: the same head exported with GenAI layer ids = aux_layers (the
    off-by-one the export exists to get right) still decodes losslessly, but its acceptance
    leaves the tolerance."""
    import heads.interop.openvino as ov_export

    target, head = ov_setup[:2]
    monkeypatch.setattr(ov_export, "genai_layer_ids", lambda aux, n: [int(i) for i in aux])
    wrong = ov_export.export_openvino_draft(head, target, tmp_path / "wrong")
    got = _parity(ov_setup, CHAIN, wrong)
    assert not got.within_tolerance(), got


@pytest.mark.integration
def test_benchmark_runs_openvino_methods_beside_hf(ov_setup, tmp_path):
    from data.generation import eos_token_ids
    from eval.bench.harness import BenchConfig, BenchRun, run_benchmark
    from eval.bench.methods import build_methods
    from eval.bench.openvino import build_openvino_methods

    target, _, _, target_dir, draft_dir = ov_setup
    prompts = tmp_path / "p.jsonl"
    texts = ["Tell me about the moon.", "Why is the sky blue?"]
    prompts.write_text(
        "".join(json.dumps({"id": i, "turns": [t]}) + "\n" for i, t in enumerate(texts))
    )
    settings = _settings(target_dir=str(target_dir), draft_dir=str(draft_dir), tree=CHAIN)
    methods = build_methods(target, ["plain", "hf_generate"])
    methods += build_openvino_methods(
        ["openvino_plain", "openvino_draft"], settings, None, eos_token_ids(target)
    )
    bench = BenchConfig(path=str(prompts), max_new_tokens=24, warmup=1)
    try:
        summary = run_benchmark(target, methods, BenchRun(bench), tmp_path / "out")
    finally:
        for m in methods:
            getattr(m, "close", lambda: None)()
    got = summary["methods"]
    draft = got["openvino_draft"]["overall"]
    assert got["openvino_draft"]["baseline"] == "openvino_plain"
    assert draft["baseline_mismatches"] == 0 and draft["greedy_mismatches"] == 0
    assert got["openvino_plain"]["overall"]["tau"] == 1.0
    assert draft["speedup_vs_plain"] is not None and len(draft["accept_rate_by_depth"]) == CHAIN
    assert (tmp_path / "out" / "report.md").is_file()


@pytest.mark.integration
def test_evaluate_resolves_the_cached_target_and_exports_the_draft(ov_setup, tmp_path):
    """evaluate.py's path (harness._engine_methods) with conf/evaluate.yaml's own openvino block:
    the target folder comes from the model cache, the draft is exported into the run dir."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from data.errors import ConfigError
    from eval.bench.harness import _engine_methods
    from eval.bench.openvino import OpenVinoSettings
    from eval.engine.tree_spec import resolve_tree
    from heads.interop.openvino import MODEL_XML

    target, head, _, target_dir, _ = ov_setup
    defaults = OmegaConf.load(ROOT / "conf" / "evaluate.yaml").openvino
    assert set(defaults) == set(OpenVinoSettings.__dataclass_fields__)
    cfg = OmegaConf.create(
        {
            "openvino": OmegaConf.merge(defaults, {"tree": TREE, "threads": 1}),
            "model": {"cache_dir": str(target_dir.parents[1])},
            "methods": ["plain", "openvino_plain", "openvino_draft"],
            "out_dir": str(tmp_path),
        }
    )
    names, meta = ["openvino_plain", "openvino_draft"], {}
    run_target = SimpleNamespace(target=target)  # what _engine_methods reads of a RunTarget
    methods = _engine_methods(cfg, names, head, run_target, resolve_tree(3), meta)
    assert [m.name for m in methods] == names and methods[1].draft["branching_factor"] == 2
    assert meta["openvino"]["target_dir"] == str(target_dir)  # the fixture's export, not a new one
    assert (tmp_path / "openvino-draft" / MODEL_XML).is_file()
    assert meta["openvino"]["draft_dir"] == str(tmp_path / "openvino-draft")
    cfg.out_dir = str(tmp_path / "other")
    with pytest.raises(ConfigError, match="head_path"):
        _engine_methods(cfg, names, None, run_target, resolve_tree(3), {})


def test_bad_settings_fail_in_one_line(tiny_llama):
    from data.errors import ConfigError
    from eval.bench.openvino import OpenVinoSettings, genai_draft_config
    from eval.engine.tree_spec import resolve_tree
    from heads.interop.openvino import export_openvino_target, genai_layer_ids

    assert genai_layer_ids([2, 5, 9], 12) == [1, 4, 8]
    for aux in ([0, 1, 2], [1, 1, 2], [1, 2], [1, 2, 12]):
        with pytest.raises(ConfigError, match="aux_layers"):
            genai_layer_ids(aux, 12)
    assert genai_draft_config(resolve_tree(4)) == {"num_assistant_tokens": 4}
    dynamic = resolve_tree({"depth": 4, "top_k": 4, "total_tokens": 16})
    assert genai_draft_config(dynamic) == {
        "num_assistant_tokens": 15,
        "branching_factor": 4,
        "tree_depth": 4,
    }
    with pytest.raises(ConfigError, match="chain or an EAGLE-2"):
        genai_draft_config(resolve_tree([[0], [1], [0, 0]]))
    with pytest.raises(ConfigError, match="must lie in"):
        genai_draft_config(resolve_tree({"depth": 5, "top_k": 1, "total_tokens": 4}))
    with pytest.raises(ConfigError, match="kv_cache_precision"):
        OpenVinoSettings(kv_cache_precision="q4")
    tiny_llama.model.config._attn_implementation = "eager"
    with pytest.raises(ConfigError, match="sdpa"):
        export_openvino_target(tiny_llama, "/nonexistent/never-written")


@pytest.mark.parametrize("switch", ["fc_norm", "norm_output"])
def test_drafts_genai_cannot_serve_are_refused(tokenizer, switch):
    from data.errors import ConfigError
    from heads.eagle3 import Eagle3Config, Eagle3Head
    from heads.interop.openvino import export_openvino_draft
    from heads.medusa import MedusaConfig, MedusaHeads
    from heads.target import Target

    target = Target.from_model(make_llama(layers=4), tokenizer, name_or_path="tiny-llama-4")
    config = Eagle3Config(aux_layers=AUX, draft_vocab_size=None, **{switch: True})
    head = Eagle3Head.for_target(config, target)  # an EAGLE-3.1 option GenAI has no step for
    with pytest.raises(ConfigError, match=f"head.{switch}=true.*train with head.{switch}=false"):
        export_openvino_draft(head, target, "/nonexistent/never-written")
    medusa = MedusaHeads.for_target(MedusaConfig(num_heads=2), target)
    with pytest.raises(ConfigError, match="EAGLE-3") as err:
        export_openvino_draft(medusa, target, "/nonexistent/never-written")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("missing", ["openvino", "openvino_genai"])
def test_without_the_extra_openvino_methods_fail_in_one_line(monkeypatch, missing):
    """methods naming OpenVINO are refused before anything loads when the extra is missing."""
    import sys

    from data.errors import DraftsmithError
    from eval.bench.harness import check_methods

    monkeypatch.setitem(sys.modules, missing, None)  # `import missing` raises ImportError
    with pytest.raises(DraftsmithError, match=r"pip install -e '\.\[openvino\]'") as err:
        check_methods(["plain", "openvino_plain"], has_head=False)
    assert "\n" not in str(err.value) and missing in str(err.value)
    assert check_methods(["plain", "llama_cpp_ngram"], has_head=False)  # others unaffected
