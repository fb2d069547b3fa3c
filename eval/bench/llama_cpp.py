"""llama.cpp methods for the benchmark: the same requests, in the same run, through llama-server.

- `llama_cpp_plain`: the target GGUF, no drafting (the baseline llama.cpp speedups are against);
- `llama_cpp_draft`: the target GGUF with a draftsmith draft GGUF (`--spec-type draft-eagle3`);
- `llama_cpp_ngram`: llama.cpp's own n-gram drafter (`ngram-simple`), the free baseline.

Each method keeps one server (one slot, the benchmark's threads) for the whole run and sends the
harness's token ids, so every method decodes exactly the same prompt. A `Record` is filled from
the server's answer: its tokens, the wall time of the request, and the accept lengths per target
step. llama.cpp reports per request the accepted draft tokens and, at log verbosity 4, the share
of verify steps that accepted at least i+1 tokens ("acc per pos"); from those the multiset of
per-step accept lengths is rebuilt exactly (their order is not known, and the report uses only
the multiset: tau, the histogram, per-depth rates). tau therefore means what it means for the HF
methods: tokens per target verify step, the bonus token included, the prefill's token excluded.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from data.engines.llama_cpp import Completion, EngineError, LlamaServer, ServerConfig
from data.errors import ConfigError
from eval.bench.methods import Record
from eval.engine.method_names import typed_name
from heads.interop.gguf import gguf_source_format, spec_type_of_gguf

LLAMA_CPP_METHODS = ("llama_cpp_plain", "llama_cpp_draft", "llama_cpp_ngram")
_ACC_PER_POS = re.compile(r"acc per pos = \(([^)]*)\)")


@dataclass
class LlamaCppSettings:
    """bench.llama_cpp: the GGUF files and the server's settings."""

    # a .gguf path, auto, a type (heads.interop.gguf), or a list of them (one set of
    # methods per entry: eval/bench/llama_cpp_targets.py); resolved to a path or {label: path}
    target_gguf: str | list | dict | None = None
    draft_gguf: str | None = None
    draft_outtype: str = "f32"  # the type of a draft exported on the fly (f32, f16, bf16, q8_0)
    resolved_types: dict | None = None  # filled when resolved: {label: the GGUF's weight type}
    spec_type: str | None = None  # null: read from the draft GGUF (spec_type_of_gguf)
    draft_n_max: int = 3
    draft_n_min: int = 0
    draft_p_min: float = 0.0
    ngram_n_max: int = 8
    threads: int = 2
    draft_threads: int | None = None  # the draft's threads; null: `threads`
    ctx_size: int = 4096
    cache_type: str = "f16"  # f32 with flash_attn=off: token-faithful runs (see ServerConfig)
    flash_attn: str = "auto"


def check_draft_head(head) -> None:
    """llama_cpp_draft exports head_path's head as a GGUF draft: refuse, before any conversion,
    a missing head or one llama.cpp cannot serve."""
    if head is None:
        raise ConfigError("llama_cpp_draft needs head_path=DIR (or llama_cpp.draft_gguf=FILE).")
    try:
        gguf_source_format(head)
    except ValueError as err:
        raise ConfigError(
            f"methods: llama_cpp_draft cannot serve a {head.method!r} head ({err}); drop "
            "llama_cpp_draft from methods, or give llama_cpp.draft_gguf=FILE."
        ) from err


def accept_lengths(completion: Completion, log_chunk: str, n_max: int) -> list[int]:
    """Per-step accept lengths (accepted draft tokens + 1) of one request.

    Steps = new tokens - 1 (the prefill's) - accepted draft tokens; with the per-position rates
    r_i (steps accepting >= i+1 tokens / steps) the count of steps accepting exactly k is
    round(S * (r_{k-1} - r_k)). A request that accepted nothing has S steps of length 1; one that
    accepted tokens needs the rates (the server must run at verbosity 4), else it is an error.
    """
    n = len(completion.tokens)
    accepted = completion.draft_accepted
    steps = max(n - 1 - accepted, 0)
    if steps == 0:
        return []
    if accepted == 0:
        return [1] * steps
    found = _ACC_PER_POS.findall(log_chunk)
    if not found:
        raise EngineError(
            "llama-server logged no per-position acceptance for a drafted request; start it "
            "with verbosity=4 (ServerConfig.verbosity) to benchmark a draft."
        )
    rates = [float(x) for x in found[-1].split(",") if x.strip()][:n_max]
    at_least = [round(steps * r) for r in rates] + [0]  # steps accepting >= i+1 tokens
    lengths = []
    for k in range(len(rates), 0, -1):
        lengths += [k + 1] * max(at_least[k - 1] - at_least[k], 0)
    lengths += [1] * max(steps - len(lengths), 0)
    # rounding can be off by one step; the accepted total is exact, so trust it
    surplus = sum(a - 1 for a in lengths) - accepted
    while surplus > 0 and lengths and lengths[0] > 1:
        lengths[0] -= 1
        lengths.sort(reverse=True)
        surplus -= 1
    return lengths


