"""Benchmark metrics (summary.json) and the human report (report.md + PNG plots).

`summarize(rows, depths, meta)` turns results.jsonl rows into per-method, per-category metrics;
`write_report(summary, rows, out_dir)` renders them. Plots use matplotlib's Agg backend.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from eval.bench.llama_cpp_targets import (
    add_fastest_plain,
    add_machine_fastest_plain,
    fastest_plain_lines,
    machine_fastest_plain_lines,
)

DEFINITIONS = {
    "tau": "acceptance length: tokens emitted by the decode forwards divided by the number of "
    "decode forwards, pooled over all requests (sum of tokens / sum of forwards). A decode "
    "forward is every target forward after the prefill; the prefill forward and the token(s) it "
    "emits are excluded. Emitted tokens include each step's bonus token and stop at EOS / "
    "max_new_tokens. Plain decoding has tau = 1.",
    "tau_per_request": "the same ratio computed per request, then averaged over requests "
    "(requests without a decode forward are left out).",
    "tokens_per_s": "new tokens (prefill token included) divided by wall-clock seconds of "
    "generation (prefill included), pooled over requests.",
    "speedup_vs_plain": "tokens_per_s of the method / tokens_per_s of `plain` (one token per "
    "forward, same cache code) over the same requests in the same run; for llama.cpp methods, "
    "of `llama_cpp_plain` (the same server without a draft); for OpenVINO, of `openvino_plain`; "
    "for vLLM, of `vllm_plain`.",
    "baseline_mismatches": "engine methods (llama.cpp, OpenVINO, vLLM): requests whose tokens "
    "differ from the same engine's plain decoding (`llama_cpp_plain`, `openvino_plain`, "
    "`vllm_plain`); a lossless draft has 0, whatever the engine's kernels do against HF.",
    "speedup_vs_hf_generate": "tokens_per_s of the method / tokens_per_s of HF `generate` "
    "(greedy) over the same requests in the same run.",
    "accept_rate_by_depth": "entry d-1: fraction of decode steps that accepted at least d draft "
    "tokens (accept length - 1 >= d), d = 1..max draft depth.",
    "draft_ms_per_step": "wall-clock milliseconds the proposer took per decode step (building "
    "the draft tree: head forwards, top-k, tree buffers), pooled over requests; 0 for methods "
    "that do not draft through a head.",
    "target_ms_per_forward": "the rest of the wall time (target forwards, verification, cache "
    "bookkeeping) divided by the number of target forwards, prefill included. Against "
    "`plain`'s value it shows what verifying a whole tree costs over one token.",
    "greedy_mismatches": "requests whose new tokens differ from HF `generate`'s greedy output, "
    "token for token (zero for a lossless greedy method).",
    "near_tie_mismatches": "mismatches whose first differing token sits where the target's top-1 "
    "and top-2 logits differ by less than the near-tie gap (one target forward over the HF "
    "`generate` sequence): floating-point ties, not acceptance bugs.",
}


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def group_metrics(rows: Sequence[dict], depth: int) -> dict:
    """Metrics of one method over some requests (rows of results.jsonl)."""
    decode_tokens = [r["new_tokens"] - r["prefill_tokens"] for r in rows]
    decode_forwards = [r["target_forwards"] - 1 for r in rows]
    per_request = [t / f for t, f in zip(decode_tokens, decode_forwards) if f > 0]
    steps = [a for r in rows for a in r["accept_lengths"]]
    new_tokens = sum(r["new_tokens"] for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    draft_seconds = sum(r.get("draft_seconds", 0.0) for r in rows)
    forwards = sum(r["target_forwards"] for r in rows)
    mismatches = [
        {k: r[k] for k in ("question_id", "turn", "first_mismatch", "top2_gap", "near_tie")}
        for r in rows
        if not r["greedy_match"]
    ]
    return {
        "requests": len(rows),
        "new_tokens": new_tokens,
        "decode_tokens": sum(decode_tokens),
        "target_forwards": forwards,
        "decode_forwards": sum(decode_forwards),
        "seconds": seconds,
        "draft_seconds": draft_seconds,
        "draft_ms_per_step": _ratio(1000 * draft_seconds, sum(decode_forwards)),
        "target_ms_per_forward": _ratio(1000 * (seconds - draft_seconds), forwards),
        "tau": _ratio(sum(decode_tokens), sum(decode_forwards)),
        "tau_per_request": _ratio(sum(per_request), len(per_request)),
        "tokens_per_s": _ratio(new_tokens, seconds),
        "speedup_vs_plain": None,
        "speedup_vs_hf_generate": None,
        "steps": len(steps),
        "accept_rate_by_depth": [
            _ratio(sum(a - 1 >= d for a in steps), len(steps)) for d in range(1, depth + 1)
        ],
        "accept_length_counts": {str(k): v for k, v in sorted(Counter(steps).items())},
        "greedy_mismatches": len(mismatches),
        "baseline_mismatches": sum(r.get("baseline_match") is False for r in rows),
        "near_tie_mismatches": sum(m["near_tie"] for m in mismatches),
        "mismatches": mismatches,
    }


def _add_speedups(methods: dict, group: str | None, baselines: dict | None = None) -> None:
    def get(name: str) -> dict | None:
        entry = methods.get(name)
        if entry is None:
            return None
        return entry["overall"] if group is None else entry["categories"].get(group)

    for name in methods:
        metrics = get(name)
        if metrics is None:
            continue
        plain = (baselines or {}).get(name) or "plain"
        for base, key in ((plain, "speedup_vs_plain"), ("hf_generate", "speedup_vs_hf_generate")):
            base_metrics = get(base)
            if base_metrics and base_metrics["tokens_per_s"] and metrics["tokens_per_s"]:
                metrics[key] = metrics["tokens_per_s"] / base_metrics["tokens_per_s"]


def _ordered(values: Iterable) -> list:
    return list(dict.fromkeys(values))


def summarize(
    rows: Sequence[dict], depths: dict[str, int], meta: dict, baselines: dict | None = None
) -> dict:
    """{"meta", "definitions", "methods": {name: {"overall": m, "categories": {cat: m}}}}.

    baselines: method -> the plain decoding its speedup is against (default `plain`; the
    llama.cpp methods use `llama_cpp_plain`, the same engine without a draft)."""
    categories = _ordered(r["category"] for r in rows)
    methods: dict[str, dict] = {}
    for name in _ordered([*depths, *(r["method"] for r in rows)]):
        mine = [r for r in rows if r["method"] == name]
        depth = depths.get(name, 0)
        methods[name] = {
            "max_draft_depth": depth,
            "overall": group_metrics(mine, depth),
            "categories": {
                c: group_metrics([r for r in mine if r["category"] == c], depth) for c in categories
            },
        }
    for group in [None, *categories]:
        _add_speedups(methods, group, baselines)
    for name, base in (baselines or {}).items():
        if name in methods:
            methods[name]["baseline"] = base
    summary = {"meta": meta, "definitions": dict(DEFINITIONS), "methods": methods}
    add_fastest_plain(summary)  # llama.cpp methods: also against the fastest plain type
    add_machine_fastest_plain(summary)  # and every method against the fastest on any engine
    return summary


# ---- report.md -------------------------------------------------------------------------------


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _row_cells(label: str, m: dict, depth: int) -> list[str]:
    mism = f"{m['greedy_mismatches']} ({m['near_tie_mismatches']})"
    cells = [
        label,
        _fmt(m["requests"]),
        _fmt(m["new_tokens"]),
        _fmt(m["tau"]),
        _fmt(m["tau_per_request"]),
        _fmt(m["tokens_per_s"], 1),
        _fmt(m["speedup_vs_plain"]),
        _fmt(m["speedup_vs_hf_generate"]),
        _fmt(m.get("draft_ms_per_step"), 1),
        _fmt(m.get("target_ms_per_forward"), 1),
        mism,
    ]
    rates = m["accept_rate_by_depth"]
    return cells + [_fmt(rates[d]) if d < len(rates) else "-" for d in range(depth)]


def _table(header: list[str], lines: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(cells) + " |" for cells in lines]


HEADER = [
    "",
    "requests",
    "new tokens",
    "tau",
    "tau/request",
    "tokens/s",
    "speedup vs plain",
    "speedup vs HF generate",
    "draft ms/step",
    "target ms/forward",
    "greedy mismatches (near ties)",
]


def render_markdown(summary: dict, plots: Sequence[str]) -> str:
    meta, methods = summary["meta"], summary["methods"]
    bench = meta.get("bench", {})
    lines = [f"# Benchmark: {bench.get('name', '?')} on {meta.get('target', '?')}", ""]
    for key in (
        "num_questions",
        "num_requests",
        "threads",
        "device",
        "tree",
        "tree_nodes",
        "tree_depth",
        "verifier",
        "head_path",
        "head_method",
        "head_settings",
        "heads",
        "target_adapted",
        "versions",
    ):
        if key in meta:
            lines.append(f"- {key}: {meta[key]}")
    lines.append(f"- max_new_tokens: {bench.get('max_new_tokens')}, warmup: {bench.get('warmup')}")
    if meta.get("verifier") not in (None, "greedy"):
        lines.append(
            f"- the `{meta['verifier']}` verifier samples: `plain` and `head` are not expected to "
            "match HF generate's greedy output, so greedy mismatches are no error here."
        )
    lines += ["", "## Overall", ""]
    overall = [_row_cells(name, e["overall"], 0) for name, e in methods.items()]
    lines += _table(["method", *HEADER[1:]], overall)
    lines += fastest_plain_lines(summary)
    lines += machine_fastest_plain_lines(summary)
    for name, entry in methods.items():
        depth = entry["max_draft_depth"]
        header = ["category", *HEADER[1:], *(f"accept >= {d}" for d in range(1, depth + 1))]
        body = [_row_cells("**overall**", entry["overall"], depth)]
        body += [_row_cells(c, m, depth) for c, m in entry["categories"].items()]
        lines += ["", f"## Method `{name}`", "", *_table(header, body)]
        details = entry["overall"]["mismatches"]
        if details:
            lines += ["", "Greedy mismatches (first differing new token, target top-2 gap):", ""]
            lines += [
                f"- question {m['question_id']} turn {m['turn']}: token {m['first_mismatch']}, "
                f"gap {_fmt(m['top2_gap'], 6)}{' (near tie)' if m['near_tie'] else ''}"
                for m in details
            ]
    lines += ["", "## Definitions", ""]
    lines += [f"- **{k}**: {v}" for k, v in summary["definitions"].items()]
    lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


# ---- plots -----------------------------------------------------------------------------------


def _drafting(summary: dict) -> dict:
    return {n: e for n, e in summary["methods"].items() if e["max_draft_depth"] > 0}


def plot_accept_lengths(summary: dict, path: Path, plt) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    drafting = _drafting(summary)
    width = 0.8 / max(len(drafting), 1)
    for i, (name, entry) in enumerate(drafting.items()):
        counts = {int(k): v for k, v in entry["overall"]["accept_length_counts"].items()}
        total = sum(counts.values()) or 1
        xs = sorted(counts)
        offset = (i - (len(drafting) - 1) / 2) * width  # bars of one length side by side
        ax.bar([x + offset for x in xs], [counts[x] / total for x in xs], width, label=name)
    ax.set(
        xlabel="tokens emitted per decode step (accepted + bonus)",
        ylabel="fraction of steps",
        title="Accepted length per step",
    )
    _finish(fig, ax, path, plt, bool(drafting))


def plot_accept_rates(summary: dict, path: Path, plt) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    drafting = _drafting(summary)
    for name, entry in drafting.items():
        rates = entry["overall"]["accept_rate_by_depth"]
        ax.plot(range(1, len(rates) + 1), [r or 0.0 for r in rates], marker="o", label=name)
    ax.set(
        xlabel="draft depth d",
        ylabel="fraction of steps accepting >= d",
        ylim=(0, 1.05),
        title="Acceptance rate by depth",
    )
    _finish(fig, ax, path, plt, bool(drafting))


def plot_tokens_per_s(summary: dict, path: Path, plt) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(summary["methods"])
    speeds = [summary["methods"][n]["overall"]["tokens_per_s"] or 0.0 for n in names]
    bars = ax.bar(names, speeds, color="tab:blue")
    for bar, name in zip(bars, names):
        speedup = summary["methods"][name]["overall"]["speedup_vs_plain"]
        if speedup is not None:
            ax.annotate(
                f"{speedup:.2f}x",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
            )
    ax.set(ylabel="new tokens / s", title="Throughput (x: speedup vs plain)")
    _finish(fig, ax, path, plt, False)


def _finish(fig, ax, path: Path, plt, legend: bool) -> None:
    if legend:
        ax.legend()
    elif not ax.has_data():
        ax.text(0.5, 0.5, "no drafting method in this run", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


PLOTS = {
    "accept_length_hist.png": plot_accept_lengths,
    "accept_rate_by_depth.png": plot_accept_rates,
    "tokens_per_s.png": plot_tokens_per_s,
}


def write_report(summary: dict, out_dir: str | Path) -> Path:
    """Write the PNG plots and report.md into out_dir; returns the report's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    for name, plot in PLOTS.items():
        plot(summary, out / name, plt)
    path = out / "report.md"
    path.write_text(render_markdown(summary, list(PLOTS)))
    return path
