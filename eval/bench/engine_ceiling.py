"""The engine's ceiling: what speedup llama.cpp can give a draft on this CPU, per target type.

For each target type (heads.interop.gguf) it measures
- the verify-cost curve: milliseconds to decode a batch of k tokens at a fixed depth
  (`llama-bench -t T -p 1,2,4,8,16 -n 0 -d 256`), the cost of verifying k-1 drafted tokens;
- plain decoding in llama-server: decode tokens/s on the same prompts;
- llama-server with a given draft GGUF whose acceptance is forced (`--spec-synth-rates`, each
  a vector of unconditional per-position rates P(accept >= i+1), non-increasing, one per
  drafted token): the draft's compute is real, only its acceptance is set;
- the same draft with its own acceptance (chain `own_chain`), tau and tokens/s measured.

From those: per type and chain length k, the cost of a step, fitted as ms(tau) = a + b tau over
the forced runs (b: drafting and verify work that grows with acceptance, e.g. the draft
re-reading accepted tokens), the break-even tau (a step of tau tokens costs as much as tau plain
tokens: tau* = a / (t_plain - b)) and the verify-only break-even from llama-bench alone (a free
draft: verify(k+1) / verify(1)), the predicted speedup tau t_plain / (a + b tau) at the draft's
own measured tau (next to the measured one), and the draft lengths n-max/n-min that the measured
curve recommends for the draft's per-position acceptance
(eval.bench.llama_cpp.best_draft_length). All rates are decode-only (llama-server's
`predicted_*` timings: the prompt and its first token excluded), so types compare on what a
draft can change. The report (eval/bench/engine_ceiling_report.py) names the fastest plain
type and
gives every speedup against the same type's plain decoding and against that fastest one.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

from data.engines.llama_cpp import LlamaServer, ServerConfig
from data.engines.llama_tools import CostCurve, verify_cost_curve
from data.errors import ConfigError

DEFAULT_RATES = [[0.6], [0.55, 0.30, 0.15], [0.75, 0.55, 0.40], [1.0, 1.0, 1.0]]
# the full measurement behind docs/reports/2026-12-02-engine-ceiling (its report quotes it,
# {draft} filled in)
FULL_COMMAND = (
    "python scripts/engine_ceiling.py --model smollm2_135m --draft {draft} --threads 2 "
    "--types q4_0,auto,q4_k_m,q8_0,bf16,f32 --batches 1,2,4,8,16 --depth 256 --reps 5 "
    "--rates '0.6;0.55,0.30,0.15;0.75,0.55,0.40;1,1,1' --own-chain 3 --prompts 8 "
    "--max-new-tokens 128 --out docs/reports/2026-12-02-engine-ceiling"
)


@dataclass
class CeilingSettings:
    """What one ceiling run measures. `types`: target types (auto = the target's own GGUF)."""

    types: list[str] = field(
        default_factory=lambda: ["q4_0", "auto", "q4_k_m", "q8_0", "bf16", "f32"]
    )
    threads: int = 2
    batches: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    depth: int = 256
    reps: int = 5
    draft_gguf: str | None = None  # null: the verify curves and plain rates only
    spec_type: str | None = None  # null: read from the draft GGUF
    rates: list[list[float]] = field(default_factory=lambda: [list(r) for r in DEFAULT_RATES])
    own_chain: int = 3  # the draft with its own acceptance, drafting this many (0: skip)
    prompts: int = 8
    max_new_tokens: int = 128
    cache_type: str = "f16"  # what users serve (the server's defaults)
    flash_attn: str = "auto"

    @classmethod
    def from_text(cls, types: str, batches: str, rates: str, **options) -> CeilingSettings:
        """Settings as the command line spells them: comma-separated types and batch sizes,
        rate vectors split by ';' (each comma-separated), e.g. "0.6;0.55,0.30,0.15"."""
        return cls(
            types=[t for t in types.split(",") if t],
            batches=[int(x) for x in batches.split(",") if x.strip()],
            rates=[[float(x) for x in v.split(",")] for v in rates.split(";") if v],
            **options,
        )

    def __post_init__(self) -> None:
        if self.threads < 1 or self.reps < 1 or self.prompts < 1 or self.max_new_tokens < 2:
            raise ValueError("threads, reps and prompts must be >= 1 and max_new_tokens >= 2.")
        if 1 not in self.batches:
            raise ValueError(f"batches={self.batches}: include 1 (the plain token's cost).")
        for rates in self.rates:
            bad = any(not 0.0 <= r <= 1.0 for r in rates) or any(
                b > a for a, b in zip(rates, rates[1:])
            )
            if not rates or bad:
                raise ValueError(
                    f"forced rates {rates}: give per-position rates P(accept >= i+1) in [0, 1], "
                    "non-increasing, one per drafted token (llama-server --spec-synth-rates)."
                )


@dataclass
class ServerStats:
    """Decode-only totals of one llama-server configuration over the prompts."""

    requests: int
    tokens: int  # generated tokens, each request's first (from the prompt pass) included
    decode_ms: float  # from the first generated token to the last, summed
    accepted: int
    at_least: list[float] | None = None  # own runs: share of steps accepting >= i+1 drafts

    @property
    def decode_tokens(self) -> int:
        return self.tokens - self.requests

    @property
    def steps(self) -> int:
        return max(self.decode_tokens - self.accepted, 1)

    @property
    def tau(self) -> float:
        return self.decode_tokens / self.steps

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.decode_tokens / self.decode_ms if self.decode_ms > 0 else 0.0

    @property
    def step_ms(self) -> float:
        return self.decode_ms / self.steps

    def to_json(self) -> dict:
        return asdict(self) | {
            "tau": self.tau,
            "tokens_per_s": self.tokens_per_s,
            "step_ms": self.step_ms,
        }


def serve(config: ServerConfig, prompts: list[list[int]], max_new_tokens: int) -> ServerStats:
    """Greedy completions of `prompts` on one server; with verbosity 4, per-position acceptance."""
    from eval.bench.llama_cpp import accept_lengths

    tokens = accepted = 0
    ms = 0.0
    lengths: list[int] = []
    with LlamaServer(config) as server:
        server.complete(prompts[0], 8)  # warm-up: page the weights in, untimed
        server.new_log()
        for ids in prompts:
            done = server.complete(ids, max_new_tokens, seed=0)
            tokens += len(done.tokens)
            accepted += done.draft_accepted
            ms += float(done.timings.get("predicted_ms", 0.0))
            if config.verbosity == 4 and config.draft_n_max:
                request_log = _wait_for_stats(server, done)
                lengths += accept_lengths(done, request_log, config.draft_n_max)
    at_least = None
    if lengths:
        at_least = [
            sum(n - 1 >= d for n in lengths) / len(lengths)
            for d in range(1, config.draft_n_max + 1)
        ]
    return ServerStats(len(prompts), tokens, ms, accepted, at_least)


def _wait_for_stats(server: LlamaServer, done, wait_s: float = 5.0) -> str:
    import time

    from eval.bench.llama_cpp import _ACC_PER_POS

    text = server.new_log()
    deadline = time.monotonic() + wait_s
    while done.draft_accepted > 0 and not _ACC_PER_POS.search(text) and time.monotonic() < deadline:
        time.sleep(0.02)
        text += server.new_log()
    return text


# ---- the cost model ------------------------------------------------------------------------


def fit_step_cost(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ms = a + b tau over (tau, step ms) points of one type and chain length;
    one point (or one tau) gives b = 0."""
    if not points:
        raise ValueError("no forced-acceptance runs to fit a step cost to")
    taus = [t for t, _ in points]
    mean_t = sum(taus) / len(taus)
    mean_c = sum(c for _, c in points) / len(points)
    var = sum((t - mean_t) ** 2 for t in taus)
    if var < 1e-9:
        return mean_c, 0.0
    b = sum((t - mean_t) * (c - mean_c) for t, c in points) / var
    return mean_c - b * mean_t, b


def break_even_tau(a: float, b: float, plain_ms: float) -> float:
    """The tau at which a drafted step (a + b tau ms for tau tokens) is as fast as plain
    decoding (plain_ms per token): tau plain_ms = a + b tau. inf when no tau breaks even."""
    if plain_ms <= b:
        return math.inf
    return max(a / (plain_ms - b), 1.0)


def predicted_speedup(tau: float, a: float, b: float, plain_ms: float) -> float:
    return tau * plain_ms / (a + b * tau)


def verify_only_break_even(curve: CostCurve, chain: int) -> float:
    """Break-even tau if drafting cost nothing: verifying chain+1 tokens over one token's cost."""
    return curve.at(chain + 1) / curve.at(1)


def chain_model(forced: list[dict], plain: ServerStats, curve: CostCurve | None) -> dict:
    """Per chain length: the fitted step cost, break-even taus (measured and verify-only) and
    the forced runs' speedups. `forced`: [{"rates", "stats": ServerStats}] of one type."""
    out = {}
    plain_ms = 1000.0 / plain.tokens_per_s
    for chain in sorted({len(f["rates"]) for f in forced}):
        runs = [f for f in forced if len(f["rates"]) == chain]
        a, b = fit_step_cost([(f["stats"].tau, f["stats"].step_ms) for f in runs])
        entry = {
            "step_ms_fit": {"a": a, "b": b},
            "break_even_tau": _finite(break_even_tau(a, b, plain_ms)),  # null: never
            "runs": [
                {
                    "rates": f["rates"],
                    "forced_tau": 1 + sum(f["rates"]),
                    **f["stats"].to_json(),
                    "speedup": f["stats"].tokens_per_s / plain.tokens_per_s,
                }
                for f in runs
            ],
        }
        if curve is not None:
            entry["break_even_tau_verify_only"] = verify_only_break_even(curve, chain)
            entry["verify_ms"] = curve.at(chain + 1)
        out[str(chain)] = entry
    return out


def _finite(value: float) -> float | None:
    return None if math.isinf(value) else value


def draft_length_choice(
    at_least: list[float], curve: CostCurve, draft_ms: float, overhead_ms: float
) -> dict:
    """n-max and n-min for a draft's per-position acceptance on one type's measured curve."""
    from eval.bench.llama_cpp import best_draft_length, draft_length_limits

    best, speed = best_draft_length(
        at_least, draft_ms_per_token=draft_ms, verify_ms=curve.ms, overhead_ms=overhead_ms
    )
    n_max, n_min = draft_length_limits(speed)
    return {
        "n_max": n_max,
        "n_min": n_min,
        "tokens_per_s": {str(k): v for k, v in speed.items()},
        "draft_ms_per_token": draft_ms,
        "overhead_ms": overhead_ms,
    }


def ceiling_costs(summary: dict, target_type: str | None) -> dict:
    """best_draft_length's step costs (verify_ms, draft_ms_per_token, overhead_ms) for one type
    of a finished ceiling run (its summary.json), to price draft lengths beyond a benchmark's
    (scripts/draft_length.py --ceiling); ConfigError naming the measured types otherwise."""
    types = summary["types"]
    entry = types.get(target_type)
    if entry is None:
        raise ConfigError(f"--type {target_type}: the ceiling run measured {sorted(types)}")
    length = (entry.get("own") or {}).get("draft_length") or {}
    return {
        "verify_ms": {int(k): v for k, v in entry["verify_curve"]["ms"].items()},
        "draft_ms_per_token": length.get("draft_ms_per_token", 0.0),
        "overhead_ms": length.get("overhead_ms", 0.0),
    }


# ---- one run ---------------------------------------------------------------------------------


def machine_info() -> dict:
    """The CPU the numbers come from: lscpu's model name, and whether it has AMX and AVX-512
    BF16 (the matmul units that change which type is fastest)."""
    import platform
    import subprocess

    model = platform.processor() or "unknown"
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next(
            (
                ln.split(":", 1)[1].strip()
                for ln in text.splitlines()
                if ln.startswith("Model name")
            ),
            model,
        )
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        flags = open("/proc/cpuinfo").read().split()  # noqa: SIM115 (read whole, small)
    except OSError:
        flags = []
    return {
        "cpu_model": model,
        "amx": any(f.startswith("amx") for f in flags),
        "avx512_bf16": "avx512_bf16" in flags,
        "logical_cpus": os.cpu_count(),
    }


def mt_bench_prompts(tokenizer, count: int) -> list[list[int]]:
    """Token ids of the first turns of the first `count` MT-bench questions, chat-templated."""
    from pathlib import Path

    from data.chat import ChatEncoder
    from data.formats import read_prompts

    path = Path(__file__).resolve().parents[2] / "data/corpora/mt_bench/question.jsonl"
    rows = read_prompts(str(path))[:count]
    encoder = ChatEncoder(tokenizer)
    return [encoder.prompt([{"role": "user", "content": row["turns"][0]}]) for row in rows]


def measure_type(gguf: str, settings: CeilingSettings, prompts: list[list[int]], log=print) -> dict:
    """Everything the ceiling measures on one target GGUF."""
    from heads.interop.gguf import spec_type_of_gguf

    curve = verify_cost_curve(
        gguf, settings.threads, tuple(settings.batches), settings.depth, settings.reps
    )
    log(f"  verify cost (ms by batch): { ({k: round(v, 2) for k, v in curve.ms.items()}) }")
    base = dict(
        model=gguf,
        threads=settings.threads,
        cache_type=settings.cache_type,
        flash_attn=settings.flash_attn,
    )
    plain = serve(ServerConfig(**base), prompts, settings.max_new_tokens)
    log(f"  plain: {plain.tokens_per_s:.1f} tokens/s")
    out = {"gguf": gguf, "verify_curve": curve.to_json(), "plain": plain.to_json()}
    if not settings.draft_gguf:
        return out
    spec_type = settings.spec_type or spec_type_of_gguf(settings.draft_gguf)
    drafted = dict(base, draft=settings.draft_gguf, spec_type=spec_type)
    forced = []
    for rates in settings.rates:
        rate_arg = ",".join(f"{r:g}" for r in rates)
        cfg = ServerConfig(
            **drafted, draft_n_max=len(rates), extra_args=["--spec-synth-rates", rate_arg]
        )
        stats = serve(cfg, prompts, settings.max_new_tokens)
        log(
            f"  forced {rate_arg}: tau {stats.tau:.2f}, {stats.tokens_per_s:.1f} tokens/s "
            f"({stats.tokens_per_s / plain.tokens_per_s:.2f}x)"
        )
        forced.append({"rates": rates, "stats": stats})
    out["chains"] = chain_model(forced, plain, curve)
    if settings.own_chain > 0:
        cfg = ServerConfig(**drafted, draft_n_max=settings.own_chain, verbosity=4)
        own = serve(cfg, prompts, settings.max_new_tokens)
        log(f"  own acceptance: tau {own.tau:.2f}, {own.tokens_per_s:.1f} tokens/s")
        out["own"] = own_draft_entry(own, plain, curve, out["chains"], settings.own_chain)
    return out


def own_draft_entry(
    own: ServerStats, plain: ServerStats, curve: CostCurve, chains: dict, chain: int
) -> dict:
    """The draft's own run: measured speedup, the speedup the fit predicts at its tau, and the
    draft lengths the measured curve recommends for its per-position acceptance."""
    entry = {**own.to_json(), "chain": chain, "speedup": own.tokens_per_s / plain.tokens_per_s}
    model = chains.get(str(chain))
    if model is None:
        return entry
    a, b = model["step_ms_fit"]["a"], model["step_ms_fit"]["b"]
    plain_ms = 1000.0 / plain.tokens_per_s
    entry["predicted_speedup"] = predicted_speedup(own.tau, a, b, plain_ms)
    if own.at_least:
        overhead = plain_ms - curve.at(1)
        draft_ms = max((a + b - curve.at(chain + 1) - overhead) / chain, 0.0)
        entry["draft_length"] = draft_length_choice(own.at_least, curve, draft_ms, overhead)
    return entry


def fastest_plain_type(types: dict) -> str:
    """The type whose plain decoding is fastest (`types`: label -> measure_type's result)."""
    return max(types, key=lambda t: types[t]["plain"]["tokens_per_s"])


def ceiling_target(model: str):
    """The TargetConfig of an embedded name or HF folder, cached in $DRAFTSMITH_CACHE (else
    ~/.cache/draftsmith)."""
    from heads.target import TargetConfig

    return TargetConfig(
        model, cache_dir=os.environ.get("DRAFTSMITH_CACHE") or "~/.cache/draftsmith"
    )


def run_ceiling(settings: CeilingSettings, model_cfg, command: str, log=print) -> dict:
    """Measure every type of `settings.types` for the target `model_cfg`; returns summary.json's
    content: machine, settings, per type its measures, and the fastest plain type with every
    speedup also against it."""
    from heads.interop.gguf import gguf_type_name, target_gguf_of_type
    from heads.target import load_tokenizer

    tokenizer = load_tokenizer(model_cfg.name_or_path, model_cfg)
    prompts = mt_bench_prompts(tokenizer, settings.prompts)
    types = {}
    for label in settings.types:
        gguf = str(target_gguf_of_type(model_cfg, label))
        log(f"{label} ({gguf_type_name(gguf)}): {gguf}")
        types[label] = {
            "gguf_type": gguf_type_name(gguf),
            **measure_type(gguf, settings, prompts, log),
        }
    best = fastest_plain_type(types)
    best_rate = types[best]["plain"]["tokens_per_s"]
    for entry in types.values():
        ratio = entry["plain"]["tokens_per_s"] / best_rate
        entry["plain"]["speedup_vs_fastest_plain"] = ratio
        for model in entry.get("chains", {}).values():
            for run in model["runs"]:
                run["speedup_vs_fastest_plain"] = run["speedup"] * ratio
        if "own" in entry:
            own = entry["own"]
            own["speedup_vs_fastest_plain"] = own["speedup"] * ratio
            if "predicted_speedup" in own:
                own["predicted_speedup_vs_fastest_plain"] = own["predicted_speedup"] * ratio
    return {
        "command": command,
        "machine": machine_info(),
        "target": model_cfg.name_or_path,
        "settings": asdict(settings),
        "fastest_plain": {
            "type": best,
            "gguf_type": types[best]["gguf_type"],
            "tokens_per_s": best_rate,
        },
        "types": types,
    }
