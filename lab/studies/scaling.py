"""The scale study: what self-distilled data buys a draft
(docs/reports/2026-12-01-scaling/README.md, scripts/scaling_study.py).

    python scripts/scaling_study.py --data SD.jsonl --budgets 25000 100000 400000
    python scripts/scaling_study.py --report-only   # re-render the report's table and plots

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
accumulate in docs/reports/2026-12-01-scaling/scaling/results.json (merged point by point, so
two invocations on different points may run side by side); the report and plots are rendered
from it.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from data.errors import ConfigError, DraftsmithError
from lab.studies.scaling_report import COMPARISONS, render
from train.rundir import DATA_STATS, METRICS_FILE

REPO = Path(__file__).resolve().parents[2]
# the experiments a point trains, and the trees its tau is measured with
EXPERIMENTS = {"medusa_llama": ["tree16"], "eagle3_llama": ["tree16", "dynamic"]}
HUMAN = [
    "data/corpora/oasst_en/conversations.jsonl",
    "data/corpora/gpteacher_roleplay/roleplay-simple-deduped-roleplay-instruct.json",
]


@dataclass
class StudyConfig:
    """One invocation of the study (the script's flags, the same names).

    data: self-distilled conversations (JSONL), named `kind` in the point keys; shuffle: a seeded
    shuffle before the held-out cut. budgets: assistant tokens per point; steps: training steps
    per method; compare: extra points, `corpus_prompts=FILE` or `human`, at the first budget;
    dynamic_at: budgets at which EAGLE-3 is also measured with the dynamic tree (null: every).
    gen_tokens_per_s: the generation rate of --data, for the minutes axis; threads: torch
    threads per run; out: runs; docs: the folder that holds scaling/ (results, table, plot):
    docs/reports/2026-12-01-scaling.
    """

    data: Path | None = None
    budgets: list[int] = field(default_factory=lambda: [25_000, 100_000, 400_000])
    methods: list[str] = field(default_factory=lambda: list(EXPERIMENTS))
    steps: dict = field(default_factory=lambda: {"medusa_llama": 200, "eagle3_llama": 300})
    kind: str = "synth"
    shuffle: bool = False
    val_rows: int = 80
    max_length: int = 768
    per_category: int = 2
    max_new_tokens: int = 48
    threads: int | None = None
    gen_tokens_per_s: float | None = None
    compare: list[str] = field(default_factory=list)
    dynamic_at: list[int] | None = None
    out: Path = REPO / "outputs" / "scaling"
    docs: Path = REPO / "docs" / "reports" / "2026-12-01-scaling"
    report_only: bool = False

    def __post_init__(self) -> None:
        if self.kind in COMPARISONS:
            raise ConfigError(
                f"--kind {self.kind} names a --compare point; give --data another kind"
            )
        for extra in self.compare:
            kind = extra.partition("=")[0]
            if kind not in COMPARISONS:
                raise ConfigError(f"unknown comparison {kind!r}: use corpus_prompts=FILE or human")
        unknown = sorted(set(self.methods) - set(EXPERIMENTS))
        if unknown:
            raise ConfigError(f"methods {unknown}: the study trains {', '.join(EXPERIMENTS)}")
        missing = sorted(set(self.methods) - set(self.steps))
        if missing:
            raise ConfigError(f"--steps gives no steps for {missing}")
        if not self.report_only and self.data is None:
            raise ConfigError("--data is required (or --report-only)")
        self.out, self.docs = Path(self.out), Path(self.docs)
        self.data = None if self.data is None else Path(self.data)


def run_study(cfg: StudyConfig) -> dict:
    """Measure every point not yet measured (unless report_only), then render the report;
    returns the results."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    results_file = cfg.docs / "scaling" / "results.json"
    results = load_results(results_file)
    if not cfg.report_only:
        val_file = cfg.out / "val.jsonl"
        rows = complete_rows(cfg.data)
        if cfg.shuffle:
            rows = shuffled(rows)
        if not val_file.is_file():
            if len(rows) < cfg.val_rows:
                raise DraftsmithError(
                    f"{cfg.data} has {len(rows)} rows; the held-out set needs {cfg.val_rows}"
                )
            write_atomic(val_file, rows[: cfg.val_rows])
        held_out = {json.dumps(r["messages"]) for r in read_jsonl(val_file)}
        train_rows = [r for r in rows if json.dumps(r["messages"]) not in held_out]
        have = loss_tokens(train_rows)
        print(
            f"{cfg.data}: {len(rows)} rows; training rows {len(train_rows)} "
            f"(~{have} assistant tokens); held out {len(held_out)}",
            flush=True,
        )
        for point in plan(cfg, have):
            key = point["key"]
            if point.get("wait"):
                print(f"{key}: waiting for data ({have} of {point['budget']} tokens)", flush=True)
                continue
            out = run_point(cfg, point, train_rows, val_file)
            results = record(results_file, key, out, point["kind"], meta(cfg))
    render(results, cfg.docs)
    return results


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


def plan(cfg: StudyConfig, have: int) -> list[dict]:
    """The points to measure: every (budget, method) of --data (waiting while the data is short
    of the budget), then the --compare points at the smallest budget."""
    points = []
    dynamic_at = set(cfg.dynamic_at if cfg.dynamic_at is not None else cfg.budgets)
    for budget in sorted(cfg.budgets):
        for method in cfg.methods:
            trees = [t for t in EXPERIMENTS[method] if t != "dynamic" or budget in dynamic_at]
            points.append(
                {
                    "key": f"{method}-{cfg.kind}-{budget}",
                    "method": method,
                    "kind": cfg.kind,
                    "budget": budget,
                    "trees": trees,
                    "wait": have < budget * 0.98,
                }
            )
    for extra in cfg.compare:
        kind, _, path = extra.partition("=")
        budget = min(cfg.budgets)
        for method in cfg.methods:
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


def run_point(cfg: StudyConfig, point: dict, train_rows: list[dict], val_file: Path) -> dict:
    """Train the point's experiment (unless its head exists) and measure tau with each of its
    trees (unless measured); returns what the results file keeps of it."""
    method, budget = point["method"], point["budget"]
    experiment = method
    run_dir = cfg.out / point["key"]
    data_file = cfg.out / f"train-{point['key']}.jsonl"
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
    steps = int(cfg.steps[method])
    src = ",".join(f"{{path: '{s}'}}" for s in sources)
    overrides = [
        f"+experiment={experiment}", "data.self_distill.enabled=false", f"data.sources=[{src}]",
        f"data.val_sources=[{{path: '{val_file}'}}]", "data.max_val_examples=0",
        f"data.max_train_tokens={budget}", f"trainer.max_steps={steps}",
        # two answered turns of up to 256 tokens: whole conversations, packed (as the *_long
        # recipes), so a budget's tokens are all trained on
        f"data.max_length={cfg.max_length}", f"trainer.pack_tokens={cfg.max_length}",
        f"trainer.eval_every={steps}", f"trainer.save_every={min(100, steps)}", "evaluators=[]",
        "trainer.best_metric=null", "logger.mode=disabled", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if cfg.threads:
        env |= {"OMP_NUM_THREADS": str(cfg.threads)}
    out: dict = {k: point[k] for k in ("method", "kind", "budget")} | {"steps": steps}
    if point["kind"] not in COMPARISONS:
        out["gen_tokens_per_s"] = cfg.gen_tokens_per_s
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
                  f"bench.per_category={cfg.per_category}",
                  f"bench.max_new_tokens={cfg.max_new_tokens}", f"out_dir={eval_dir}",
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
        raise DraftsmithError(f"{' '.join(cmd[:3])} failed (exit {proc.returncode}); see {log}")


def train_metrics(run_dir: Path) -> dict:
    """Held-out top-1 per draft position at the end, the last logged training top-1 (the
    average over the last logging window), the data size and the training wall time."""
    out = {}
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


def meta(cfg: StudyConfig) -> dict:
    return {
        "data": str(cfg.data),
        "kind": cfg.kind,
        "shuffled": cfg.shuffle,
        "val_rows": cfg.val_rows,
        "max_length": cfg.max_length,
        "steps": cfg.steps,
        "bench": f"MT-bench, {cfg.per_category} questions per category (both turns), "
        f"{cfg.max_new_tokens} new tokens, greedy",
        "gen_tokens_per_s": cfg.gen_tokens_per_s,
        "threads": cfg.threads,
    }


__all__ = [
    "EXPERIMENTS",
    "StudyConfig",
    "cut_to_tokens",
    "load_results",
    "plan",
    "record",
    "run_study",
    "shuffled",
]
