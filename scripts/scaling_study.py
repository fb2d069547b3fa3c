"""The scale study: what self-distilled data buys a draft (docs/scaling.md).

    python scripts/scaling_study.py --data SD.jsonl --budgets 25000 100000 400000
    python scripts/scaling_study.py --report-only          # re-render docs/scaling.md

SD.jsonl is a self-distilled conversations file (e.g. the smollm2_synth_long data, which may
still be growing: run `scripts/prepare_data.py +experiment=eagle3_llama data=smollm2_synth_long`
beside it). Its first --val-rows conversations are the held-out set of every run (written once
to OUT/val.jsonl); the rest is training data, cut per run to the budget's assistant (loss)
tokens (`data.max_train_tokens`). Each (method, budget) point trains the method's *_llama
experiment for a fixed number of steps (--steps: the same compute at every budget, so only the
data changes), then measures tau on MT-bench (--per-category questions of each of its 8
categories, both turns, --max-new-tokens) with each of the method's trees. Extra points compare
data kinds at one budget (--compare): the default recipe's corpus prompts answered by the target,
and the human answers of the corpora (teacher-forced human text).

--kind names the kind of --data (its points are keyed METHOD-KIND-BUDGET; default synth), so one
report holds curves on several files, e.g. the synthesised conversations and the target's answers
to every corpus prompt (`data=smollm2_distilled_full`). A file written one prompt source after
another needs --shuffle: a seeded shuffle before the held-out cut, so the held-out set and every
budget sample each source.

Resumable: a point whose head exists is not trained again, an evaluation with a summary is not
rerun, and a budget larger than the data written so far waits for a later invocation. Results
accumulate in docs/scaling/results.json (merged point by point, so two invocations on different
points may run side by side); the report and plots are rendered from it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the experiments a point trains, and the trees its tau is measured with
EXPERIMENTS = {"medusa_llama": ["tree16"], "eagle3_llama": ["tree16", "dynamic"]}
# the one-budget comparison points (--compare); every other kind is a curve over budgets
COMPARISONS = ("corpus_prompts", "human")
HUMAN = [
    "data/corpora/oasst_en/conversations.jsonl",
    "data/corpora/gpteacher_roleplay/roleplay-simple-deduped-roleplay-instruct.json",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, help="self-distilled conversations (JSONL)")
    p.add_argument("--budgets", type=int, nargs="+", default=[25_000, 100_000, 400_000])
    p.add_argument("--methods", nargs="+", default=list(EXPERIMENTS), choices=list(EXPERIMENTS))
    p.add_argument(
        "--steps",
        type=json.loads,
        default={"medusa_llama": 200, "eagle3_llama": 300},
        help="training steps per method, JSON (default: the 20-minute recipes' steps)",
    )
    p.add_argument("--kind", default="synth", help="the kind of --data, naming its points")
    p.add_argument(
        "--shuffle",
        action="store_true",
        help="shuffle --data (seeded) before the held-out cut: for a file written one prompt "
        "source after another (it must be complete)",
    )
    p.add_argument("--val-rows", type=int, default=80)
    p.add_argument("--max-length", type=int, default=768, help="data.max_length of every run")
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=None, help="torch threads per run")
    p.add_argument(
        "--gen-tokens-per-s",
        type=float,
        default=None,
        help="generation throughput of --data, for the minutes axis",
    )
    p.add_argument(
        "--compare",
        nargs="*",
        default=[],
        help="extra points: corpus_prompts=FILE (self-distilled answers to the corpus "
        "prompts), human (the corpora's human answers); at the first budget",
    )
    p.add_argument(
        "--dynamic-at",
        type=int,
        nargs="*",
        default=None,
        help="budgets at which EAGLE-3 is also measured with the dynamic tree "
        "(default: every budget)",
    )
    p.add_argument("--out", type=Path, default=REPO / "outputs" / "scaling")
    p.add_argument("--docs", type=Path, default=REPO / "docs")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args()
    if args.kind in COMPARISONS:
        p.error(f"--kind {args.kind} names a --compare point; give --data another kind")
    args.out.mkdir(parents=True, exist_ok=True)
    results_file = args.docs / "scaling" / "results.json"
    results = load_results(results_file)
    if not args.report_only:
        if args.data is None:
            p.error("--data is required (or --report-only)")
        val_file = args.out / "val.jsonl"
        rows = complete_rows(args.data)
        if args.shuffle:
            rows = shuffled(rows)
        if not val_file.is_file():
            if len(rows) < args.val_rows:
                sys.exit(
                    f"{args.data} has {len(rows)} rows; the held-out set needs {args.val_rows}"
                )
            write_atomic(val_file, rows[: args.val_rows])
        held_out = {json.dumps(r["messages"]) for r in read_jsonl(val_file)}
        train_rows = [r for r in rows if json.dumps(r["messages"]) not in held_out]
        have = loss_tokens(train_rows)
        print(
            f"{args.data}: {len(rows)} rows; training rows {len(train_rows)} "
            f"(~{have} assistant tokens); held out {len(held_out)}",
            flush=True,
        )
        points = plan(args, have)
        for point in points:
            key = point["key"]
            if point.get("wait"):
                print(f"{key}: waiting for data ({have} of {point['budget']} tokens)", flush=True)
                continue
            out = run_point(args, point, train_rows, val_file)
            results = record(results_file, key, out, point["kind"], meta(args))
    render(results, args.docs)


def load_results(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {"points": {}}


def record(path: Path, key: str, out: dict, kind: str, run_meta: dict) -> dict:
    """Adds one point's results to the file. It is read again just before the write, so the
    points another invocation added meanwhile are kept."""
    results = load_results(path)
    results["points"][key] = results["points"].get(key, {}) | out
    results.setdefault("meta_by_kind", {})[kind] = run_meta
    write_atomic_text(path, json.dumps(results, indent=2) + "\n")
    return results


def plan(args, have: int) -> list[dict]:
    points = []
    dynamic_at = set(args.dynamic_at if args.dynamic_at is not None else args.budgets)
    for budget in sorted(args.budgets):
        for method in args.methods:
            trees = [t for t in EXPERIMENTS[method] if t != "dynamic" or budget in dynamic_at]
            points.append(
                {
                    "key": f"{method}-{args.kind}-{budget}",
                    "method": method,
                    "kind": args.kind,
                    "budget": budget,
                    "trees": trees,
                    "wait": have < budget * 0.98,
                }
            )
    for extra in args.compare:
        kind, _, path = extra.partition("=")
        if kind not in COMPARISONS:
            raise SystemExit(f"unknown comparison {kind!r}: use corpus_prompts=FILE or human")
        budget = min(args.budgets)
        for method in args.methods:
            points.append(
                {
                    "key": f"{method}-{kind}-{budget}",
                    "method": method,
                    "kind": kind,
                    "budget": budget,
                    "trees": ["tree16"],
                    "path": path,
                }
            )
    return points


def run_point(args, point: dict, train_rows: list[dict], val_file: Path) -> dict:
    method, budget = point["method"], point["budget"]
    experiment = method
    run_dir = args.out / point["key"]
    data_file = args.out / f"train-{point['key']}.jsonl"
    if point["kind"] not in COMPARISONS:
        sources = [data_file]
        if not (run_dir / "head").is_dir():
            write_atomic(data_file, cut_to_tokens(train_rows, budget))
    elif point["kind"] == "corpus_prompts":
        sources = [data_file]
        if not (run_dir / "head").is_dir():
            write_atomic(data_file, shuffled(read_jsonl(Path(point["path"]))))
    else:  # human
        sources = [REPO / h for h in HUMAN]
    steps = int(args.steps[method])
    src = ",".join(f"{{path: '{s}'}}" for s in sources)
    overrides = [
        f"+experiment={experiment}", "data.self_distill.enabled=false", f"data.sources=[{src}]",
        f"data.val_sources=[{{path: '{val_file}'}}]", "data.max_val_examples=0",
        f"data.max_train_tokens={budget}", f"trainer.max_steps={steps}",
        # two answered turns of up to 256 tokens: whole conversations, packed (as the *_long
        # recipes), so a budget's tokens are all trained on
        f"data.max_length={args.max_length}", f"trainer.pack_tokens={args.max_length}",
        f"trainer.eval_every={steps}", f"trainer.save_every={min(100, steps)}", "evaluators=[]",
        "trainer.best_metric=null", "logger.mode=disabled", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if args.threads:
        env |= {"OMP_NUM_THREADS": str(args.threads)}
    out: dict = {k: point[k] for k in ("method", "kind", "budget")} | {"steps": steps}
    if point["kind"] not in COMPARISONS:
        out["gen_tokens_per_s"] = args.gen_tokens_per_s
    if not (run_dir / "head").is_dir():
        t0 = time.time()
        call([sys.executable, "train.py", *overrides], env, run_dir / "train.log")
        out["train_wall_s"] = time.time() - t0
    out |= train_metrics(run_dir)
    for tree in point["trees"]:
        eval_dir = run_dir / f"eval-{tree}"
        if not (eval_dir / "summary.json").is_file():
            call([sys.executable, "evaluate.py", f"+experiment={experiment}",
                  f"head_path={run_dir / 'head'}", "methods=[head]", f"tree={tree}",
                  f"bench.per_category={args.per_category}",
                  f"bench.max_new_tokens={args.max_new_tokens}", f"out_dir={eval_dir}",
                  f"hydra.run.dir={eval_dir}"], env, eval_dir / "evaluate.log")  # fmt: skip
        summary = json.loads((eval_dir / "summary.json").read_text())
        overall = summary["methods"]["head"]["overall"]
        out[f"tau_{tree}"] = overall["tau"]
        out[f"mismatches_{tree}"] = overall.get("greedy_mismatches")
    print(json.dumps({point["key"]: out}), flush=True)
    return out


def call(cmd: list[str], env: dict, log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[:3])} failed (exit {proc.returncode}); see {log}")


def train_metrics(run_dir: Path) -> dict:
    """Held-out top-1 per draft position at the end, the last logged training top-1 (the
    average over the last logging window), the data size and the training wall time."""
    out = {}
    from train.rundir import DATA_STATS, METRICS_FILE

    for line in (run_dir / METRICS_FILE).read_text().splitlines():
        row = json.loads(line)
        for k, v in row.items():
            if k.endswith("/top1") and (k.startswith("val/") or k.startswith("train/")):
                out[k] = v
        if "train/tokens" in row:
            out["train_tokens_seen"] = row["train/tokens"]
    stats = run_dir / DATA_STATS
    if stats.is_file():
        out["data"] = json.loads(stats.read_text())
    return out


# ---- data ---------------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def complete_rows(path: Path) -> list[dict]:
    """The rows of a file another process may be appending to (a half-written tail is left)."""
    data = path.read_bytes()
    data = data[: data.rfind(b"\n") + 1]
    return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]


_TOKENIZER = None


def _assistant_tokens(row: dict) -> int:
    global _TOKENIZER
    if _TOKENIZER is None:
        from data.paths import cache_root
        from heads.target import TargetConfig, load_tokenizer

        # the embedded target's tokenizer (converted from its GGUF on first use)
        name = "smollm2_135m"
        _TOKENIZER = load_tokenizer(
            name, TargetConfig(name_or_path=name, cache_dir=str(cache_root()))
        )
    text = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
    # each answer also ends with its end-of-turn token
    return sum(len(_TOKENIZER(t, add_special_tokens=False).input_ids) + 1 for t in text)


def loss_tokens(rows: list[dict]) -> int:
    return sum(_assistant_tokens(r) for r in rows)


def shuffled(rows: list[dict], seed: int = 0) -> list[dict]:
    """The rows in a seeded random order. A self-distilled corpus file is written one prompt
    source after another, so a budget's prefix of it would hold only the first source."""
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    return rows


def cut_to_tokens(rows: list[dict], budget: int) -> list[dict]:
    """The first rows holding `budget` assistant tokens (a little over: the loader cuts the
    last conversation exactly with data.max_train_tokens)."""
    out, total = [], 0
    for r in rows:
        if total >= budget * 1.05:
            break
        out.append(r)
        total += _assistant_tokens(r)
    return out


def write_atomic(path: Path, rows: list[dict]) -> None:
    write_atomic_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def write_atomic_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def meta(args) -> dict:
    return {
        "data": str(args.data),
        "kind": args.kind,
        "shuffled": args.shuffle,
        "val_rows": args.val_rows,
        "max_length": args.max_length,
        "steps": args.steps,
        "bench": f"MT-bench, {args.per_category} questions per category (both turns), "
        f"{args.max_new_tokens} new tokens, greedy",
        "gen_tokens_per_s": args.gen_tokens_per_s,
        "threads": args.threads,
    }


# ---- report -------------------------------------------------------------------------------------


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


if __name__ == "__main__":
    main()