class LlamaCppMethod:
    """One benchmark method served by one llama-server (started on first use)."""

    def __init__(self, name: str, config: ServerConfig, target_label: str = "") -> None:
        self.name, self.config = name, config
        drafts = config.spec_type is not None
        self.max_draft_depth = config.draft_n_max if drafts else 0
        # a drafting method is compared with (and sped up against) the same engine undrafted,
        # on the same target type
        self.baseline = typed_name("llama_cpp_plain", target_label) if drafts else None
        self.server: LlamaServer | None = None

    def run(self, input_ids: Tensor, max_new_tokens: int) -> Record:
        if self.server is None:
            self.server = LlamaServer(self.config).start()
        self.server.new_log()
        ids = input_ids[0].tolist()
        t0 = time.perf_counter()
        done = self.server.complete(ids, max_new_tokens)
        seconds = time.perf_counter() - t0
        lengths = accept_lengths(done, self._request_log(done), max(self.max_draft_depth, 1))
        return Record(
            tokens=done.tokens,
            target_forwards=1 + len(lengths),
            prefill_tokens=min(1, len(done.tokens)),
            accept_lengths=lengths,
            seconds=seconds,
        )

    def _request_log(self, done: Completion, wait_s: float = 5.0) -> str:
        """The server's log lines for the request just answered. The server prints a slot's
        statistics as the slot is released, which can be just after the answer is sent: a
        drafted request waits (briefly) for its "acc per pos" line."""
        text = self.server.new_log()
        deadline = time.monotonic() + wait_s
        while done.draft_accepted > 0 and not _ACC_PER_POS.search(text):
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
            text += self.server.new_log()
        return text

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def build_llama_cpp_methods(names, settings: LlamaCppSettings) -> list[LlamaCppMethod]:
    """The llama.cpp methods among `names`, in that order; with several target GGUFs ({label:
    path}), each method once per target, named `<method>@<label>`."""
    if not settings.target_gguf:
        raise ValueError(
            "llama.cpp methods need bench.llama_cpp.target_gguf (the target as GGUF; for the "
            "embedded SmolLM2, `python scripts/export.py RUN --format gguf` writes or names one)."
        )
    targets = settings.target_gguf
    if not isinstance(targets, dict):
        targets = {"": targets}
    out = []
    for label, path in targets.items():
        for name in names:
            cfg = _server_config(name, str(path), settings)
            if cfg is not None:
                out.append(LlamaCppMethod(typed_name(name, label), cfg, label))
    return out


def _server_config(name: str, model: str, settings: LlamaCppSettings) -> ServerConfig | None:
    base = dict(
        model=model,
        threads=settings.threads,
        ctx_size=settings.ctx_size,
        cache_type=settings.cache_type,
        flash_attn=settings.flash_attn,
    )
    if name == "llama_cpp_plain":
        return ServerConfig(**base)
    if name == "llama_cpp_draft":
        if not settings.draft_gguf:
            raise ValueError(
                "llama_cpp_draft needs bench.llama_cpp.draft_gguf (scripts/export.py RUN "
                "--format gguf writes it)."
            )
        return ServerConfig(
            **base,
            draft=settings.draft_gguf,
            spec_type=settings.spec_type or spec_type_of_gguf(settings.draft_gguf),
            draft_n_max=settings.draft_n_max,
            draft_n_min=settings.draft_n_min,
            draft_p_min=settings.draft_p_min,
            draft_threads=settings.draft_threads,
            verbosity=4,
        )
    if name == "llama_cpp_ngram":
        return ServerConfig(
            **base, spec_type="ngram-simple", draft_n_max=settings.ngram_n_max, verbosity=4
        )
    return None


def ms_per_step(metrics: dict) -> float:
    """Wall milliseconds per target step of a method (prefill excluded as far as counted)."""
    return 1000 * metrics["seconds"] / max(metrics["target_forwards"], 1)


