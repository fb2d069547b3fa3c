"""lab/studies/recipes.py: planning, budget -> steps, resume, merging, report, a real point."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest

from data.errors import ConfigError, DraftsmithError
from lab.studies import recipes
from lab.studies.recipes_report import BEGIN, END, render
from lab.studies.store import load_json, locked, update_json
from lab.studies.variants import parse_variants

REPO = Path(__file__).resolve().parents[1]


def _cfg(tmp_path: Path, variants="{baseline: [], muon: [trainer.optimizer=muon]}", **kw):
    data = tmp_path / "data.jsonl"
    if not data.exists():
        rows = [
            {
                "messages": [
                    {"role": "user", "content": f"q{i}"},
                    {"role": "assistant", "content": f"a{i}"},
                ]
            }
            for i in range(12)
        ]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kw = {
        "budgets": [15],
        "data": data,
        "out": tmp_path / "out",
        "docs": tmp_path / "docs" / "recipes",
        "val_rows": 4,
    } | kw
    return recipes.SearchConfig(variants=parse_variants(variants), **kw)


# ---- planning ---------------------------------------------------------------------------------


def test_plan_crosses_variants_budgets_and_seeds_with_stable_keys(tmp_path):
    spec = "{baseline: [], muon: {overrides: [trainer.optimizer=muon], seeds: [0, 1]}}"
    cfg = _cfg(tmp_path, spec, budgets=[45, 15], seeds=[0])
    keys = [p.key for p in recipes.plan(cfg)]
    # small budgets first; at a budget every variant's first seed before a second seed
    assert keys == [
        "baseline-15m-s0",
        "muon-15m-s0",
        "muon-15m-s1",
        "baseline-45m-s0",
        "muon-45m-s0",
        "muon-45m-s1",
    ]
    assert [p.key for p in recipes.plan(_cfg(tmp_path, spec, budgets=[15, 45]))] == keys
    variant = cfg.variants["muon"]
    assert variant.overrides == ("trainer.optimizer=muon",) and variant.seeds == (0, 1)
    assert variant.experiment == "eagle3_llama"
    # the digest follows what the variant trains, not its name
    other = parse_variants("{muon: [trainer.optimizer=muon, trainer.lr=1e-3]}")["muon"]
    assert other.digest != variant.digest
    assert parse_variants("{x: [trainer.optimizer=muon]}")["x"].digest == variant.digest


def test_a_changed_experiment_changes_the_digest_and_comments_do_not(tmp_path, monkeypatch):
    """A variant with the same overrides trains something else once its experiment's settings
    change (eagle3_llama's lr moved from 5e-4 to 1e-3): its old points must not be reused."""
    from lab.studies import variants as vmod

    monkeypatch.setattr(vmod, "EXPERIMENTS", tmp_path)
    exp = tmp_path / "mine.yaml"
    exp.write_text("# @package _global_\ntrainer:\n  lr: 5e-4\n")
    first = parse_variants("{b: [trainer.mixed_precision=no]}", experiment="mine")["b"].digest
    exp.write_text("# @package _global_\n# a new comment\ntrainer: {lr: 5e-4}\n")
    same = parse_variants("{b: [trainer.mixed_precision=no]}", experiment="mine")["b"].digest
    exp.write_text("# @package _global_\ntrainer:\n  lr: 1e-3\n")
    moved = parse_variants("{b: [trainer.mixed_precision=no]}", experiment="mine")["b"].digest
    assert first == same != moved
    assert vmod.experiment_settings("nowhere", tmp_path) == ""


def test_variants_from_a_file_with_a_base_and_common_overrides(tmp_path):
    spec = tmp_path / "v.json"
    spec.write_text(
        json.dumps(
            {
                "experiment": "eagle3_tiny",
                "overrides": ["trainer.lr=1e-3"],
                "variants": {"baseline": None, "noise": ["+head.noise=0.05"]},
            }
        )
    )
    got = parse_variants(spec)
    assert got["baseline"].overrides == ("trainer.lr=1e-3",)
    assert got["noise"].overrides == ("trainer.lr=1e-3", "+head.noise=0.05")
    assert {v.experiment for v in got.values()} == {"eagle3_tiny"}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("{a: [trainer.max_steps=5]}", "set by the search"),
        ("{a: [seed=3]}", "set by the search"),
        ("{a: [trainer.time_budget_min=20]}", "set by the search"),
        ("{a: [notanoverride]}", "not a Hydra override"),
        ("{'a b': []}", "use letters"),
        ("[1, 2]", "mapping of variant name"),
        ("missing.yaml", "no such file"),
    ],
)
def test_bad_variants_say_what_to_change(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_variants(spec)


def test_turns_must_fill_whole_mt_bench_rounds(tmp_path):
    with pytest.raises(ConfigError, match="multiple"):
        _cfg(tmp_path, turns=20)
    assert _cfg(tmp_path, turns=20, bench=("bench=jsonl",)).turns == 20  # a custom bench


def test_the_split_is_seeded_written_once_and_tied_to_its_data(tmp_path):
    cfg = _cfg(tmp_path)
    meta = recipes.split_data(cfg)
    val = (cfg.out / "val.jsonl").read_text().splitlines()
    train = (cfg.out / "train.jsonl").read_text().splitlines()
    assert (len(val), len(train), meta["train_rows"]) == (4, 8, 8)
    assert sorted(val + train) == sorted(cfg.data.read_text().splitlines())  # a partition
    assert val != cfg.data.read_text().splitlines()[:4]  # shuffled first
    assert recipes.split_data(cfg) == meta  # written once
    with pytest.raises(DraftsmithError, match="--val-rows 4"):
        recipes.split_data(_cfg(tmp_path, val_rows=5))
    cfg.data.write_text(cfg.data.read_text() + cfg.data.read_text().splitlines()[0] + "\n")
    with pytest.raises(DraftsmithError, match="not the file"):
        recipes.split_data(cfg)


# ---- a fake train.py / evaluate.py ------------------------------------------------------------


class FakeRuns:
    """Stands in for the subprocesses: train.py writes metrics.jsonl (CPU `rate` s/step after a
    `warmup` s first step) and a head; evaluate.py writes a summary."""

    def __init__(self, rate: float = 3.0, warmup: float = 20.0, mismatches: int = 0):
        self.calls: list[list[str]] = []
        self.rate, self.warmup, self.mismatches = rate, warmup, mismatches

    def __call__(self, cmd: list[str], env: dict, log: Path) -> None:
        self.calls.append(cmd)
        assert env["OMP_NUM_THREADS"] == "1"
        args = dict(a.split("=", 1) for a in cmd[2:])
        if cmd[1] == "train.py":
            run_dir, steps = Path(args["hydra.run.dir"]), int(args["trainer.max_steps"])
            every = int(args.get("trainer.log_every", 10))
            rows = [
                {
                    "step": s,
                    "train/cpu_min": (self.warmup + s * self.rate) / 60,
                    "train/step0/top1": 0.6,
                    "train/step1/top1": 0.5,
                }
                for s in range(every, steps + 1, every)
            ]
            rows.append(
                {
                    "step": steps,
                    "val/step0/top1": 0.4,
                    "val/step1/top1": 0.3,
                    "val/head0/top1": 0.4,
                    "val/loss": 2.0,
                }
            )
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            (run_dir / "head").mkdir()
        else:
            assert args["methods"] == "[]" and args["+heads.chain3"].endswith("tree: 3}")
            assert args["+heads.dynamic"].endswith("tree: dynamic}")
            out = Path(args["out_dir"])
            out.mkdir(parents=True, exist_ok=True)
            methods = {
                n: {
                    "overall": {
                        "tau": tau,
                        "greedy_mismatches": self.mismatches,
                        "near_tie_mismatches": 0,
                        "accept_rate_by_depth": [0.5],
                        "requests": 32,
                    }
                }
                for n, tau in (("chain3", 1.5), ("dynamic", 1.8))
            }
            (out / "summary.json").write_text(json.dumps({"methods": methods}))

    def scripts(self) -> list[str]:
        return [c[1] for c in self.calls]


# ---- budget -> steps ----------------------------------------------------------------------


def test_budget_becomes_steps_from_a_probe_then_from_finished_points(tmp_path):
    assert recipes.steps_for_budget(15, 3.0) == 300
    assert recipes.steps_for_budget(0.01, 3.0) == 1  # never zero steps
    rows = [{"step": s, "train/cpu_min": (20 + 3 * s) / 60} for s in (5, 10, 15, 20, 25, 30)]
    assert recipes.probe_rate(rows) == pytest.approx(3.0)  # the warm-up is left out
    assert recipes.probe_rate(rows[:1]) == pytest.approx((20 + 15) / 5)
    with pytest.raises(DraftsmithError):
        recipes.steps_for_budget(15, 0.0)

    cfg, runs = _cfg(tmp_path, budgets=[15, 45]), FakeRuns(rate=3.0, warmup=20.0)
    assert recipes.run_search(cfg, runs) == []
    # one probe per variant (30 steps, logged every 5), then the points
    probes = [c for c in runs.calls if "trainer.max_steps=30" in c]
    assert len(probes) == 2 and all("trainer.log_every=5" in c for c in probes)
    steps = load_json(cfg.out / "steps.json")
    assert steps["baseline-15m-t1"]["steps"] == 300
    assert steps["baseline-15m-t1"]["calibration"] == "probe (30 steps)"
    # 45 minutes: calibrated on the finished 15-minute point, whose average carries the warm-up
    rate = (20 + 300 * 3.0) / 300
    assert steps["baseline-45m-t1"]["cpu_s_per_step"] == pytest.approx(rate)
    assert steps["baseline-45m-t1"]["steps"] == round(45 * 60 / rate)
    assert steps["baseline-45m-t1"]["calibration"] == "point baseline-15m-s0 (300 steps)"
    point = load_json(cfg.results_file)["points"]["baseline-15m-s0"]
    assert point["cpu_min"] == pytest.approx((20 + 900) / 60) and point["trained_steps"] == 300
    assert point["val_top1"] == [0.4, 0.3] and point["train_top1"] == [0.6, 0.5]
    assert point["depths"] == ["step0", "step1"]  # head0 repeats step0: not a depth
    assert point["commands"]["train"].startswith("OMP_NUM_THREADS=1 python train.py ")
    assert "trainer.max_steps=300" in point["commands"]["train"]


def test_a_given_rate_skips_the_probe_and_seeds_share_the_steps(tmp_path):
    spec = "{baseline: {overrides: [], seeds: [0, 1]}}"
    cfg, runs = _cfg(tmp_path, spec, cpu_s_per_step=2.0), FakeRuns()
    recipes.run_search(cfg, runs)
    assert runs.scripts() == ["train.py", "evaluate.py"] * 2
    trains = [c for c in runs.calls if c[1] == "train.py"]
    assert all("trainer.max_steps=450" in c for c in trains)
    # fixed steps: a recipe's wall-clock budget (eagle3_llama's 20 min) must not plan fewer
    assert all("trainer.time_budget_min=0" in c for c in trains)
    assert {c for c in trains[0] if c.startswith("seed=")} == {"seed=0"}
    assert {c for c in trains[1] if c.startswith("seed=")} == {"seed=1"}


def test_a_changed_variant_may_not_reuse_its_points(tmp_path):
    recipes.run_search(_cfg(tmp_path, "{baseline: []}", cpu_s_per_step=2.0), FakeRuns())
    changed = _cfg(tmp_path, "{baseline: [trainer.lr=1e-3]}", cpu_s_per_step=2.0)
    with pytest.raises(DraftsmithError, match="give the changed variant a new name"):
        recipes.run_search(changed, FakeRuns())
    # with its steps forgotten, the point's own record still refuses the old head
    (changed.out / "steps.json").unlink()
    with pytest.raises(DraftsmithError, match="started with other settings"):
        recipes.run_search(changed, FakeRuns())


# ---- resume -------------------------------------------------------------------------------


def test_points_resume_train_and_evaluation_apart(tmp_path):
    cfg = _cfg(tmp_path, cpu_s_per_step=2.0)
    runs = FakeRuns()
    recipes.run_search(cfg, runs)
    assert runs.scripts() == ["train.py", "evaluate.py"] * 2
    again = FakeRuns()
    recipes.run_search(cfg, again)
    assert again.calls == []  # heads and summaries exist: nothing reruns
    eval_dir = cfg.out / "points" / "muon-15m-s0" / f"eval-{cfg.bench_label}"
    (eval_dir / "summary.json").unlink()
    third = FakeRuns()
    recipes.run_search(cfg, third)
    assert third.scripts() == ["evaluate.py"]  # only the missing evaluation
    state = load_json(cfg.out / "points" / "muon-15m-s0.json")
    assert state["steps"] == 450 and state["eval_wall_s"] >= 0 and "train_wall_s" in state


def test_a_screening_round_trains_only_and_keeps_measured_tau(tmp_path):
    """turns=0: held-out metrics without decoding; a later screening of a measured point keeps
    its tau (results merge key by key)."""
    cfg = _cfg(tmp_path, "{baseline: []}", cpu_s_per_step=2.0)
    recipes.run_search(cfg, FakeRuns())
    measured = load_json(cfg.results_file)["points"]["baseline-15m-s0"]["tau_chain3"]
    bench_meta = load_json(cfg.results_file)["meta"]
    assert bench_meta["turns"] == cfg.turns > 0
    screen = _cfg(tmp_path, "{baseline: [], noise: [head.feature_noise=0.2]}", cpu_s_per_step=2.0,
                  turns=0)  # fmt: skip
    assert screen.screening and not cfg.screening
    runs = FakeRuns()
    recipes.run_search(screen, runs)
    assert runs.scripts() == ["train.py"]  # the new variant trains; nothing is decoded
    points = load_json(screen.results_file)["points"]
    assert points["baseline-15m-s0"]["tau_chain3"] == measured
    assert "tau_chain3" not in points["noise-15m-s0"] and points["noise-15m-s0"]["val_top1"]
    # the header still names the bench the measured tau came from, not the screening's turns=0
    assert load_json(screen.results_file)["meta"] == bench_meta
    with pytest.raises(ConfigError, match="0: held-out only"):
        _cfg(tmp_path, turns=-16)


def test_a_point_another_invocation_holds_is_skipped(tmp_path):
    cfg, runs = _cfg(tmp_path, cpu_s_per_step=2.0), FakeRuns()
    with locked(cfg.out / "points" / "baseline-15m-s0.lock"):
        # the lock is per open file: a second open in this process stands for another process
        recipes.run_search(cfg, runs)
    trained = [c for c in runs.calls if c[1] == "train.py"]
    assert len(trained) == 1 and any("muon-15m-s0" in a for a in trained[0])
    assert list(load_json(cfg.results_file)["points"]) == ["muon-15m-s0"]


def test_greedy_mismatches_are_flagged(tmp_path, capsys):
    cfg = _cfg(tmp_path, "{baseline: []}", cpu_s_per_step=2.0)
    assert recipes.run_search(cfg, FakeRuns(mismatches=2)) == ["baseline-15m-s0"]
    assert "!!! GREEDY MISMATCH in baseline-15m-s0" in capsys.readouterr().err
    assert "**GREEDY MISMATCHES**" in (tmp_path / "docs" / "recipes.md").read_text()


# ---- merging ------------------------------------------------------------------------------


def _record_many(path: str, worker: int) -> None:
    for i in range(15):
        recipes.record(Path(path), f"w{worker}-{i}", {"tau": float(i)})


@pytest.mark.integration
def test_results_merge_point_by_point_across_processes(tmp_path):
    path = tmp_path / "results.json"
    recipes.record(path, "a", {"tau_chain3": 1.5})
    recipes.record(path, "a", {"tau_dynamic": 1.7})  # a later evaluation keeps the earlier keys
    assert load_json(path)["points"]["a"] == {"tau_chain3": 1.5, "tau_dynamic": 1.7}
    # spawn, not fork: by now the test process holds torch's and OpenVINO's threads
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_record_many, args=(str(path), w)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    assert all(p.exitcode == 0 for p in procs)
    assert len(load_json(path)["points"]) == 1 + 4 * 15  # no write lost another's point
    update_json(path, lambda d: d.update(meta={"x": 1}))
    assert load_json(path)["meta"] == {"x": 1} and len(load_json(path)["points"]) == 61
    assert sorted(p.name for p in tmp_path.iterdir()) == [".results.json.lock", "results.json"]


# ---- the report ---------------------------------------------------------------------------


def _fake_point(variant, seed, budget, chain3, dynamic, cpu, mismatches=0):
    return {
        "variant": variant,
        "seed": seed,
        "budget_cpu_min": budget,
        "experiment": "eagle3_llama",
        "overrides": [] if variant == "baseline" else [f"+{variant}=true"],
        "steps": 300,
        "planned_cpu_s_per_step": 3.0,
        "calibration": "probe (30 steps)",
        "cpu_min": cpu,
        "train_wall_min": cpu * 1.2,
        "val_top1": [0.36, 0.29, 0.24],
        "train_top1": [0.45, 0.3],
        "tau_chain3": chain3,
        "tau_dynamic": dynamic,
        "mismatches_chain3": mismatches,
        "mismatches_dynamic": 0,
        "commands": {
            "train": f"python train.py {variant} {seed}",
            "evaluate": f"python evaluate.py {variant}",
        },
    }


def test_report_tables_noise_and_plot_from_a_results_file(tmp_path):
    points = {
        "baseline-15m-s0": _fake_point("baseline", 0, 15, 1.50, 1.80, 15.2),
        "baseline-15m-s1": _fake_point("baseline", 1, 15, 1.54, 1.78, 15.0),
        "muon-15m-s0": _fake_point("muon", 0, 15, 1.70, 1.79, 14.9),
        "muon-15m-s1": _fake_point("muon", 1, 15, 1.72, 1.83, 15.1),
        "baseline-45m-s0": _fake_point("baseline", 0, 45, 1.9, 2.2, 44.0),
        "muon-45m-s0": _fake_point("muon", 0, 45, 2.0, 2.3, 46.0, mismatches=1),
    }
    meta = {
        "data": "sd.jsonl",
        "sha1": "ab" * 20,
        "rows": 400,
        "val_rows": 44,
        "train_rows": 356,
        "split_seed": 0,
        "threads": 1,
        "bench": "mt_bench-32t-128n",
        "turns": 32,
        "max_new_tokens": 128,
        "baseline": "baseline",
    }
    docs = tmp_path / "docs" / "recipes"
    report = render({"meta": meta, "points": points}, docs)
    assert report == tmp_path / "docs" / "recipes.md"
    text = report.read_text()
    lines = text.splitlines()
    assert "MT-bench, 32 turns (2 questions per category, both turns), 128 new tokens" in text
    assert "### Budget: 15 training CPU-minutes" in text and "### Budget: 45 training" in text
    row = next(line for line in lines if line.startswith("| muon | 0 | 300 | 14.9 |"))
    assert "| 0.450 | 0.360 / 0.290 / 0.240 | 0.090 | - | 1.700 | 1.790 | 0 |" in row
    assert any(
        line.startswith("| muon | 0 | 300 | 46.0 |") and line.endswith("| **1** |")
        for line in lines
    )
    assert "**GREEDY MISMATCHES**" in text and "muon-45m-s0 (chain-3: 1)" in text
    # seeds: baseline 1.52 +- 0.02, muon 1.71 +- 0.01; the noise is the largest range (0.04)
    noise = next(line for line in lines if line.startswith("| muon | 0, 1 |"))
    assert "1.710 +- 0.010" in noise and "+0.190 (above noise)" in noise
    assert "+0.020 (within noise)" in noise  # dynamic: 1.81 against 1.79, noise 0.04
    assert "| baseline | 0, 1 | 1.520 +- 0.020 |" in text
    at45 = text.split("### Budget: 45")[1]
    assert "(noise unknown)" in at45 and "not measured yet: one seed each" in at45
    assert "| muon | eagle3_llama | `+muon=true` | 3.00 (probe (30 steps)) |" in text
    assert "python train.py muon 1" in text  # the command that makes each point
    assert "](recipes/tau_vs_cpu.png)" in text
    assert (docs / "tau_vs_cpu.png").stat().st_size > 10_000
    # hand-written notes outside the markers survive a re-render
    report.write_text(text.replace("What helped", "Muon helped. What helped"))
    points["muon-15m-s1"]["tau_chain3"] = 1.60
    text = render({"meta": meta, "points": points}, docs).read_text()
    assert "Muon helped." in text and text.count(BEGIN) == 1 and text.count(END) == 1
    assert "1.650 +- 0.050" in text


@pytest.mark.integration
def test_report_only_renders_without_points(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/recipe_search.py",
            "--report-only",
            "--docs",
            str(tmp_path / "recipes"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "No points measured yet." in (tmp_path / "recipes.md").read_text()
    proc = subprocess.run(
        [sys.executable, "scripts/recipe_search.py", "--budgets", "15"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "--variants and --budgets are required" in proc.stderr


# ---- one real point -----------------------------------------------------------------------


@pytest.mark.integration
def test_one_point_end_to_end_on_the_tiny_experiment(tmp_path):
    """eagle3_tiny for 3 steps, then one evaluate.py run of both trees on a 2-prompt bench."""
    rows = [
        json.loads(line)
        for line in (REPO / "data/corpora/oasst_en/conversations.jsonl").open().readlines()[:16]
    ]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bench = tmp_path / "bench.jsonl"
    bench.write_text(
        '{"turns": ["Say hello."], "category": "a"}\n'
        '{"turns": ["Name a colour."], "category": "b"}\n'
    )
    cfg = recipes.SearchConfig(
        variants=parse_variants("{baseline: []}", "eagle3_tiny"),
        budgets=[0.05],
        data=data,
        out=tmp_path / "out",
        docs=tmp_path / "docs" / "recipes",
        val_rows=4,
        cpu_s_per_step=1.0,
        max_new_tokens=8,
        bench=("bench=jsonl", f"bench.path={bench}", "bench.warmup=0"),
    )
    assert recipes.run_search(cfg) == []
    point = load_json(cfg.results_file)["points"]["baseline-0.05m-s0"]
    assert point["steps"] == 3 and point["trained_steps"] == 3 and point["cpu_min"] > 0
    assert len(point["val_top1"]) == 3 and point["depths"] == ["step0", "step1", "step2"]
    assert point["tau_chain3"] >= 1.0 and point["tau_dynamic"] >= 1.0
    assert point["mismatches_chain3"] == 0 and point["mismatches_dynamic"] == 0
    assert point["bench_requests"] == 2 and point["train_wall_min"] > 0
    assert (point["tree_depth_chain3"], point["tree_depth_dynamic"]) == (3, 6)
    assert point["train_process_cpu_min"] >= point["cpu_min"]
    assert (cfg.out / "points" / "baseline-0.05m-s0" / "head").is_dir()
    assert "| baseline | 0 | 3 |" in (tmp_path / "docs" / "recipes.md").read_text()


def test_screening_points_are_compared_by_their_estimate_across_seeds(tmp_path):
    """Screening rounds (--turns 0) measure no MT-bench tau: the seed table compares their
    held-out chain-3 estimates, with the noise taken from the seeds' own ranges."""
    est = {("baseline", 0): 1.247, ("baseline", 1): 1.235, ("lr", 0): 1.272, ("lr", 1): 1.276,
           ("vocab", 0): 1.244}  # fmt: skip
    points = {}
    for (variant, seed), value in est.items():
        p = _fake_point(variant, seed, 15, None, None, 10.0)
        p["val_chain_tau_est"] = value
        points[f"{variant}-15m-s{seed}"] = p
    meta = {"data": "sd.jsonl", "sha1": "ab" * 20, "rows": 360, "val_rows": 44,
            "train_rows": 316, "split_seed": 0, "threads": 1, "bench": "mt_bench-0t-128n",
            "turns": 0, "max_new_tokens": 128, "baseline": "baseline"}  # fmt: skip
    text = render({"meta": meta, "points": points}, tmp_path / "recipes").read_text()
    assert "estimate 0.012" in text  # the largest seed range: the baseline's
    lr = next(line for line in text.splitlines() if line.startswith("| lr | 0, 1 |"))
    assert "| 1.274 +- 0.002 |" in lr
    assert lr.endswith("| +0.033 (above noise) |")
    vocab = next(line for line in text.splitlines() if line.startswith("| vocab | 0 | - | - |"))
    assert vocab.endswith("| +0.003 (within noise) |")
