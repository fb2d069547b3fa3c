"""lab/analysis/target_quality.py (scripts/target_quality.py): the target's own loss with and
without a Medusa-2 adapter, on a tiny random target."""

from __future__ import annotations

import pytest
import torch
from conftest import make_llama, make_tokenizer

from heads.medusa2 import Medusa2Config, Medusa2Head
from heads.target import Target
from lab.analysis.target_quality import DEFAULT_SETS, held_out, quality_report, score

OASST = "data/corpora/oasst_en/conversations.jsonl"


def medusa2() -> tuple[Target, Medusa2Head]:
    torch.manual_seed(0)
    target = Target.from_model(make_llama(), make_tokenizer(), name_or_path="tiny-llama")
    return target, Medusa2Head.for_target(Medusa2Config(num_heads=2, lora_rank=4), target)


def examples(rows: int = 2, length: int = 20) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    mask = torch.zeros(length, dtype=torch.long)
    mask[length // 2 :] = 1
    return [{"input_ids": torch.randint(4, 256, (length,), generator=g), "loss_mask": mask}
            for _ in range(rows)]  # fmt: skip


def test_held_out_takes_a_slice_of_the_file():
    assert held_out(f"{OASST}:2:5") == held_out(f"{OASST}:0:5")[2:]
    assert len(held_out(f"{OASST}:2:5")) == 3
    assert all(spec.count(":") >= 2 for spec in DEFAULT_SETS)


def test_a_fresh_adapter_leaves_the_target_unchanged_and_a_trained_one_shows():
    target, head = medusa2()
    got = score(target, head, examples())
    assert got["tokens"] == 2 * 10  # the positions whose next token is an answer token
    assert got["kl"] == pytest.approx(0.0, abs=1e-6) and got["agree"] == 1.0  # LoRA B starts at 0
    assert got["ce_adapted"] == pytest.approx(got["ce_original"])
    assert got["ppl_original"] == pytest.approx(float(torch.tensor(got["ce_original"]).exp()))
    with torch.no_grad():
        for name, p in head.adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    moved = score(target, head, examples())
    assert moved["kl"] > 1e-4 and moved["ce_original"] == pytest.approx(got["ce_original"])
    assert moved["ce_change_pct"] == pytest.approx(
        100 * (moved["ce_adapted"] / moved["ce_original"] - 1)
    )


def test_the_report_scores_each_set_and_logs_a_line():
    target, head = medusa2()
    lines = []
    spec = f"{OASST}:0:2"
    report = quality_report(target, head, [spec], 1024, log=lines.append)
    scores = report["sets"][spec]
    assert scores["conversations"] == 2 and scores["tokens"] > 0
    assert len(lines) == 1 and lines[0].startswith(f"{spec} {{") and '"kl": 0.0' in lines[0]
