"""lab/throughput/measure.py (scripts/bench_train_throughput.py): the feature, training-step and
disk cache measurements on a tiny target, and the markdown report written from them."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data.features import compute_features
from heads.eagle3 import Eagle3Config, default_aux_layers
from heads.medusa import MedusaConfig
from lab.throughput.measure import (
    ThroughputSettings,
    default_heads,
    extraction,
    feature_error,
    measure,
    train_steps,
)
from lab.throughput.report import markdown

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (12, 5, 9, 4, 11, 6, 8, 3)


def make_examples(lengths=LENGTHS, vocab=256, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(4, vocab, (n,), generator=gen),
            "loss_mask": (torch.arange(n) >= n // 3).long(),
        }
        for n in lengths
    ]


def test_feature_error_is_nil_for_the_same_features_and_grows_with_noise(tiny_llama):
    layers = default_aux_layers(tiny_llama.num_layers)
    want = compute_features(make_examples(), tiny_llama, layers, dtype=torch.float32)
    same = feature_error(tiny_llama, want, want)
    assert same["hidden_cosine"] == pytest.approx(1.0) and same["aux_cosine"] == pytest.approx(1.0)
    assert same["hidden_rel_err"] == 0 and same["lm_head_top1_agree"] == 1.0
    gen = torch.Generator().manual_seed(1)
    noisy = [
        {**e, "hidden": e["hidden"] + 0.5 * torch.randn(e["hidden"].shape, generator=gen)}
        for e in want
    ]
    off = feature_error(tiny_llama, want, noisy)
    assert off["hidden_rel_err"] > 0.05 and off["hidden_cosine"] < 1.0
    assert off["aux_rel_err"] == 0  # only "hidden" was disturbed


def test_extraction_times_three_variants_of_the_same_features(tiny_llama):
    examples = make_examples()
    result, fp32 = extraction(tiny_llama, examples, default_aux_layers(tiny_llama.num_layers))
    assert result["tokens"] == sum(LENGTHS) and len(fp32) == len(examples)
    assert fp32[0]["hidden"].dtype == torch.float32
    for name in ("fp32", "bf16_weights", "bf16_autocast"):
        assert result[name]["tokens_per_s"] > 0
    for name in ("bf16_weights", "bf16_autocast"):  # bf16 rounding, not other features
        assert 0.98 < result[name]["hidden_cosine"] <= 1.0 + 1e-6
        assert 0 < result[name]["hidden_rel_err"] < 0.2
        assert 0 <= result[name]["lm_head_top1_agree"] <= 1
    assert "hidden_cosine" not in result["fp32"]


def test_train_steps_time_every_variant_on_the_same_batches(tiny_llama):
    layers = default_aux_layers(tiny_llama.num_layers)
    features = compute_features(make_examples(), tiny_llama, layers, dtype=torch.float32)
    config = MedusaConfig(num_heads=2)
    variants = {"padded": (config, None), "packed": (config, 24)}
    runs = train_steps(tiny_llama, features, batch_size=2, steps=2, variants=variants)
    assert set(runs) == {"padded", "packed"}
    # three batches of two (one warm-up, two timed), the same tokens either way
    timed = sum(LENGTHS[2:6])
    for r in runs.values():
        assert r["steps"] == 2 and r["tokens"] == timed and r["tokens_per_s"] > 0
        assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"])
    assert runs["padded"]["padding"] > runs["packed"]["padding"] >= 0
    assert runs["padded"]["losses"][0] == pytest.approx(runs["packed"]["losses"][0], abs=1e-3)


def test_measure_and_its_report(tiny_llama, tmp_path):
    settings = ThroughputSettings(
        heads=["medusa", "eagle3"], parts=["train", "disk"], batch_size=2, steps=1, pack_tokens=24
    )
    configs = {"medusa": MedusaConfig(num_heads=2), "eagle3": Eagle3Config(ttt_steps=2)}
    logged = []
    layers = default_aux_layers(tiny_llama.num_layers)
    report = measure(tiny_llama, make_examples(), layers, settings, configs, log=logged.append)
    assert "extraction" not in report and len(logged) == 3  # two heads, then the disk cache
    assert set(report["train"]["medusa"]) == {"padded", "packed", "packed, bf16 autocast"}
    eagle3 = set(report["train"]["eagle3"])  # it derives per-example targets; masks its vocab
    assert {"packed, example targets", "padded, mask_outside_vocab=false"} <= eagle3
    disk = report["disk_cache"]
    assert disk["tokens"] == sum(LENGTHS) and disk["bytes_per_token"] > 0
    header = {"command": "cmd", "machine": "m", "examples": 8, "max_length": 16, "batch_size": 2}
    text = markdown(header | report)
    assert "## Training steps" in text and "## Disk feature cache" in text
    assert "## Feature extraction" not in text
    rows = [line for line in text.splitlines() if line.startswith(("| medusa |", "| eagle3 |"))]
    assert len(rows) == 2
    assert "- eagle3 packed, example targets:" in text


@pytest.mark.integration
def test_settings_refuse_an_unknown_part_and_the_script_parses():
    with pytest.raises(ValueError, match="parts \\['bogus'\\]"):
        ThroughputSettings(heads=[], parts=["bogus"])
    assert "eagle3" in default_heads() and "medusa2" not in default_heads()
    script = ROOT / "scripts" / "bench_train_throughput.py"
    proc = subprocess.run([sys.executable, str(script), "--parts", "bogus"], capture_output=True)
    assert proc.returncode == 2 and b"invalid choice: 'bogus'" in proc.stderr
