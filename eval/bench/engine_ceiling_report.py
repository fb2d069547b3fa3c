"""report.md, summary.json and plots of an engine-ceiling run (eval/bench/engine_ceiling.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def _f(value, digits: int = 2, none: str = "-") -> str:
    return none if value is None else f"{value:.{digits}f}"


def _machine_lines(summary: dict) -> list[str]:
    m, s = summary["machine"], summary["settings"]
    return [
        f"- machine: {m['cpu_model']}, {m['logical_cpus']} logical CPUs; AMX: "
        f"{'yes' if m['amx'] else 'no'}; AVX-512 BF16: {'yes' if m['avx512_bf16'] else 'no'}",
        f"- target: {summary['target']}; {s['threads']} threads per process; llama-bench depth "
        f"{s['depth']}, {s['reps']} repetitions; {s['prompts']} MT-bench first turns x "
        f"{s['max_new_tokens']} new tokens; KV cache {s['cache_type']}, flash attention "
        f"{s['flash_attn']}",
        f"- draft: {s['draft_gguf'] or 'none'}",
        f"- fastest plain type here: **{summary['fastest_plain']['type']}** "
        f"({summary['fastest_plain']['gguf_type']}, "
        f"{summary['fastest_plain']['tokens_per_s']:.1f} tokens/s)",
    ]


def _curve_table(summary: dict) -> list[str]:
    batches = summary["settings"]["batches"]
    lines = [
        "| target type | 1 token | " + " | ".join(f"k={b}" for b in batches if b != 1) + " |",
        "|---" * (len(batches) + 1) + "|",
    ]
    for label, entry in summary["types"].items():
        curve = entry["verify_curve"]
        rel = curve["relative"]
        cells = [f"{label} ({entry['gguf_type']})", f"{curve['ms']['1']:.1f} ms"]
        cells += [f"{rel[str(b)]:.2f}x" for b in batches if b != 1]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _plain_table(summary: dict) -> list[str]:
    lines = ["| target type | plain tokens/s | vs fastest plain |", "|---|---|---|"]
    for label, entry in summary["types"].items():
        p = entry["plain"]
        lines.append(f"| {label} | {p['tokens_per_s']:.1f} | {_f(p['speedup_vs_fastest_plain'])} |")
    return lines


def _forced_table(summary: dict) -> list[str]:
    types = [t for t, e in summary["types"].items() if "chains" in e]
    if not types:
        return ["(no draft given: no llama-server runs with a draft)"]
    lines = [
        "Speedup against the same type's plain decoding (against the fastest plain type):",
        "",
        "| forced per-position rates (tau) | " + " | ".join(types) + " |",
        "|---" * (len(types) + 1) + "|",
    ]
    for rates in summary["settings"]["rates"]:
        cells = [f"{', '.join(f'{r:g}' for r in rates)} ({1 + sum(rates):.2f})"]
        for t in types:
            runs = summary["types"][t]["chains"].get(str(len(rates)), {}).get("runs", [])
            run = next((r for r in runs if r["rates"] == rates), None)
            cells.append(
                "-"
                if run is None
                else f"{run['speedup']:.2f}x ({run['speedup_vs_fastest_plain']:.2f}x)"
            )
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _break_even_table(summary: dict) -> list[str]:
    lines = [
        "| target type | drafted tokens | step ms = a + b tau | break-even tau | "
        "verify-only break-even tau |",
        "|---|---|---|---|---|",
    ]
    for label, entry in summary["types"].items():
        for chain, model in entry.get("chains", {}).items():
            fit = model["step_ms_fit"]
            measured = _f(model["break_even_tau"], none="never")
            verify_only = _f(model.get("break_even_tau_verify_only"))
            lines.append(
                f"| {label} | {chain} | {fit['a']:.1f} + {fit['b']:.1f} tau | {measured} | "
                f"{verify_only} |"
            )
    return lines


def _own_table(summary: dict) -> list[str]:
    rows = [(t, e["own"]) for t, e in summary["types"].items() if "own" in e]
    if not rows:
        return []
    lines = [
        "| target type | drafted | tau | tokens/s | speedup (vs fastest plain) | predicted | "
        "n-max / n-min from the curve |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, own in rows:
        length = own.get("draft_length")
        choice = f"{length['n_max']} / {length['n_min']}" if length else "-"
        lines.append(
            f"| {label} | {own['chain']} | {own['tau']:.2f} | {own['tokens_per_s']:.1f} | "
            f"{own['speedup']:.2f}x ({own['speedup_vs_fastest_plain']:.2f}x) | "
            f"{_f(own.get('predicted_speedup'))}x | {choice} |"
        )
    return lines


def render(summary: dict, plots: list[str], title: str = "Engine ceiling") -> str:
    lines = [f"# {title}: llama.cpp on {summary['target']}", ""]
    lines += ["Measured by:", "", "```", summary["command"], "```", ""]
    if summary.get("full_command"):
        lines += ["The full measurement:", "", "```", summary["full_command"], "```", ""]
    lines += _machine_lines(summary)
    lines += ["", "## Verify cost: a batch of k tokens over one token (llama-bench)", ""]
    lines += _curve_table(summary)
    lines += ["", "## Plain decoding (llama-server, decode tokens/s)", ""]
    lines += _plain_table(summary)
    lines += ["", "## A draft with forced acceptance (`--spec-synth-rates`)", ""]
    lines += _forced_table(summary)
    lines += ["", "## Break-even tau per type and number of drafted tokens", ""]
    lines += [
        "A drafted step of tau tokens costs a + b tau ms (fitted over the forced runs); it breaks",
        "even with plain decoding when tau x (plain ms per token) = a + b tau. The verify-only",
        "break-even is llama-bench's verify(k+1) / verify(1): what a draft costing nothing needs.",
        "",
    ]
    lines += _break_even_table(summary)
    own = _own_table(summary)
    if own:
        lines += ["", "## The draft with its own acceptance", ""] + own
    lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def plot_all(summary: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, entry in summary["types"].items():
        rel = {int(k): v for k, v in entry["verify_curve"]["relative"].items()}
        ax.plot(sorted(rel), [rel[k] for k in sorted(rel)], marker="o", label=label)
    ax.set(
        xscale="log",
        xlabel="tokens in the batch (k)",
        ylabel="cost over one token",
        title=f"Verify cost at depth {summary['settings']['depth']}",
    )
    ax.set_xticks(summary["settings"]["batches"], [str(b) for b in summary["settings"]["batches"]])
    ax.legend()
    names.append(_save(fig, plt, out / "verify_cost.png"))
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, entry in summary["types"].items():
        points = [
            (r["tau"], r["speedup_vs_fastest_plain"])
            for m in entry.get("chains", {}).values()
            for r in m["runs"]
        ]
        if points:
            ax.scatter(*zip(*points), label=label)
        if "own" in entry:
            ax.scatter(
                [entry["own"]["tau"]], [entry["own"]["speedup_vs_fastest_plain"]], marker="x"
            )
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(
        xlabel="tau (forced; x: the draft's own)",
        ylabel="speedup vs fastest plain type",
        title="llama-server with a draft",
    )
    if ax.has_data():
        ax.legend()
    names.append(_save(fig, plt, out / "speedup_vs_tau.png"))
    return names


def _save(fig, plt, path: Path) -> str:
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
    return path.name


def write(summary: dict, out_dir: str | Path) -> Path:
    """Write summary.json, the plots and report.md into out_dir (each file atomically)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = plot_all(summary, out)
    for name, text in (
        ("summary.json", json.dumps(summary, indent=2, allow_nan=False) + "\n"),
        ("report.md", render(summary, plots)),
    ):
        tmp = out / f".{name}.tmp-{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, out / name)
    return out / "report.md"
