"""OpenVINO targets in int8 and int4 weights (heads/interop/openvino_weights.py), several weight
types in one benchmark run, and each engine's fastest plain type (extra [openvino]).

- the compression pass computes exactly the numpy dequantisation it documents (per-row int8,
  grouped asymmetric int4, int8 where a row does not split into groups), and the weights it
  writes really are 8- and 4-bit (the error against f32 is far above rounding);
- a tiny Llama exported as an int8 / int4 target computes HF's logits with the same weights
  dequantised, through the stateful cache;
- a benchmark with `weights` [f32, int8] names every method per type, gives each draft its own
  type's plain baseline, and every OpenVINO method its speedup against the fastest plain
  OpenVINO type of the run (never across engines);
- bad weight types fail in one line; the results table names an IR's weight type.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.conftest import TINY_VOCAB
from tests.test_openvino import _feed, _fit_head, _settings, _tiny_target

pytest.importorskip("openvino_genai", reason="the [openvino] extra is part of set-up")


def _exact():
    import openvino as ov

    return {
        "INFERENCE_PRECISION_HINT": ov.Type.f32,
        "KV_CACHE_PRECISION": ov.Type.f32,
        "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0,  # no int8 activations: the weights alone differ
    }


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_compression_computes_its_numpy_dequantisation(kind):
    import openvino as ov
    from openvino import opset13 as ops

    from heads.interop.openvino_weights import compress_weights, dequantized

    rng = np.random.default_rng(0)
    x = ops.parameter([3, 64], ov.Type.f32)
    w1 = rng.standard_normal((48, 64)).astype(np.float32)  # stored [out, in] (transpose_b)
    w2 = rng.standard_normal((48, 40)).astype(np.float32)  # stored [in, out]; 48 = 1.5 groups
    h = ops.matmul(x, ops.constant(w1), False, True)
    y = ops.matmul(h, ops.constant(w2), False, False)
    model = ov.Model([h, y], [x])
    assert compress_weights(model, kind) == 2
    stored = {
        n.get_element_type()
        for n in model.get_ordered_ops()
        if n.get_type_name() == "Constant" and len(n.get_output_shape(0)) >= 2
    }
    assert ov.Type.i8 in stored  # w2's rows, and w1's for int8
    assert (ov.Type.u4 in stored) == (kind == "int4")
    xv = rng.standard_normal((3, 64)).astype(np.float32)
    got = ov.Core().compile_model(model, "CPU", _exact())(xv)
    d1 = dequantized(kind, w1)
    d2 = dequantized("int4", w2.T)  # in size 48 is no multiple of 32: int8 either way
    assert np.array_equal(d2, dequantized("int8", w2.T))
    want_h = xv @ d1.T
    np.testing.assert_allclose(got[0], want_h, atol=1e-4)
    np.testing.assert_allclose(got[1], got[0] @ d2.T, atol=1e-3)
    err = np.abs(xv @ w1.T - want_h).max()  # the compression is real, not a no-op
    assert err > (0.5 if kind == "int4" else 0.02)
    with pytest.raises(ValueError, match="int8"):
        compress_weights(model, "int2")


def _dequantised_copy(target, kind):
    """The tiny target with every linear weight (and the tied LM head) as `kind` stores it."""
    import copy

    from heads.interop.openvino_weights import dequantized

    model = copy.deepcopy(target.model)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                w = module.weight.detach().numpy()
                module.weight = torch.nn.Parameter(torch.from_numpy(dequantized(kind, w)))
    return model


@pytest.fixture(scope="module")
def typed_setup(tmp_path_factory):
    """(target, prompts, {weights: target folder}, draft folder)."""
    from heads.interop.openvino import export_openvino_draft, openvino_target_dir

    root = tmp_path_factory.mktemp("openvino_weights")
    torch.manual_seed(0)
    target = _tiny_target()
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(4, TINY_VOCAB, (16, 6), generator=gen)
    head = _fit_head(target, prompts, steps=40)
    dirs = {w: openvino_target_dir(target, root / "cache", w) for w in ("f32", "int8", "int4")}
    return target, prompts[:2], dirs, export_openvino_draft(head, target, root / "draft")


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_compressed_target_computes_hf_logits_of_its_dequantised_weights(typed_setup, kind):
    import openvino as ov

    from heads.interop.openvino import MODEL_XML

    target, prompts, dirs, _ = typed_setup
    assert dirs[kind].name.endswith(f"-{kind}") and dirs[kind] != dirs["f32"]
    size = (dirs[kind] / "openvino_model.bin").stat().st_size
    assert size < (dirs["f32"] / "openvino_model.bin").stat().st_size
    compiled = ov.Core().compile_model(str(dirs[kind] / MODEL_XML), "CPU", _exact())
    request = compiled.create_infer_request()
    ids = prompts[:1]
    n = ids.shape[1]
    got = _feed(request, ids)
    model = _dequantised_copy(target, kind)
    with torch.no_grad():
        want = model(ids).logits
        full = target.model(ids).logits
    assert torch.allclose(got, want, atol=2e-3, rtol=1e-4), (got - want).abs().max()
    assert (full - want).abs().max() > 20 * (got - want).abs().max()  # the types differ
    nxt = int(want[0, -1].argmax())
    got = _feed(request, torch.tensor([[nxt]]), past=n)
    with torch.no_grad():
        want = model(torch.cat([ids, torch.tensor([[nxt]])], 1)).logits[:, -1:]
    assert torch.allclose(got, want, atol=2e-3, rtol=1e-4)


@pytest.mark.integration
def test_a_run_of_several_weight_types_names_each_and_its_engines_fastest_plain(
    typed_setup, tmp_path
):
    from data.generation import eos_token_ids
    from eval.bench.harness import BenchConfig, BenchRun, run_benchmark
    from eval.bench.llama_cpp_targets import fastest_plain_lines
    from eval.bench.methods import build_methods
    from eval.bench.openvino import build_openvino_methods

    target, _, dirs, draft_dir = typed_setup
    prompts = tmp_path / "p.jsonl"
    texts = ["Tell me about the moon.", "Why is the sky blue?"]
    prompts.write_text(
        "".join(json.dumps({"id": i, "turns": [t]}) + "\n" for i, t in enumerate(texts))
    )
    folders = {w: str(dirs[w]) for w in ("f32", "int8")}
    settings = _settings(
        target_dir=folders, draft_dir=str(draft_dir), tree=3, weights=["f32", "int8"]
    )
    ov_methods = build_openvino_methods(
        ["openvino_plain", "openvino_draft"], settings, None, eos_token_ids(target)
    )
    names = [m.name for m in ov_methods]
    assert names == [
        "openvino_plain@f32",
        "openvino_draft@f32",
        "openvino_plain@int8",
        "openvino_draft@int8",
    ]
    assert [m.baseline for m in ov_methods] == [
        None,
        "openvino_plain@f32",
        None,
        "openvino_plain@int8",
    ]
    assert ov_methods[3].target_dir == folders["int8"]
    methods = build_methods(target, ["plain"]) + ov_methods
    bench = BenchConfig(path=str(prompts), max_new_tokens=24, warmup=1)
    meta_ov = {"weights": ["f32", "int8"]}
    try:
        summary = run_benchmark(
            target, methods, BenchRun(bench, meta={"openvino": meta_ov}), tmp_path / "out"
        )
    finally:
        for m in methods:
            getattr(m, "close", lambda: None)()
    got = summary["methods"]
    fastest = summary["meta"]["fastest_plain_by_engine"]["openvino"]
    assert fastest["method"] in ("openvino_plain@f32", "openvino_plain@int8")
    assert fastest["type"] == fastest["method"].split("@")[1]
    assert "fastest_plain" not in summary["meta"]  # llama.cpp's: no llama.cpp method ran
    best = got[fastest["method"]]["overall"]["tokens_per_s"]
    for name in names:
        m = got[name]["overall"]
        assert m["speedup_vs_fastest_plain"] == pytest.approx(m["tokens_per_s"] / best)
    assert "speedup_vs_fastest_plain" not in got["plain"]["overall"]
    assert got["openvino_draft@int8"]["baseline"] == "openvino_plain@int8"
    f32 = got["openvino_draft@f32"]["overall"]
    assert f32["baseline_mismatches"] == 0 and f32["greedy_mismatches"] == 0
    assert got["openvino_plain@int8"]["overall"]["tau"] == 1.0
    text = "\n".join(fastest_plain_lines(summary))
    assert "## OpenVINO against the fastest plain type" in text and "llama.cpp" not in text
    assert (tmp_path / "out" / "report.md").read_text().count("openvino_draft@int8") >= 2


@pytest.mark.integration
def test_bad_weight_types_fail_in_one_line(typed_setup, tmp_path):
    from data.errors import ConfigError
    from eval.bench.openvino import OpenVinoSettings
    from heads.interop.openvino import export_openvino_draft

    for bad in ("int3", ["f32", "f32"], []):
        with pytest.raises(ConfigError, match="openvino.weights") as err:
            OpenVinoSettings(weights=bad)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="draft_weights"):
        OpenVinoSettings(draft_weights="int8")
    assert OpenVinoSettings(weights=["f32", "int4"]).weights == ["f32", "int4"]
    target = typed_setup[0]
    head = _fit_head(target, typed_setup[1], steps=1)
    with pytest.raises(ConfigError, match="f32 or f16"):
        export_openvino_draft(head, target, tmp_path / "never", weights="int4")
    assert not (tmp_path / "never").exists()


def test_the_results_table_names_an_ir_weight_type_and_the_engines_fastest_plain():
    from lab import results_table

    meta = {
        "openvino": {"weights": ["f32", "int4"]},
        "fastest_plain": {"method": "llama_cpp_plain", "type": "q4_0", "tokens_per_s": 90.0},
        "fastest_plain_by_engine": {
            "openvino": {"method": "openvino_plain@int4", "type": "int4", "tokens_per_s": 70.0},
        },
    }
    assert results_table._target(meta, "openvino_draft@int4") == "INT4 IR"
    assert results_table._target({"openvino": {"weights": "f16"}}, "openvino_draft") == "F16 IR"
    entry = {
        "overall": {"speedup_vs_plain": 1.1, "speedup_vs_fastest_plain": 0.9},
        "baseline": "openvino_plain@f32",
    }
    text = results_table._speedup(meta, "openvino_draft@f32", entry)
    assert text.endswith("; 0.90x vs fastest plain (INT4)")  # OpenVINO's, not llama.cpp's Q4_0
    own = {**entry, "baseline": "openvino_plain@int4"}
    assert "fastest" not in results_table._speedup(meta, "openvino_draft@int4", own)
