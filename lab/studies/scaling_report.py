"""docs/reports/2026-12-01-scaling/scaling/: the scale study's table and plots, rendered from its
results file (lab/studies/scaling.py writes it point by point)."""

from __future__ import annotations

import math
from pathlib import Path

# the one-budget comparison points (--compare); every other kind is a curve over budgets
COMPARISONS = ("corpus_prompts", "human")


def render(results: dict, docs: Path) -> None:
    points = results.get("points", {})
    if not points:
        print("no results yet")
        return
    folder = docs / "scaling"
    folder.mkdir(parents=True, exist_ok=True)
    gen = {key: gen_rate(results, r) for key, r in points.items()}
    lines = []
    head = (
        "| method | data | assistant tokens | steps | train top-1 (1st draft) | held-out "
        "top-1 (1st/2nd/3rd) | tau tree16 | tau dynamic | train min | data min |"
    )
    lines += [head, "|" + "---|" * 10]
    for key in sorted(points, key=lambda k: (points[k]["method"], points[k]["kind"],
                                             points[k]["budget"])):  # fmt: skip
        r = points[key]
        val = [r.get(f"val/{h}/top1") for h in first_three(r)]
        tr = r.get(f"train/{first_three(r)[0]}/top1")
        data_min = r["budget"] / gen[key] / 60 if gen[key] else None
        lines.append(
            f"| {r['method']} | {r['kind']} | {r['budget']:,} | {r['steps']} | {fmt(tr)} | "
            f"{' / '.join(fmt(v) for v in val)} | {fmt(r.get('tau_tree16'))} | "
            f"{fmt(r.get('tau_dynamic'))} | {fmt((r.get('train_wall_s') or 0) / 60, 1)} | "
            f"{fmt(data_min, 1)} |"
        )
    (folder / "table.md").write_text("\n".join(lines) + "\n")
    plots(points, folder, gen)
    print("\n".join(lines))


def in_series(r: dict) -> bool:
    """Whether a point lies on a curve over budgets, not a one-budget comparison point."""
    return r["kind"] not in COMPARISONS


def gen_rate(results: dict, r: dict) -> float | None:
    """Generation tokens/s of a point's data, for its data minutes (None: none generated, or
    not known). The first study kept it once, in results["meta"], for its synth points."""
    if r["kind"] == "human":
        return None
    if r.get("gen_tokens_per_s"):
        return r["gen_tokens_per_s"]
    meta_kind = (results.get("meta_by_kind") or {}).get(r["kind"]) or {}
    if meta_kind.get("gen_tokens_per_s"):
        return meta_kind["gen_tokens_per_s"]
    return (results.get("meta") or {}).get("gen_tokens_per_s")


def first_three(r: dict) -> list[str]:
    names = sorted({k.split("/")[1] for k in r if k.startswith("val/") and k.endswith("/top1")})
    # EAGLE-3 logs its first draft twice (head0 and step0); its positions are the steps
    steps = [n for n in names if n.startswith("step")]
    return ((steps or names) + ["-", "-", "-"])[:3]


def fmt(v, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def plots(points: dict, folder: Path, gen: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for method, kind in sorted({(r["method"], r["kind"]) for r in points.values() if in_series(r)}):
        keys = [k for k, r in points.items() if r["method"] == method and r["kind"] == kind]
        keys.sort(key=lambda k: points[k]["budget"])
        name = f"{method} {kind}"
        for tree, style in (("tree16", "-o"), ("dynamic", "--s")):
            mine = [k for k in keys if f"tau_{tree}" in points[k]]
            if not mine:
                continue
            taus = [points[k][f"tau_{tree}"] for k in mine]
            axes[0].plot([points[k]["budget"] for k in mine], taus, style, label=f"{name} {tree}")
            minutes = [
                ((points[k].get("train_wall_s") or 0)
                 + (points[k]["budget"] / gen[k] if gen.get(k) else 0)) / 60
                for k in mine
            ]  # fmt: skip
            axes[1].plot(minutes, taus, style, label=f"{name} {tree}")
        first = first_three(points[keys[0]])[0]
        x = [points[k]["budget"] for k in keys]
        axes[2].plot(x, [points[k].get(f"val/{first}/top1") for k in keys], "-o",
                     label=f"{name} held-out")  # fmt: skip
        axes[2].plot(x, [points[k].get(f"train/{first}/top1") for k in keys], ":o",
                     label=f"{name} train")  # fmt: skip
    for ax, title, xl in (
        (axes[0], "MT-bench tau vs self-distilled tokens", "assistant tokens (log)"),
        (axes[1], "tau vs wall minutes (generation + training)", "minutes"),
        (axes[2], "top-1 of the first draft token", "assistant tokens (log)"),
    ):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xl)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_xscale("log")
    axes[2].set_xscale("log")
    fig.tight_layout()
    fig.savefig(folder / "scaling.png", dpi=110)
    plt.close(fig)


__all__ = ["COMPARISONS", "first_three", "gen_rate", "in_series", "render"]
