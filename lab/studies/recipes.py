"""The recipe search: which training recipe gives the best draft per training CPU-minute.

    python scripts/recipe_search.py --data SD.jsonl --variants variants.yaml --budgets 15 45 90

A *variant* is a base experiment plus Hydra overrides (`trainer.lr=1e-3`); a *point* is one
variant trained for one budget of training CPU-minutes with one seed, then measured: held-out
top-1 per drafted depth (the run's own validation), MT-bench tau with a chain of 3 drafted
tokens and with the dynamic tree (one evaluate.py run, so one HF greedy reference serves both),
greedy mismatches (must be 0), and the CPU and wall minutes it took.

Data. --data is a fixed conversations file. It is shuffled once (seeded) and cut: the first
`val_rows` rows are the held-out set of every point (OUT/val.jsonl), the rest the training data
(OUT/train.jsonl), so every point of a search, whatever its variant, trains and validates on
the same conversations and shares one feature cache.

Budget -> steps. A budget counts the CPU time of training steps as the loop logs it
(`train/cpu_min`: process CPU seconds inside optimizer steps, all threads; not data preparation,
the feature cache or validation). It becomes `trainer.max_steps` once per (variant, budget,
threads), fixed in OUT/steps.json: the LR schedule needs its horizon up front, and every seed of
a point must train the same steps. The rate (CPU seconds per step) is that of the variant's
longest finished point at the same threads (its whole-run average) when there is one, else a
probe run of `probe_steps` steps (the slope over its log windows after the first, which carries
one-off warm-up). The first epoch also derives per-example targets, so a probe's rate runs a
little high and a run past one epoch spends a little under its budget: each point records its
actual CPU-minutes, which the report tables and plots use. A CPU-time stop in the trainer was
not chosen: it would cut the LR schedule wherever it fell, seeds would train different step
counts, and a recipe ships a step count.

Resume and side by side. A point whose head exists is not trained again, an evaluation with a
summary is not rerun, and a killed training resumes from its last checkpoint. Each point is
run under a lock file: a second invocation with the same arguments skips the points the first
holds and takes the next, so N invocations at one thread each share a search. Results are
merged into DOCS/results.json point by point (read-modify-write under a lock, atomic rename).
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from data.errors import ConfigError, DraftsmithError
from lab.studies.runs import (
    call,
    child_env,
    children_cpu_s,
    eval_metrics,
    shell,
    train_metrics,
    train_rows,
)
from lab.studies.store import load_json, locked, read_jsonl, update_json, write_text
from lab.studies.variants import Variant

REPO = Path(__file__).resolve().parents[2]
# the heads: entries of each point's one evaluate.py run: a chain of 3 and EAGLE-2's dynamic tree
TREES = {"chain3": 3, "dynamic": "dynamic"}
MT_BENCH_TURNS = 16  # bench.per_category=1 is 8 categories x 2 turns
Runner = Callable[[list[str], dict, Path], None]


@dataclass
class SearchConfig:
    """One invocation of the search (see the module doc). `bench`: evaluate.py overrides that
    replace MT-bench (e.g. a small jsonl bench); `cpu_s_per_step`: a rate given instead of
    calibrating; `invocation`: the command line, recorded with each point."""

    variants: dict[str, Variant]
    budgets: list[float]
    data: Path | None = None
    seeds: list[int] = field(default_factory=lambda: [0])
    out: Path = REPO / "runs" / "recipes"
    docs: Path = REPO / "docs" / "reports" / "2026-12-02-recipe-search" / "recipes"
    val_rows: int = 44
    threads: int = 1
    turns: int = 32
    max_new_tokens: int = 128
    probe_steps: int = 30
    cpu_s_per_step: float | None = None
    bench: tuple[str, ...] = ()
    baseline: str = "baseline"
    split_seed: int = 0
    invocation: str | None = None

    def __post_init__(self) -> None:
        if not self.budgets or min(self.budgets) <= 0:
            raise ConfigError(f"budgets={self.budgets}: give CPU-minutes > 0, e.g. 15 45 90.")
        if not self.bench and (self.turns < 0 or self.turns % MT_BENCH_TURNS):
            raise ConfigError(
                f"turns={self.turns}: each question per category adds {MT_BENCH_TURNS} MT-bench "
                "turns (8 categories x 2); use a multiple, e.g. 32 (0: held-out only)."
            )
        if self.threads < 1 or self.val_rows < 1 or self.probe_steps < 2 or not self.seeds:
            raise ConfigError("threads and val_rows need >= 1, probe_steps >= 2, seeds a seed.")

    @property
    def results_file(self) -> Path:
        return self.docs / "results.json"

    @property
    def screening(self) -> bool:
        """turns=0 with no custom bench: held-out metrics only, no decoding (a screening round;
        the held-out chain estimate tracks MT-bench chain-3 tau,
        docs/reports/2026-12-02-acceptance-gap/README.md)."""
        return not self.bench and self.turns == 0

    @property
    def bench_label(self) -> str:
        if not self.bench:
            return f"mt_bench-{self.turns}t-{self.max_new_tokens}n"
        return f"custom-{hashlib.sha1(' '.join(self.bench).encode()).hexdigest()[:8]}"


@dataclass(frozen=True)
class Point:
    variant: Variant
    budget: float  # training CPU-minutes
    seed: int

    @property
    def key(self) -> str:
        return f"{self.variant.name}-{self.budget:g}m-s{self.seed}"


def plan(cfg: SearchConfig) -> list[Point]:
    """Every (variant, budget, seed) point: small budgets first, and within a budget each
    variant's first seed before any second seed (so calibrations and first looks come early)."""
    points = [
        Point(v, float(b), s)
        for b in sorted(set(cfg.budgets))
        for v in cfg.variants.values()
        for s in sorted(set(v.seeds or cfg.seeds))
    ]
    points.sort(key=lambda p: (p.budget, sorted(set(p.variant.seeds or cfg.seeds)).index(p.seed)))
    keys = [p.key for p in points]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"two points share a key among {keys}: rename a variant.")
    return points


