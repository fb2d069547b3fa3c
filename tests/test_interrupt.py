"""Long data steps through the command line: Ctrl-C stops a server-backed self-distillation within
seconds, stops its llama-server and keeps every finished conversation (a rerun continues); an
engine that cannot start is one line and exit status 2, not a traceback.

The server is tests/_stand_in_llama_server.py (llama-server's protocol, one token every
$STAND_IN_TOKEN_S), chosen with DRAFTSMITH_LLAMA_SERVER, so these tests need no llama.cpp build
and the answers take as long as the test needs. Each command runs in its own process group with
SIGINT at its default, as a terminal's foreground job has it (a job a non-interactive shell
starts in the background inherits SIGINT ignored, and Python then never raises Ctrl-C).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data.engines.llama_cpp import EngineError, LlamaServer, ServerConfig
from train.cli import EXIT_INTERRUPTED, EXIT_USER_ERROR

REPO = Path(__file__).resolve().parents[1]
PROMPTS = "data/corpora/oa_prompts_en/prompts.jsonl"  # one user turn each
STAND_IN = REPO / "tests" / "_stand_in_llama_server.py"
KEPT = re.compile(r"^interrupted: (\d+) of 12 conversations kept in (.+); rerun the same command")


def _server_script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "llama-server"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return script


def _env(tmp_path: Path, server: Path, token_s: float) -> dict:
    return {
        **os.environ,
        "DRAFTSMITH_LLAMA_SERVER": str(server),
        "STAND_IN_TOKEN_S": str(token_s),
        "STAND_IN_PID_FILE": str(tmp_path / "server.pids"),
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
        "HYDRA_FULL_ERROR": "0",
        "PYTHONPATH": str(REPO),
    }


def _stand_in(tmp_path: Path) -> Path:
    return _server_script(tmp_path, f'exec {shlex.quote(sys.executable)} {STAND_IN} "$@"')


def _distill_cmd(tmp_path: Path) -> list[str]:
    gguf = tmp_path / "target.gguf"  # the stand-in reads no model; the setting wants a file
    gguf.touch()
    return [sys.executable, "scripts/self_distill.py", "model=tiny_random_llama",
            f"distill.prompts=[{PROMPTS}]", "distill.max_rows=12", "distill.max_new_tokens=16",
            "+distill.backend=llama_cpp", f"+distill.gguf={gguf}", "+distill.parallel=2",
            f"distill.out={tmp_path / 'sd.jsonl'}",
            f"hydra.run.dir={tmp_path / 'hydra'}"]  # fmt: skip


def _train_cmd(tmp_path: Path) -> list[str]:
    gguf = tmp_path / "target.gguf"
    gguf.touch()
    sd = "data.self_distill"
    return [sys.executable, "train.py", "+experiment=eagle3_tiny", f"{sd}.enabled=true",
            f"{sd}.prompts=[{PROMPTS}]", f"{sd}.max_rows=12", f"{sd}.max_new_tokens=16",
            f"{sd}.backend=llama_cpp", f"{sd}.gguf={gguf}", f"{sd}.parallel=2",
            f"{sd}.out={tmp_path / 'sd.jsonl'}", f"hydra.run.dir={tmp_path / 'run'}",
            "logger.mode=disabled", "evaluators=[]"]  # fmt: skip


def _start(cmd: list[str], env: dict, tmp_path: Path) -> subprocess.Popen:
    """The command in a process group of its own (a terminal's job), SIGINT at its default;
    stdout and stderr go to files (a pipe nobody reads would block the progress bar)."""

    def sigint_default() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=open(tmp_path / "stdout.txt", "w"),  # noqa: SIM115 (the child holds it)
        stderr=open(tmp_path / "stderr.txt", "w"),  # noqa: SIM115
        process_group=0,
        preexec_fn=sigint_default,
    )


def _wait_until(done, proc: subprocess.Popen, tmp_path: Path, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if proc.poll() is not None:
            raise AssertionError(f"ended early: {(tmp_path / 'stderr.txt').read_text()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("timed out waiting for the run to get going")
        time.sleep(0.05)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:  # a zombie (exited, waiting to be reaped) is gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _interrupt(proc: subprocess.Popen, tmp_path: Path, whole_group: bool) -> tuple[float, str]:
    """Ctrl-C (SIGINT to the process group, or to the main process alone); returns the seconds
    until the run and every server it started were gone, and the last line of its stderr."""
    servers = [int(p) for p in (tmp_path / "server.pids").read_text().split()]
    assert servers and all(_alive(pid) for pid in servers)
    t0 = time.monotonic()
    if whole_group:
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        for pid in servers:
            os.kill(pid, signal.SIGKILL)
        raise AssertionError("the run outlived Ctrl-C by 10 s") from None
    while any(_alive(pid) for pid in servers) and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    seconds = time.monotonic() - t0
    left = [pid for pid in servers if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"llama-server {left} outlived the interrupted run"
    stderr = (tmp_path / "stderr.txt").read_text()
    assert "Traceback" not in stderr, stderr[-3000:]
    return seconds, stderr.strip().splitlines()[-1]


@pytest.mark.integration
def test_ctrl_c_stops_self_distillation_and_its_server_and_a_rerun_continues(tmp_path):
    """SIGINT to the process group of scripts/self_distill.py while two slots generate: the
    run and its server are gone within seconds, exit status 130, one line says how many
    conversations were kept; the same command then writes only the rest."""
    cmd, out = _distill_cmd(tmp_path), tmp_path / "sd.jsonl"
    proc = _start(cmd, _env(tmp_path, _stand_in(tmp_path), token_s=0.05), tmp_path)
    _wait_until(lambda: len(_rows(out)) >= 1, proc, tmp_path)  # 0.8 s an answer, 12 to write
    seconds, last = _interrupt(proc, tmp_path, whole_group=True)
    assert seconds < 10 and proc.returncode == EXIT_INTERRUPTED, last
    found = KEPT.match(last)
    assert found and Path(found.group(2)) == out, last
    kept = [row["id"] for row in _rows(out)]
    assert int(found.group(1)) == len(kept) and 0 < len(kept) < 12
    first = out.read_bytes()
    rerun = subprocess.run(cmd, cwd=REPO, env=_env(tmp_path, _stand_in(tmp_path), 0.002),
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"{len(kept)} already written, {12 - len(kept)} to go" in rerun.stdout + rerun.stderr
    ids = [row["id"] for row in _rows(out)]
    assert out.read_bytes().startswith(first) and len(ids) == len(set(ids)) == 12


@pytest.mark.integration
def test_ctrl_c_to_train_py_alone_stops_it_and_its_server_and_shows_tokens(tmp_path):
    """SIGINT to train.py's process alone while its self-distillation waits on long answers
    (3.2 s each): the bar has shown tokens generated before any conversation finished, and the
    run stops within seconds with its server, 0 of 12 conversations kept, status 130."""
    proc = _start(_train_cmd(tmp_path), _env(tmp_path, _stand_in(tmp_path), 0.2), tmp_path)
    stderr = tmp_path / "stderr.txt"
    moving = re.compile(r"(?<!\d)0/12 \[.*tokens=[1-9]")  # tokens, and no conversation done
    _wait_until(lambda: moving.search(stderr.read_text()), proc, tmp_path)
    seconds, last = _interrupt(proc, tmp_path, whole_group=False)
    assert seconds < 10 and proc.returncode == EXIT_INTERRUPTED, last
    found = KEPT.match(last)
    assert found and int(found.group(1)) == len(_rows(tmp_path / "sd.jsonl")), last
    assert not (tmp_path / "run" / "head").exists()


@pytest.mark.integration
def test_a_broken_server_binary_is_one_line_and_exit_status_2(tmp_path):
    """A llama-server that exits at once: train.py prints exactly one line, the server's own
    words in it, and exits with status 2."""
    broken = _server_script(tmp_path, 'echo "llama-server: libggml.so: not found" >&2\nexit 1')
    proc = subprocess.run(_train_cmd(tmp_path), cwd=REPO, env=_env(tmp_path, broken, 0.0),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == EXIT_USER_ERROR, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: llama-server exited with code 1 while starting")
    assert "libggml.so: not found" in lines[0]


def test_a_binary_that_cannot_run_is_an_engine_error(tmp_path, monkeypatch):
    """A file that is no program (a foreign build, a text file) is EngineError with the fix,
    which the command lines print as one line, not an OSError's traceback."""
    fake = tmp_path / "llama-server"
    fake.write_bytes(b"\x7fELF not really")
    fake.chmod(0o755)
    monkeypatch.setenv("DRAFTSMITH_LLAMA_SERVER", str(fake))
    model = tmp_path / "target.gguf"
    model.touch()
    with pytest.raises(EngineError, match="cannot run .*llama-server: Exec format error"):
        LlamaServer(ServerConfig(model=str(model))).start()
