"""Self-distillation through vLLM (`data.self_distill.backend=vllm`), with the real `vllm serve`
of the tool environment scripts/setup_vllm.sh builds (one compute thread, eager, fp32):

- without the tool environment the setting is refused when the config is built, in one line
  naming the set-up command;
- on the tiny random Llama of tests/test_vllm.py, a run stopped after its first conversation
  keeps it, stops its server, and a rerun writes only the rest; every greedy answer equals the
  HF backend's on the same prompts, and no process of either server is left.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from data.engines import vllm
from data.engines.llama_cpp import EngineError
from tests.test_vllm import _need_vllm, _save_tiny_target

pytestmark = pytest.mark.integration  # vLLM's tool environment (scripts/setup_vllm.sh)

PROMPTS = [{"path": "data/corpora/oa_prompts_en/prompts.jsonl", "skip": 16, "max_rows": 4}]


def _cfg(out: Path, **engine):
    from data.distill import DistillConfig

    return DistillConfig(prompts=PROMPTS, out=str(out), max_new_tokens=16, batch_size=1, **engine)


def _session_alive(sid: int) -> list[int]:
    """Processes of session `sid` still running (zombies, exited but not reaped, are gone)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # after the name: state, ppid, pgrp, sid
            alive.append(int(stat.parent.name))
    return alive


def test_without_the_tool_environment_the_setting_names_the_set_up(monkeypatch, tmp_path):
    from data.config import SelfDistillSettings

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    with pytest.raises(EngineError, match=r"run `bash scripts/setup_vllm.sh`"):
        _cfg(tmp_path / "sd.jsonl", backend="vllm")
    with pytest.raises(EngineError, match="no vLLM tool environment") as err:
        SelfDistillSettings(enabled=True, prompts=PROMPTS, backend="vllm")
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """The tiny random Llama of tests/test_vllm.py, saved to a folder and loaded from it."""
    _need_vllm()
    from heads.target import TargetConfig, load_target

    folder = tmp_path_factory.mktemp("vllm_distill") / "target"
    _save_tiny_target(folder)
    return load_target(TargetConfig(name_or_path=str(folder)))


def test_the_server_gets_the_targets_folder_dtype_and_context(tiny_target, tmp_path):
    """What the vllm backend reads off the loaded target, and what names the answers file: the
    engine's version, never a llama_cpp GGUF setting left in the data config."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from data.config import SelfDistillSettings

    cfg = _cfg(tmp_path / "sd.jsonl", backend="vllm", threads=1)
    server = cfg.server.for_target(tiny_target.model)
    assert server.model_dir == str(Path(tiny_target.model.name_or_path).resolve())
    assert (server.dtype, server.max_model_len, server.threads) == ("float32", 1536 + 16, 1)
    small = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    in_memory = AutoModelForCausalLM.from_config(small)
    with pytest.raises(EngineError, match="built in memory"):
        cfg.server.for_target(in_memory)
    stray = SelfDistillSettings(enabled=True, prompts=PROMPTS, backend="vllm", gguf="fast_float")
    assert stray.distill_config("o.jsonl").settings()["engine"] == vllm.VLLM_ENGINE
    hf = SelfDistillSettings(enabled=True, prompts=PROMPTS)
    assert stray.default_out("f" * 40) != hf.default_out("f" * 40)


def test_vllm_distillation_resumes_stops_its_server_and_equals_hf(
    tiny_target, tmp_path, monkeypatch
):
    import data.distill as distill_mod
    from data.distill import distill, meta_path
    from data.parts import read_rows

    servers: list[vllm.VllmServer] = []
    real_start = vllm.VllmServer.start

    def recorded_start(self):
        servers.append(self)
        return real_start(self)

    monkeypatch.setattr(vllm.VllmServer, "start", recorded_start)
    out = tmp_path / "sd.jsonl"
    engine = {"backend": "vllm", "parallel": 2, "threads": 1}
    real_append, calls = distill_mod.append_rows, []

    def stop_after_first_conversation(path, rows):
        calls.append(path)
        if len(calls) > 2:  # rows and skipped of the first conversation were written
            raise KeyboardInterrupt
        real_append(path, rows)

    monkeypatch.setattr(distill_mod, "append_rows", stop_after_first_conversation)
    with pytest.raises(KeyboardInterrupt):
        distill(tiny_target, _cfg(out, **engine), progress=False)
    monkeypatch.setattr(distill_mod, "append_rows", real_append)
    first = [row["id"] for row in read_rows(out)]
    assert len(first) == 1 and len(servers) == 1
    assert servers[0].proc.poll() is not None and not _session_alive(servers[0].proc.pid)

    stats = distill(tiny_target, _cfg(out, **engine), progress=False)
    assert stats["rows"] == 3 and len(servers) == 2
    assert servers[1].proc.poll() is not None and not _session_alive(servers[1].proc.pid)
    rows = list(read_rows(out))
    assert [r["id"] for r in rows][:1] == first and len({r["id"] for r in rows}) == 4
    settings = meta_path(out).read_text()
    assert '"backend": "vllm"' in settings and vllm.VLLM_ENGINE in settings
    server_args = servers[1].config.args(0)
    assert server_args[server_args.index("--model") + 1] == str(
        Path(tiny_target.model.name_or_path).resolve()
    )
    assert server_args[server_args.index("--dtype") + 1] == "float32"
    assert server_args[server_args.index("--max-num-seqs") + 1] == "2"

    # the same prompts through HF generate: fp32 vLLM decodes as HF does on this target
    # (tests/test_vllm.py finds the same for its plain decoding), so every answer is equal
    hf_out = tmp_path / "hf.jsonl"
    distill(tiny_target, _cfg(hf_out), progress=False)
    hf = {r["id"]: r for r in read_rows(hf_out)}
    for row in rows:
        assert row["messages"] == hf[row["id"]]["messages"], row["id"]
        assert row["finish"] == hf[row["id"]]["finish"], row["id"]
    assert all(r["messages"][-1]["content"] for r in rows)  # answers, not empty turns
