"""The command line: a user error is one line with its fix and a non-zero exit, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import InstantiationException

from data.errors import ConfigError
from data.formats import DataFormatError
from train.cli import EXIT_USER_ERROR, one_line, report_user_errors, user_error

REPO = Path(__file__).resolve().parents[1]


def train_cli(tmp_path, *overrides, **env):
    cmd = [sys.executable, "train.py", "+experiment=medusa_tiny", f"hydra.run.dir={tmp_path}"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HYDRA_FULL_ERROR": "0", **env}
    return subprocess.run(
        [*cmd, *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.integration
def test_a_bad_setting_prints_one_line_and_fails(tmp_path):
    proc = train_cli(tmp_path, "trainer.lr=-1")
    assert proc.returncode == EXIT_USER_ERROR
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == "error: TrainerConfig: lr=-1: set a positive learning rate (e.g. lr=1e-4)."
    assert len(lines) <= 3 and "Traceback" not in proc.stderr
    assert not (tmp_path / "head").exists()


@pytest.mark.integration
def test_hydra_full_error_shows_the_traceback(tmp_path):
    proc = train_cli(tmp_path, "trainer.lr=-1", HYDRA_FULL_ERROR="1")
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "positive learning rate" in proc.stderr


def test_user_errors_are_found_behind_hydra_and_bugs_are_not():
    bad_row = DataFormatError("rows.jsonl line 3: no 'messages' or 'conversations' key; fix it")
    assert user_error(bad_row) is bad_row
    try:
        try:
            raise ValueError("MedusaConfig: num_heads=0: use 1 or more.")
        except ValueError as err:
            raise InstantiationException("Error in call to target 'MedusaConfig'") from err
    except InstantiationException as wrapped:
        assert str(user_error(wrapped)) == "MedusaConfig: num_heads=0: use 1 or more."
    assert user_error(ValueError("a bug outside any config")) is None
    assert user_error(ZeroDivisionError()) is None
    assert one_line(ConfigError("a\n   b")) == "error: a b"


def test_the_wrapper_exits_2_on_user_errors_and_reraises_bugs(capsys, monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)

    @report_user_errors
    def fails(error):
        raise error

    with pytest.raises(SystemExit) as stop:
        fails(FileNotFoundError("data/x.jsonl not found: give a file that exists"))
    assert stop.value.code == EXIT_USER_ERROR
    assert capsys.readouterr().err.startswith("error: data/x.jsonl not found: give a file")
    with pytest.raises(KeyError):
        fails(KeyError("a bug keeps its traceback"))