# ---- files: the data split and the results file ----------------------------------------------


def record(path: Path, key: str, out: dict) -> dict:
    """Merge one point's results into the results file (its other keys are kept)."""

    def change(doc: dict) -> None:
        points = doc.setdefault("points", {})
        points[key] = points.get(key, {}) | out

    return update_json(path, change)


def split_data(cfg: SearchConfig) -> dict:
    """Cut --data once into OUT/val.jsonl and OUT/train.jsonl (seeded shuffle); later runs check
    that --data is still the file the split came from."""
    meta_file = cfg.out / "split.json"
    if meta_file.is_file():
        meta = load_json(meta_file)
        if cfg.data is not None and _sha1(cfg.data) != meta["sha1"]:
            raise DraftsmithError(
                f"{cfg.data} is not the file {cfg.out} was split from ({meta['data']}, sha1 "
                f"{meta['sha1'][:12]}): give that file, or another --out for new data."
            )
        if meta["val_rows"] != cfg.val_rows:
            raise DraftsmithError(f"{cfg.out} holds out {meta['val_rows']} rows, not "
                                  f"{cfg.val_rows}: give --val-rows {meta['val_rows']} or "
                                  "another --out.")  # fmt: skip
        return meta
    if cfg.data is None or not cfg.data.is_file():
        raise DraftsmithError(f"--data {cfg.data}: no such file (a conversations JSONL).")
    rows = read_jsonl(cfg.data)
    if len(rows) <= cfg.val_rows:
        raise DraftsmithError(f"{cfg.data} has {len(rows)} rows: too few for a held-out set "
                              f"of {cfg.val_rows} plus training data.")  # fmt: skip
    random.Random(cfg.split_seed).shuffle(rows)
    train, val = cfg.out / "train.jsonl", cfg.out / "val.jsonl"
    for path, part in ((val, rows[: cfg.val_rows]), (train, rows[cfg.val_rows :])):
        write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part))
    meta = {"data": str(cfg.data), "sha1": _sha1(cfg.data), "rows": len(rows),
            "val_rows": cfg.val_rows, "train_rows": len(rows) - cfg.val_rows,
            "split_seed": cfg.split_seed, "train": str(train), "val": str(val)}  # fmt: skip
    write_text(meta_file, json.dumps(meta, indent=2) + "\n")  # last: the split is complete
    return meta