def measured_step_costs(plain: dict, draft: dict) -> tuple[list[float], dict[int, float]]:
    """(per-position acceptance, draft length -> ms per step) from a benchmark's overall
    metrics of llama_cpp_plain and llama_cpp_draft: 0 drafted tokens cost a plain step, n_max
    (the draft's length) a drafted one, its drafting included (for best_draft_length)."""
    at_least = [r or 0.0 for r in draft["accept_rate_by_depth"]]
    return at_least, {0: ms_per_step(plain), len(at_least): ms_per_step(draft)}


def best_draft_length(
    at_least: list[float],
    step_ms: dict[int, float] | None = None,
    draft_ms_per_token: float = 0.0,
    *,
    verify_ms: dict[int, float] | None = None,
    overhead_ms: float = 0.0,
) -> tuple[int, dict[int, float]]:
    """The draft length k that maximises expected tokens per millisecond.

    at_least[i]: measured share of steps that accept >= i+1 draft tokens when drafting
    len(at_least) tokens (a shorter draft accepts the same prefix). The target's cost of a step
    comes from one of two measurements (linear in between, held flat beyond):
    - step_ms: milliseconds per target step for some draft lengths (k -> ms), e.g. plain and
      drafted runs of one benchmark (scripts/draft_length.py);
    - verify_ms: a verify-cost curve, milliseconds to decode a batch of b tokens (b -> ms, from
      `llama-bench -p 1,2,4,8,16 -n 0 -d D`, eval/bench/engine_ceiling.py), a step drafting k
      tokens
      verifying k+1, plus `overhead_ms` per step (the server's own work beyond the forward).
    Expected tokens per step with k drafted = 1 + sum(at_least[:k]); cost = verify(k) +
    k * draft_ms_per_token. Returns (best k, k -> expected tokens per second).
    """
    if (step_ms is None) == (verify_ms is None):
        raise ValueError("best_draft_length takes exactly one of step_ms and verify_ms")
    if verify_ms is not None:
        costs = {b - 1: ms + overhead_ms for b, ms in verify_ms.items() if b >= 1}
    else:
        costs = step_ms
    known = sorted(costs)

    def verify(k: int) -> float:
        if k <= known[0]:
            return costs[known[0]]
        for lo, hi in zip(known, known[1:]):
            if lo <= k <= hi:
                w = (k - lo) / (hi - lo)
                return costs[lo] * (1 - w) + costs[hi] * w
        return costs[known[-1]]

    speed = {}
    for k in range(0, len(at_least) + 1):
        tokens = 1 + sum(at_least[:k])
        speed[k] = 1000 * tokens / (verify(k) + k * draft_ms_per_token)
    best = max(speed, key=speed.get)
    return best, speed


def draft_length_limits(speed: dict[int, float]) -> tuple[int, int]:
    """(--spec-draft-n-max, --spec-draft-n-min) from best_draft_length's k -> tokens/s: n-max
    the best length; n-min the shortest draft still faster than not drafting (llama.cpp drops
    a draft that stops early, at --spec-draft-p-min, below n-min: a plain step is then
    cheaper). (0, 0): drafting does not pay at any length."""
    n_max = max(speed, key=speed.get)
    if n_max == 0:
        return 0, 0
    n_min = min(k for k in speed if k >= 1 and speed[k] >= speed[0])
    return n_max, n_min


def llama_cpp_settings(cfg, head, run_target, out_dir: Path) -> LlamaCppSettings:
    """bench.llama_cpp resolved: the target GGUF (heads.interop.gguf.TargetGGUF: "auto", the
    target's own file; an outtype, converted once; a path) and the draft GGUF (exported from
    `head` when not given); a null --spec-type is read from that file when the servers start
    (build_llama_cpp_methods). `run_target`: the run's heads.target.RunTarget."""
    from omegaconf import OmegaConf

    from eval.bench.llama_cpp_targets import resolve_target_ggufs
    from heads.interop.gguf import export_gguf

    doc = OmegaConf.to_container(cfg.llama_cpp, resolve=True)
    settings = LlamaCppSettings(**doc)
    settings.target_gguf, settings.resolved_types = resolve_target_ggufs(
        run_target.config, settings.target_gguf
    )
    if settings.draft_gguf is None and "llama_cpp_draft" in cfg.methods:
        if head is None:
            raise ConfigError(
                "llama_cpp_draft needs head_path (or llama_cpp.draft_gguf): give head_path=DIR."
            )
        check_draft_head(head)  # a head llama.cpp serves, before exporting it
        kind = settings.draft_outtype
        draft = out_dir / f"draft-{kind}.gguf"
        gguf = export_gguf(head, run_target.target, run_target.source, draft, kind)
        settings.draft_gguf = str(gguf)
    return settings
