"""eval/publish/export.py: export a run's head, prove the folder by a round trip, write the
model card."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
import yaml
from conftest import diverse

import heads
from eval.publish.export import ExportCheckError, export_draft, export_run, find_head
from heads.eagle3 import Eagle3Config, Eagle3Head
from heads.medusa import MedusaConfig, MedusaHeads
from heads.target import Target


@pytest.fixture
def target(tokenizer):
    from conftest import make_llama

    return Target.from_model(diverse(make_llama()), tokenizer, name_or_path="tiny-llama")


def randomise(head, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return head


def make_run(tmp_path, head) -> str:
    """A run dir as train.py leaves it: config.yaml, data_stats.json, best.json, best_head/."""
    run = tmp_path / "run"
    head.save_pretrained(run / "best_head")
    config = {
        "model": {"name_or_path": "tiny-llama"},
        "data": {"self_distill": {"enabled": True, "max_new_tokens": 64,
                                  "prompts": [{"path": "p.jsonl", "skip": 4, "max_rows": 10}]}},
        "trainer": {"max_steps": 7, "batch_size": 2, "lr": 0.001},
    }  # fmt: skip
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    stats = {"train": {"examples": 10, "tokens": 900, "loss_tokens": 500}}
    (run / "data_stats.json").write_text(json.dumps(stats))
    (run / "best.json").write_text(json.dumps({"metric": "eval/tau", "value": 1.5, "step": 7}))
    return str(run)


def eagle3(target):
    counts = torch.arange(target.vocab_size).float()
    return randomise(Eagle3Head.for_target(Eagle3Config(draft_vocab_size=96), target, counts))


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


@pytest.mark.parametrize("fmt", ["native", "eagle3"])
def test_export_writes_a_proved_folder_and_a_card(fmt, target, tmp_path):
    run = make_run(tmp_path, eagle3(target))
    out = tmp_path / "out"
    result = export_draft(run, fmt, out, target=target, check_prompts=2, check_tokens=8)
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".out.*"))
    umask = os.umask(0)
    os.umask(umask)  # readable like any file the user writes (mkdtemp alone would give 0700)
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o666 & ~umask
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    check = result.check
    assert check["tau_head"] == check["tau_export"] and check["tau_head"] >= 1.0
    reloaded = heads.from_pretrained(out, target)  # both formats load back through one door
    assert reloaded.method == "eagle3"
    card = (out / "README.md").read_text()
    meta = front_matter(card)
    # a local name is no Hub model: the card names it in its text, not as base_model
    assert "base_model" not in meta and meta["library_name"] == "draftsmith"
    assert "# " in card and "for `tiny-llama`" in card
    assert {"speculative-decoding", "draftsmith", "eagle3"} <= set(meta["tags"])
    assert "Self-distilled" in card and "`p.jsonl` (prompts 5-14)" in card
    assert "10 conversations, 900 tokens, 500 of them trained on" in card
    assert f"tau {check['tau_export']:.3f}" in card
    if fmt == "eagle3":
        assert '"method": "eagle3"' in card and "--speculative-algorithm EAGLE3" in card
    assert json.loads((out / "export.json").read_text())["format"] == fmt


def test_a_folder_that_decodes_differently_is_not_written(tokenizer, tmp_path, monkeypatch):
    from conftest import make_llama

    from heads import interop

    # At its default init the tiny Llama repeats one token, and fresh Medusa heads (zero blocks,
    # the target's own lm_head rows) propose it: every draft token is accepted.
    target = Target.from_model(make_llama(), tokenizer, name_or_path="tiny-llama")
    head = MedusaHeads.for_target(MedusaConfig(num_heads=2), target)
    real = interop.import_draft

    def broken(path, target):  # a mapping bug: the projection rows come back shifted by one id
        head = real(path, target)
        with torch.no_grad():
            for proj in head.proj:
                proj.copy_(proj.roll(1, dims=0))
        return head

    run = make_run(tmp_path, head)
    good = export_draft(run, "medusa", tmp_path / "good", target=target, check_prompts=2,
                        check_tokens=8)  # fmt: skip
    assert good.check["tau_head"] > 2.0  # 2 heads: up to 3 tokens a forward
    monkeypatch.setattr(interop, "import_draft", broken)
    out = tmp_path / "out"
    with pytest.raises(ExportCheckError, match="decodes differently"):
        export_draft(run, "medusa", out, target=target, check_prompts=2, check_tokens=8)
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_medusa_export_with_a_benchmark_in_the_card(target, tmp_path):
    counts = torch.arange(target.vocab_size).float()
    head = randomise(MedusaHeads.for_target(MedusaConfig(num_heads=2, draft_vocab_size=96),
                                            target, counts))  # fmt: skip
    bench = tmp_path / "bench"
    bench.mkdir()
    overall = {"tau": 1.7, "tokens_per_s": 20.0, "speedup_vs_plain": 1.3, "greedy_mismatches": 0,
               "requests": 12}  # fmt: skip
    summary = {
        "meta": {"bench": {"name": "mt_bench", "max_new_tokens": 64}, "num_requests": 12,
                 "device": "cpu", "threads": 2},
        "definitions": {"tau": "acceptance length, defined here"},
        "methods": {"plain": {"overall": {**overall, "tau": 1.0}}, "medusa": {"overall": overall}},
    }  # fmt: skip
    (bench / "summary.json").write_text(json.dumps(summary))
    (bench / "tokens_per_s.png").write_bytes(b"\x89PNG fake")
    out = tmp_path / "out"
    result = export_draft(make_run(tmp_path, head), "medusa", out, target=target, bench=bench,
                          check_prompts=2, check_tokens=8)  # fmt: skip
    assert result.check["tree"] == "2"  # a chain as deep as the two heads
    card = (out / "README.md").read_text()
    assert "| medusa | 1.70 | 20.00 | 1.30 | 0 | 12 |" in card
    assert "- **tau**: acceptance length, defined here" in card
    assert "![tokens_per_s](plots/tokens_per_s.png)" in card
    assert (out / "plots" / "tokens_per_s.png").read_bytes() == b"\x89PNG fake"
    assert '"method": "medusa"' in card and '"num_speculative_tokens": 2' in card


def test_bad_sources_and_options_are_refused(target, tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a head folder"):
        find_head(tmp_path)
    run = make_run(tmp_path, eagle3(target))
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError, match="--overwrite"):
        export_draft(run, "eagle3", tmp_path / "out", target=target)
    with pytest.raises(ValueError, match="use one of"):
        export_draft(run, "gguf", tmp_path / "out2", target=target)
    with pytest.raises(ValueError, match=r"\{format\}"):
        export_run(run, {"formats": ["eagle3", "native"], "push_to_hub": "me/draft"})
    assert find_head(run)[0].name == "best_head"


def test_the_command_line_reports_failures(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "export.py"
    spec = importlib.util.spec_from_file_location("export_cli", path)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    code = cli.main([str(tmp_path), "--format", "eagle3", "--out", str(tmp_path / "o")])
    assert code == 1 and "export failed: " in capsys.readouterr().err


def test_the_command_line_prints_each_exports_summary(tmp_path, monkeypatch, capsys):
    """The flags reach export_draft / export_gguf_run, and their results print as one summary
    (the exports themselves stood in for)."""
    import importlib.util
    from pathlib import Path

    from eval.publish import export as export_module
    from eval.publish import gguf_export
    from eval.publish.export import ExportResult

    path = Path(__file__).resolve().parents[1] / "scripts" / "export.py"
    spec = importlib.util.spec_from_file_location("export_cli", path)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    calls = []
    check = {"prompts": 4, "tau_export": 1.5, "tau_head": 1.5}

    def fake_export(source, fmt, out, **kw):
        calls.append((fmt, kw))
        return ExportResult(out, fmt, {}, check, url="https://hub/me/d" if kw["push"] else None)

    proof = {"identical": 3, "prompts": 4, "near_tie_divergences": [1],
             "llama_cpp_accepted": 10, "harness_accepted": 11}  # fmt: skip

    def fake_gguf(source, out, **kw):
        calls.append(("gguf", kw))
        return {"draft": "draft-q8_0.gguf", "spec_type": "draft-eagle3", "check": proof}

    monkeypatch.setattr(export_module, "export_draft", fake_export)
    monkeypatch.setattr(gguf_export, "export_gguf_run", fake_gguf)
    out = tmp_path / "o"
    assert cli.main(["run", "--format", "eagle3", "--out", str(out), "--push-to-hub", "me/d"]) == 0
    assert capsys.readouterr().out == (
        f"wrote {out} (eagle3); round trip on 4 prompts: tau 1.500 = head 1.500\n"
        "pushed: https://hub/me/d\n"
    )
    assert calls[-1][1] == {"bench": None, "push": "me/d", "private": True, "overwrite": False,
                            "check_prompts": 4, "check_tokens": 32}  # fmt: skip
    assert cli.main(["run", "--format", "native", "--out", str(out), "--check-prompts", "2"]) == 0
    assert "pushed" not in capsys.readouterr().out and calls[-1][1]["check_prompts"] == 2
    args = ["run", "--format", "gguf", "--out", str(out), "--draft-outtype", "q8_0", "--chain", "7"]
    assert cli.main(args) == 0
    assert capsys.readouterr().out == (
        f"wrote {out}/draft-q8_0.gguf (draft-eagle3); llama.cpp with the draft = plain on 3/4 "
        "prompts (1 near-tie divergences); accepted draft tokens llama.cpp 10, harness 11\n"
    )
    gguf_options = {"outtype": "q8_0", "chain": 7, "target_outtype": None, "overwrite": False}
    assert calls[-1] == ("gguf", {**gguf_options, "check_prompts": 4, "check_tokens": 32})


def test_the_card_names_data_files_without_local_folders(target, tmp_path):
    """A model card goes on a public page: no home or temp folders in it."""
    import hashlib

    from data.paths import REPO_ROOT
    from eval.publish.model_card import render_model_card

    outside = tmp_path / "private" / "chats.jsonl"
    outside.parent.mkdir()
    outside.write_text('{"messages": []}\n')
    digest = hashlib.sha256(outside.read_bytes()).hexdigest()[:12]
    inside = REPO_ROOT / "conf" / "config.yaml"
    sources = [{"path": str(outside)}, {"path": str(inside)}, {"path": "~/me/gone.jsonl"},
               {"path": "HuggingFaceH4/ultrachat_200k", "max_rows": 5}]  # fmt: skip
    context = {"config": {"data": {"sources": sources}}}
    check = {"prompts": 1, "max_new_tokens": 4, "tree": "2", "tau_export": 1.0, "tau_head": 1.0}
    card = render_model_card(eagle3(target), target, "native", {}, context, check, None)
    assert f"- `chats.jsonl (sha256 {digest})`" in card
    assert "- `conf/config.yaml`" in card and "- `gone.jsonl`" in card
    assert "- `HuggingFaceH4/ultrachat_200k` (first 5 rows)" in card
    assert str(tmp_path) not in card and str(REPO_ROOT) not in card and "~" not in card
