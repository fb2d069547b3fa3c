"""Self-distillation through a server: llama.cpp's `llama-server` or vLLM's `vllm serve` (each
started and stopped here), or any OpenAI-compatible completions endpoint (vLLM, SGLang, a server
you run yourself).

draftsmith renders every prompt with the target's chat template itself and sends token ids
(llama.cpp, vLLM) or the rendered text (OpenAI-compatible `/v1/completions`), so the
conversation the target sees is byte for byte the one the HF backend would feed; requests go out
concurrently, one per server slot. The answers come back as token ids (re-tokenised from their
text for a server of yours), cut at the first EOS, exactly like the HF backend's, so
`data.distill` keeps its resume, sharding and refusal rules unchanged. The vllm backend is the
OpenAI-compatible client on a `vllm serve` of the target's Hugging Face folder
(data/engines/vllm.py), asked for token ids both ways.

Requests wait in daemon threads (RequestPool), never in a ThreadPoolExecutor: the interpreter
joins an executor's threads before it exits, so a Ctrl-C would wait for every answer in flight
(minutes, with 32 slots of long answers) before the process could end. Here an interrupted run
stops its server and exits at once; the threads' requests fail or are abandoned.

A server of yours (backend: openai):
vLLM:    vllm serve MODEL --port 8000            -> server_url: http://HOST:8000
SGLang:  python -m sglang.launch_server --model-path MODEL --port 30000
                                                 -> server_url: http://HOST:30000
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, replace
from typing import NamedTuple

from data.engines import vllm
from data.engines.llama_cpp import LlamaServer, ServerConfig
from data.engines.server import EngineError, ServerProcess, post_json

BACKENDS = ("hf", "llama_cpp", "openai", "vllm")


class Sampling(NamedTuple):
    """How one request samples: temperature 0 is greedy; top_k 0 is no cut."""

    temperature: float
    top_p: float
    limit: int  # max new tokens
    top_k: int


@dataclass
class ServerBackendConfig:
    """Where answers come from. `gguf`: the target as GGUF (llama_cpp); `server_url`: an
    OpenAI-compatible server (openai), with `model` its served model name; `model_dir`: the
    target's Hugging Face folder (vllm, filled in by `for_target`), served in `dtype` (null:
    vLLM's float32) with room for `max_model_len` tokens a request (null: the model's own)."""

    backend: str = "hf"
    gguf: str | None = None
    server_url: str | None = None
    model: str | None = None
    parallel: int = 8
    threads: int = 2
    ctx_size: int = 2048
    model_dir: str | None = None
    dtype: str | None = None
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"distill.backend={self.backend!r}: use one of {', '.join(BACKENDS)}.")
        if self.backend == "openai" and not self.server_url:
            raise ValueError(
                "distill.backend=openai needs distill.server_url (e.g. http://127.0.0.1:8000 "
                "for `vllm serve MODEL --port 8000`)."
            )
        if self.parallel < 1:
            raise ValueError(f"distill.parallel={self.parallel}: need at least 1 slot.")
        if self.threads < 1:
            raise ValueError(f"distill.threads={self.threads}: need at least 1 thread.")
        if self.backend == "vllm":
            vllm.vllm_python()  # no tool environment: say how to build it before anything loads

    def for_target(self, model) -> ServerBackendConfig:
        """The settings with what the vllm backend reads off the loaded target `model` (an HF
        PreTrainedModel): the folder it was loaded from (a Hub id: its snapshot in the Hub
        cache, the same commit), its dtype where none is set, and its context length as the
        cap of `max_model_len`. Other backends: unchanged."""
        if self.backend != "vllm":
            return self
        source = str(getattr(model, "name_or_path", "") or "")
        if not source:
            raise EngineError(
                "distill.backend=vllm serves the target's Hugging Face folder, and this target "
                "was built in memory (model.random_init): save it to a folder and load it from "
                "there, or use backend=hf."
            )
        revision = getattr(model.config, "_commit_hash", None)
        folder = self.model_dir or vllm.local_target_dir(source, revision)
        dtype = self.dtype or str(next(model.parameters()).dtype).removeprefix("torch.")
        own = getattr(model.config, "max_position_embeddings", None)
        length = min(self.max_model_len, own) if self.max_model_len and own else own
        return replace(self, model_dir=folder, dtype=dtype, max_model_len=length)


class RequestPool:
    """`workers` daemon threads that run submitted calls (server requests); `submit` gives a
    concurrent.futures.Future. Unlike ThreadPoolExecutor's threads, which the interpreter joins
    before it exits, these are left behind when the process ends, so nothing waits for an answer
    in flight. `close` cancels what has not started; running calls end on their own."""

    def __init__(self, workers: int) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._workers = workers
        for i in range(workers):
            threading.Thread(target=self._work, name=f"request-{i}", daemon=True).start()

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 (handed to whoever reads the future)
                future.set_exception(exc)

    def close(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        for _ in range(self._workers):
            self._jobs.put(None)


def results(futures: Sequence[Future], tick_s: float = 1.0) -> list:
    """The futures' results in order, the first failure raised as soon as it happens. The wait
    wakes every `tick_s`: Python runs a signal handler (Ctrl-C) only in the main thread, and
    only once that thread runs again, whichever thread the kernel delivered the signal to."""
    pending = set(futures)
    while pending:
        done, pending = wait(pending, timeout=tick_s, return_when=FIRST_COMPLETED)
        for future in done:
            if future.exception() is not None:
                raise future.exception()
    return [future.result() for future in futures]


class ServerGenerator:
    """The server counterpart of HFGenerator (data/engines/hf_generation.py): `generate(prompts,
    seed)` gives (answer ids without EOS, "eos" | "length") per prompt. A context manager:
    llama_cpp and vllm start their server on enter and stop it on exit."""

    def __init__(
        self,
        cfg: ServerBackendConfig,
        encoder,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        eos_ids: list[int],
    ) -> None:
        """encoder: data.chat.ChatEncoder, which renders the prompts (`encoder.prompt`); its
        tokenizer decodes answers (and, for openai, the prompt text and the answers' ids)."""
        self.cfg, self.encoder, self.tok = cfg, encoder, encoder.tokenizer
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.eos = set(eos_ids)
        self.server: ServerProcess | None = None
        self.closed = False
        self._tokens_done = 0  # tokens of the answers returned so far
        self._count_lock = threading.Lock()

    def __enter__(self) -> ServerGenerator:
        if self.cfg.backend == "llama_cpp":
            if not self.cfg.gguf:
                raise EngineError(
                    "distill.backend=llama_cpp needs the target as a GGUF file (distill.gguf)."
                )
            self.server = LlamaServer(
                ServerConfig(
                    model=self.cfg.gguf,
                    threads=self.cfg.threads,
                    parallel=self.cfg.parallel,
                    ctx_size=self.cfg.ctx_size,
                )
            ).start()
        elif self.cfg.backend == "vllm":
            if not self.cfg.model_dir:
                raise EngineError(
                    "distill.backend=vllm needs the target's folder (ServerBackendConfig."
                    "for_target fills it in)."
                )
            config = vllm.VllmConfig(
                model=self.cfg.model_dir,
                threads=self.cfg.threads,
                dtype=self.cfg.dtype or "float32",
                max_model_len=self.cfg.max_model_len,
                parallel=self.cfg.parallel,
            )
            self.server = vllm.VllmServer(config).start()
        return self

    def __exit__(self, *exc) -> None:
        self.closed = True  # a request thread still running sends nothing more
        if self.server is not None:
            self.server.stop()
            self.server = None

    def generate(
        self,
        prompts: list[list[int]],
        seed: int,
        temperature: float | None = None,
        top_p: float | None = None,
        max_new_tokens: int | None = None,
        top_k: int | None = None,
    ) -> list[tuple[list[int], str]]:
        """(answer ids without EOS, "eos" | "length") per prompt; request i uses seed + i.
        temperature / top_p / max_new_tokens override the answer settings for this call; top_k
        (0 or None: no cut) bounds sampling, which llama-server otherwise does over the whole
        vocabulary, one slot after another (at a 152k vocabulary, most of a 32-slot step)."""
        sampling = Sampling(
            self.temperature if temperature is None else temperature,
            self.top_p if top_p is None else top_p,
            self.max_new_tokens if max_new_tokens is None else max_new_tokens,
            top_k or 0,
        )
        seeds = [(seed + i) % 2**31 for i in range(len(prompts))]
        if len(prompts) == 1:  # one turn of a streamed conversation: already in its own thread
            return [self._one(prompts[0], seeds[0], sampling)]
        pool = RequestPool(min(self.cfg.parallel, len(prompts)))
        try:
            jobs = [pool.submit(self._one, p, s, sampling) for p, s in zip(prompts, seeds)]
            return results(jobs)
        finally:
            pool.close()

    def tokens_generated(self) -> int:
        """Tokens generated so far: those of the answers returned, plus (llama_cpp) those the
        server holds of the answers still running, for a progress display."""
        running = self.server.tokens_in_flight() if isinstance(self.server, LlamaServer) else 0
        return self._tokens_done + running

    def _one(self, prompt: list[int], seed: int, sampling: Sampling) -> tuple[list[int], str]:
        if self.closed:
            raise EngineError("the generator was closed (the run was stopped)")
        if self.cfg.backend == "llama_cpp":
            ids = self._llama_cpp(prompt, seed, sampling)
        else:
            ids = self._openai(prompt, seed, sampling)
        with self._count_lock:
            self._tokens_done += len(ids)
        cut = next((j for j, t in enumerate(ids) if t in self.eos), None)
        if cut is not None:
            return ids[:cut], "eos"
        return ids[: sampling.limit], "length"

    def _llama_cpp(self, prompt: list[int], seed: int, sampling: Sampling) -> list[int]:
        temperature, top_p, limit, top_k = sampling
        extra = {} if temperature == 0 else {"top_p": top_p, "top_k": top_k, "min_p": 0.0}
        done = self.server.complete(prompt, limit, temperature=temperature, seed=seed, **extra)
        ids = list(done.tokens)
        if done.stop_type == "eos" and not (ids and ids[-1] in self.eos):
            ids.append(min(self.eos))  # the server stopped at EOS without returning it
        return ids

    def _openai(self, prompt: list[int], seed: int, sampling: Sampling) -> list[int]:
        temperature, top_p, limit, top_k = sampling
        """One /v1/completions request. vllm: to the server started here, token ids both ways;
        else the rendered prompt's text to `server_url`, the answer's text tokenised."""
        body = {
            "max_tokens": limit,
            "temperature": temperature,
            "top_p": top_p if temperature > 0 else 1.0,
            "seed": seed,
        }
        if top_k and temperature > 0:
            body["top_k"] = top_k  # an extension vLLM and llama-server read
        if self.cfg.backend == "vllm":
            body |= {
                "model": vllm.SERVED_NAME,
                "prompt": list(prompt),
                "return_token_ids": True,
                "skip_special_tokens": False,
                "stop_token_ids": sorted(self.eos),  # every EOS of the target, as HF stops
            }
            choice = self.server.post("/v1/completions", body)["choices"][0]
            ids = [int(t) for t in choice.get("token_ids") or []]
        else:
            body["prompt"] = self.tok.decode(prompt, skip_special_tokens=False)
            if self.cfg.model:
                body["model"] = self.cfg.model
            url = self.cfg.server_url.rstrip("/") + "/v1/completions"
            try:
                doc = post_json(url, body)
            except ConnectionError as e:
                raise EngineError(f"{url}: request failed ({e}); is the server running?") from None
            choice = doc["choices"][0]
            ids = self.tok(choice.get("text", ""), add_special_tokens=False).input_ids
        if choice.get("finish_reason") == "stop" and not (ids and ids[-1] in self.eos):
            ids.append(min(self.eos))  # stopped at EOS without returning it
        return ids