def _sha1(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha1").hexdigest()


# ---- budget -> steps -------------------------------------------------------------------------


def probe_rate(rows: list[dict]) -> float | None:
    """CPU seconds per step of a probe: the slope from its first logged window to its last
    (the first window carries one-off warm-up); a single window's average otherwise."""
    if not rows:
        return None
    first, last = rows[0], rows[-1]
    if len(rows) >= 3:
        spent = last["train/cpu_min"] - first["train/cpu_min"]
        return spent * 60 / (last["step"] - first["step"])
    return last["train/cpu_min"] * 60 / last["step"]


def steps_for_budget(budget_min: float, cpu_s_per_step: float) -> int:
    """The step count that spends `budget_min` training CPU-minutes at this rate."""
    if not cpu_s_per_step > 0:
        raise DraftsmithError(f"a calibration of {cpu_s_per_step} CPU s per step: delete "
                              "OUT/steps.json's entry and the probe run, then rerun.")  # fmt: skip
    return max(1, round(budget_min * 60 / cpu_s_per_step))


def calibrate(cfg: SearchConfig, variant: Variant, files: dict, runner: Runner) -> tuple:
    """(CPU seconds per step, where it came from) for a variant at cfg.threads."""
    if cfg.cpu_s_per_step:
        return cfg.cpu_s_per_step, "given (--cpu-s-per-step)"
    done = [
        (key, r) for key, r in load_json(cfg.results_file).get("points", {}).items()
        if r.get("digest") == variant.digest and r.get("threads") == cfg.threads
        and r.get("cpu_min") and r.get("trained_steps")
    ]  # fmt: skip
    if done:
        key, r = max(done, key=lambda kr: kr[1]["trained_steps"])
        return r["cpu_min"] * 60 / r["trained_steps"], f"point {key} ({r['trained_steps']} steps)"
    run_dir = cfg.out / "probes" / f"{variant.name}-{variant.digest}-t{cfg.threads}"
    with locked(cfg.out / "probe.lock"):  # probes one at a time: the first builds the cache
        if not (run_dir / "head").is_dir():
            cmd = train_command(cfg, variant, 0, cfg.probe_steps, run_dir, files, probe=True)
            runner(cmd, child_env(cfg.threads), run_dir / "train.log")
    rate = probe_rate(train_rows(run_dir))
    if rate is None:
        raise DraftsmithError(f"the probe {run_dir} logged no train/cpu_min: see its train.log.")
    return rate, f"probe ({cfg.probe_steps} steps)"


def point_steps(cfg: SearchConfig, point: Point, files: dict, runner: Runner) -> dict:
    """The steps of a (variant, budget) at cfg.threads: fixed the first time in OUT/steps.json,
    so every seed and every later invocation trains the same count."""
    path, key = cfg.out / "steps.json", f"{point.variant.name}-{point.budget:g}m-t{cfg.threads}"
    known = load_json(path).get(key)
    if known is None:
        rate, source = calibrate(cfg, point.variant, files, runner)
        entry = {"digest": point.variant.digest, "cpu_s_per_step": rate, "calibration": source,
                 "steps": steps_for_budget(point.budget, rate)}  # fmt: skip
        # another invocation may have fixed it meanwhile: the first one written stays
        known = update_json(path, lambda doc: doc.setdefault(key, entry))[key]
    if known["digest"] != point.variant.digest:
        raise DraftsmithError(
            f"variant {point.variant.name} (its overrides or its experiment's settings) changed "
            f"since {path} fixed its steps: give the changed variant a new name (or delete the "
            f"{key} entry and OUT/points/{point.key})."
        )
    return known


# ---- commands --------------------------------------------------------------------------------


def train_command(cfg, variant: Variant, seed: int, steps: int, run_dir: Path, files: dict,
                  probe: bool = False) -> list[str]:  # fmt: skip
    """train.py on the split's data for `steps` steps: validation on the held-out set at the
    end only, no checkpoint-time tau (its wall time is the evaluation's job). The recipe's own
    wall-clock budget (`trainer.time_budget_min`) is switched off: a point's steps are fixed, and
    at one thread beside other jobs a 20-minute recipe would otherwise plan fewer."""
    overrides = [
        f"+experiment={variant.experiment}", "data.self_distill.enabled=false",
        f"data.sources=[{{path: '{files['train']}'}}]",
        f"data.val_sources=[{{path: '{files['val']}'}}]", "data.max_val_examples=0",
        f"seed={seed}", f"trainer.max_steps={steps}", "trainer.time_budget_min=0",
        f"trainer.eval_every={steps}", f"trainer.save_every={0 if probe else min(100, steps)}",
        "trainer.progress=false",
        "trainer.best_metric=null", "evaluators=[]", "logger.mode=disabled",
        *([f"trainer.log_every={max(1, steps // 6)}"] if probe else []),
        *variant.overrides, f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    return [sys.executable, "train.py", *overrides]


def eval_command(cfg: SearchConfig, variant: Variant, head: Path, eval_dir: Path) -> list[str]:
    """One evaluate.py run measuring the head with each of TREES (one shared HF reference)."""
    entries = [f"+heads.{n}={{path: '{head}', tree: {t}}}" for n, t in TREES.items()]
    bench = list(cfg.bench) or ["bench=mt_bench", f"bench.per_category={cfg.turns // 16}"]
    return [
        sys.executable, "evaluate.py", f"+experiment={variant.experiment}", "methods=[]",
        *entries, f"threads={cfg.threads}", *bench,
        f"bench.max_new_tokens={cfg.max_new_tokens}", "logger.mode=disabled",
        *variant.eval_overrides, f"out_dir={eval_dir}", f"hydra.run.dir={eval_dir}",
    ]  # fmt: skip


# ---- points ----------------------------------------------------------------------------------


def run_point(cfg: SearchConfig, point: Point, files: dict, runner: Runner = call) -> dict:
    """Train one point (unless its head exists) and evaluate it (unless its summary exists);
    returns its results."""
    variant, run_dir = point.variant, cfg.out / "points" / point.key
    steps = point_steps(cfg, point, files, runner)
    state_file = run_dir.with_name(f"{point.key}.json")
    state = _point_state(state_file, variant.digest, steps["steps"])
    train_cmd = train_command(cfg, variant, point.seed, steps["steps"], run_dir, files)
    eval_dir = run_dir / f"eval-{cfg.bench_label}"
    eval_cmd = eval_command(cfg, variant, run_dir / "head", eval_dir)
    if not (run_dir / "head").is_dir():
        state = _timed(runner, train_cmd, cfg.threads, run_dir / "train.log", state_file, "train")
    metrics = train_metrics(run_dir)
    measured: dict = {}
    if not cfg.screening:
        if not (eval_dir / "summary.json").is_file():
            state = _timed(runner, eval_cmd, cfg.threads, eval_dir / "evaluate.log", state_file,
                           "eval")  # fmt: skip
        summary = json.loads((eval_dir / "summary.json").read_text())
        measured = eval_metrics(summary, TREES)
    return {
        "variant": variant.name, "experiment": variant.experiment,
        "overrides": list(variant.overrides), "digest": variant.digest,
        "budget_cpu_min": point.budget, "seed": point.seed, "threads": cfg.threads,
        "steps": steps["steps"], "planned_cpu_s_per_step": steps["cpu_s_per_step"],
        "calibration": steps["calibration"],
        "train_wall_min": state.get("train_wall_s", 0.0) / 60,
        "train_process_cpu_min": state.get("train_cpu_s", 0.0) / 60,
        "eval_wall_min": state.get("eval_wall_s", 0.0) / 60,
        "bench": cfg.bench_label, "eval_dir": str(eval_dir),
        "commands": {"train": shell(train_cmd, cfg.threads),
                     "evaluate": shell(eval_cmd, cfg.threads)},
        "search_command": cfg.invocation, **metrics, **measured,
    }  # fmt: skip


def _point_state(path: Path, digest: str, steps: int) -> dict:
    """OUT/points/KEY.json: what the point trains (checked on resume) and the wall and CPU
    time its subprocesses took, summed over invocations."""
    state = load_json(path)
    if state and (state["digest"], state["steps"]) != (digest, steps):
        raise DraftsmithError(
            f"{path.with_suffix('')} was started with other settings (variant digest "
            f"{state['digest']}, {state['steps']} steps; the variant's overrides or its "
            "experiment's settings changed): rename the variant, or delete that folder and its "
            ".json to start the point again."
        )
    if not state:
        state = update_json(path, lambda d: d.update(digest=digest, steps=steps))
    return state


def _timed(runner: Runner, cmd: list[str], threads: int, log: Path, state_file: Path,
           what: str) -> dict:  # fmt: skip
    """Run a subprocess and add its wall and CPU seconds to the point's state."""
    wall, cpu = time.time(), children_cpu_s()
    runner(cmd, child_env(threads), log)
    wall, cpu = time.time() - wall, children_cpu_s() - cpu

    def add(d: dict) -> None:
        d[f"{what}_wall_s"] = d.get(f"{what}_wall_s", 0.0) + wall
        d[f"{what}_cpu_s"] = d.get(f"{what}_cpu_s", 0.0) + cpu

    return update_json(state_file, add)


def search_meta(cfg: SearchConfig, split: dict) -> dict:
    return {
        **{k: split[k] for k in ("data", "sha1", "rows", "val_rows", "train_rows", "split_seed")},
        "threads": cfg.threads, "bench": cfg.bench_label, "turns": cfg.turns,
        "max_new_tokens": cfg.max_new_tokens, "baseline": cfg.baseline, "trees": list(TREES),
    }  # fmt: skip


BENCH_META = ("threads", "bench", "turns", "max_new_tokens")


def merged_meta(cfg: SearchConfig, split: dict, results: dict) -> dict:
    """The results' meta for this invocation. A screening round decodes nothing, so it keeps the
    bench settings a measured round wrote (the report's header names the bench its tau came
    from); a measured round writes its own."""
    meta, old = search_meta(cfg, split), results.get("meta", {})
    if cfg.screening and old.get("turns"):
        meta.update({k: old[k] for k in BENCH_META if k in old})
    return meta


def run_search(cfg: SearchConfig, runner: Runner = call) -> list[str]:
    """Run every point of the plan that is not done, skipping those another invocation holds;
    re-render the report after each. Returns the keys of points with greedy mismatches."""
    from lab.studies.recipes_report import render

    split = split_data(cfg)
    if split["val_rows"] < 40:
        print(f"note: a held-out set of {split['val_rows']} conversations (aim: >= 40)")
    update_json(cfg.results_file, lambda d: d.__setitem__("meta", merged_meta(cfg, split, d)))
    flagged, ran = [], []

    def counted(cmd: list[str], env: dict, log: Path) -> None:
        ran.append(cmd)
        runner(cmd, env, log)

    for point in plan(cfg):
        before = len(ran)
        with locked(cfg.out / "points" / f"{point.key}.lock", wait=False) as mine:
            if not mine:
                print(f"{point.key}: another invocation holds it; next point", flush=True)
                continue
            out = run_point(cfg, point, split, counted)
        record(cfg.results_file, point.key, out)
        bad = {t: out[f"mismatches_{t}"] for t in TREES if out.get(f"mismatches_{t}")}
        if bad:
            flagged.append(point.key)
            print(f"!!! GREEDY MISMATCH in {point.key}: {bad} requests differ from plain "
                  f"greedy decoding: see {out['eval_dir']}/report.md", file=sys.stderr)  # fmt: skip
        keys = ("steps", "cpu_min", "val_top1", "val_chain_tau_est", "tau_chain3", "tau_dynamic")
        brief = {k: out.get(k) for k in keys}
        print(json.dumps({point.key: brief}), flush=True)
        if len(ran) > before:  # the report follows a long search point by point
            render(load_json(cfg.results_file), cfg.docs)
    render(load_json(cfg.results_file), cfg.docs)
    return flagged
