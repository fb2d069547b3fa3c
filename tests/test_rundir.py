"""train/rundir.py owns the run directory's layout; everything else reads runs through it."""

from __future__ import annotations

import ast
import dataclasses
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from heads.base import (
    TargetInfo,
    atomic_save_dir,
    restore_interrupted_swap,
    save_head,
    save_safetensors,
)
from train import rundir

ROOT = Path(__file__).resolve().parents[1]
LAYOUT_NAMES = {
    rundir.CONFIG_FILE,
    rundir.DATA_STATS,
    rundir.METRICS_FILE,
    rundir.CHECKPOINTS,
    rundir.BEST_DIR,
    rundir.BEST_FILE,
    rundir.WANDB_ID_FILE,
    "_target_",
}


def _string_literals(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and type(n.value) is str}


def test_run_dir_names_are_spelled_in_one_module():
    offenders = []
    for package in ("train", "eval", "scripts"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "train" / "rundir.py":
                continue
            hits = _string_literals(path) & LAYOUT_NAMES
            if hits:
                offenders.append(f"{path.relative_to(ROOT)}: {sorted(hits)}")
    assert not offenders, "use train.rundir's names instead:\n" + "\n".join(offenders)


def test_load_target_config_drops_the_hydra_key(monkeypatch):
    seen = []
    monkeypatch.setattr("heads.target.load_target", lambda cfg: seen.append(cfg) or "target")
    model = {"_target_": "heads.target.TargetConfig", "name_or_path": "some/model", "dtype": "auto"}
    assert rundir.load_target_config(model) == "target"
    assert (seen[0].name_or_path, seen[0].dtype) == ("some/model", "auto")


def test_conf_target_config_reads_a_conf_model_option(monkeypatch):
    cfg = rundir.conf_target_config("smollm2_135m")
    assert (cfg.name_or_path, cfg.dtype) == ("smollm2_135m", "float32")
    assert "${" not in str(cfg.cache_dir)  # interpolations resolved
    monkeypatch.setattr("heads.target.load_target", lambda c: ("loaded", c.name_or_path))
    assert rundir.load_conf_target("smollm2_135m") == ("loaded", "smollm2_135m")
    with pytest.raises(FileNotFoundError, match="conf/model option"):
        rundir.conf_target_config("no_such_model")


def test_load_run_target_reads_the_runs_config(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr("heads.target.load_target", lambda cfg: seen.append(cfg) or "target")
    rundir.write_run_config(tmp_path, {"model": {"_target_": "x", "name_or_path": "m"}})
    assert rundir.load_run_target(tmp_path) == "target" and seen[0].name_or_path == "m"
    with pytest.raises(FileNotFoundError, match="give the run dir train.py wrote"):
        rundir.load_run_target(tmp_path / "nothing")


def test_manifest_catches_truncation_and_changed_bytes(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"12345678")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("hello")
    rundir.write_manifest(tmp_path)
    assert rundir.manifest_problems(tmp_path) == []
    (tmp_path / "a.bin").write_bytes(b"1234")
    (tmp_path / "sub" / "b.txt").write_text("HELLO")
    assert rundir.manifest_problems(tmp_path) == [
        "a.bin has 4 bytes, not 8",
        "sub/b.txt does not match its sha256",
    ]
    (tmp_path / rundir.MANIFEST_FILE).write_text("{")
    assert rundir.manifest_problems(tmp_path) == ["manifest.json is unreadable"]


# ---- crash-safe folder swaps ----------------------------------------------------------------


def _folder_with(text: str):
    return lambda tmp: (tmp / "f").write_text(text)


def test_a_swap_killed_at_any_point_leaves_a_whole_folder(tmp_path, monkeypatch):
    path = tmp_path / "head"
    atomic_save_dir(path, _folder_with("old"))
    calls = []

    def killed_on_second_rename(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:
            raise KeyboardInterrupt  # the process dies between two renames
        os.rename(src, dst)

    monkeypatch.setattr("heads.base.os.replace", killed_on_second_rename)
    try:
        atomic_save_dir(path, _folder_with("new"))
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    restore_interrupted_swap(path)
    assert (path / "f").read_text() in ("old", "new")


def test_an_interrupted_fallback_swap_is_undone(tmp_path, monkeypatch):
    path = tmp_path / "best_head"
    atomic_save_dir(path, _folder_with("old"))
    monkeypatch.setattr("heads.base._exchange", lambda a, b: False)  # no renameat2 here
    real, calls = os.replace, []

    def killed_on_second_rename(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr("heads.base.os.replace", killed_on_second_rename)
    with pytest.raises(KeyboardInterrupt):
        atomic_save_dir(path, _folder_with("new"))
    monkeypatch.undo()
    assert not path.exists()  # the moment the fallback cannot avoid ...
    assert rundir.kept_head(tmp_path) is None  # ... which readers repair (no config.json here)
    assert (path / "f").read_text() == "old"


def test_equal_weights_give_byte_equal_files(tmp_path):
    @dataclasses.dataclass
    class Cfg:
        num_heads: int = 2

    tensors = {"b": torch.arange(6.0), "a": torch.ones(2, 3, dtype=torch.bfloat16)}
    digests = set()
    for i in range(12):  # safetensors orders metadata by a per-map random hash
        save_head(tmp_path / f"h{i}", "medusa", Cfg(), TargetInfo(name_or_path="t"), tensors)
        digests.add(rundir.file_sha256(tmp_path / f"h{i}" / "model.safetensors"))
    assert len(digests) == 1
    save_safetensors(tensors, tmp_path / "x.safetensors", {"z": "1", "a": "2", "m": "3"})
    with safe_open(tmp_path / "x.safetensors", "pt") as f:
        assert f.metadata() == {"z": "1", "a": "2", "m": "3"}
        assert torch.equal(f.get_tensor("b"), tensors["b"])
    raw = (tmp_path / "x.safetensors").read_bytes()
    assert raw.index(b'"a":"2"') < raw.index(b'"m":"3"') < raw.index(b'"z":"1"')
