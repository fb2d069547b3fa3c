"""The results table: the README's block and docs/results.md, written from the committed reports.

Numbers come only from what the benchmark harness wrote: a report's `summary.json` (or, for a
report committed without it, the "Overall" table of its `report.md`, which the harness renders
from the same numbers). What a summary does not record sits in a small sidecar, `source.json`,
in the report's folder: the recipe that trained each head, the date, the machine and the command.

    {"runs": [{"numbers": "summary.json", "date": "2026-12-01", "machine": "2 CPU cores",
               "command": "python evaluate.py ...",
               "rows": {"head": {"recipe": "eagle3_llama_long", "readme": true}}}]}

Every drafting method of a summary needs an entry in `rows` (baselines, which draft nothing, are
left out); an entry may override any derived cell (`method`, `tree`, `target`, `benchmark`).
`"readme": true` makes a row its recipe's line in the README (lab/readme_table.py).
`render(root)` returns the files as they should be; `check` and `write` compare or replace them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from data.errors import DraftsmithError
from data.paths import atomic_write
from eval.engine.method_names import split_name
from lab.readme_table import END, START, readme_block, recipe_budgets

RESULTS_MD = Path("docs/results.md")
SIDECAR = "source.json"
MT_BENCH_CATEGORIES = tuple(
    "writing roleplay reasoning math coding extraction stem humanities".split()
)
BASELINE_NAMES = {
    "plain": "plain",
    "hf_generate": "HF generate",
    "llama_cpp_plain": "llama.cpp plain",
    "openvino_plain": "OpenVINO plain",
    "vllm_plain": "vLLM plain",
}
OVERRIDES = ("method", "tree", "target", "benchmark")
ENGINE_NAMES = {"llama_cpp": "llama.cpp", "openvino": "OpenVINO", "vllm": "vLLM"}


@dataclass(frozen=True)
class Row:
    """One drafting method of one benchmark run, as the tables show it."""

    run: str  # "R3": the run's id in docs/results.md, where its command is listed
    recipe: str
    method: str
    benchmark: str
    new_tokens: int | None
    tree: str
    tau: float
    tokens_per_s: float | None
    speedup: str
    speedup_vs_fastest: str  # the README's: against the engine's fastest plain decoding
    changed: str
    target: str
    machine: str
    date: str
    report: str  # relative to docs/
    readme: bool
    lead: bool = False  # the README's first row (source.json "lead": true)


@dataclass(frozen=True)
class Run:
    """One numbers file and what its sidecar says about it."""

    run_id: str
    numbers: str  # relative to docs/
    report: str  # relative to docs/
    date: str
    machine: str
    command: str


# ---- reading ---------------------------------------------------------------------------------


def _cell(text: str) -> float | int | None:
    text = text.strip()
    if text in ("-", ""):
        return None
    return int(text) if text.isdigit() else float(text)


def summary_from_report_md(path: Path) -> dict:
    """The parts of a summary the tables need, read back from a harness `report.md`."""
    lines = path.read_text().splitlines()
    meta: dict = {"bench": {}}
    head = re.match(r"# Benchmark: (\S+) on (.+)", lines[0]) if lines else None
    if head is None:
        raise DraftsmithError(f"{path}: not a benchmark report (no '# Benchmark:' title).")
    meta["bench"]["name"], meta["target"] = head.groups()
    for line in lines:
        if m := re.match(r"- max_new_tokens: (\d+)", line):
            meta["bench"]["max_new_tokens"] = int(m.group(1))
        elif m := re.match(r"- (\w+): (\S+)$", line):
            value = m.group(2)
            meta[m.group(1)] = int(value) if value.isdigit() else value
    start = lines.index("## Overall") + 2 if "## Overall" in lines else None
    if start is None:
        raise DraftsmithError(f"{path}: no '## Overall' table to read the numbers from.")
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    methods = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))
        greedy, near = re.match(r"(\d+) \((\d+)\)", cells["greedy mismatches (near ties)"]).groups()
        overall = {
            "requests": _cell(cells["requests"]),
            "tau": _cell(cells["tau"]),
            "tokens_per_s": _cell(cells["tokens/s"]),
            "speedup_vs_plain": _cell(cells["speedup vs plain"]),
            "speedup_vs_hf_generate": _cell(cells["speedup vs HF generate"]),
            "greedy_mismatches": int(greedy),
            "near_tie_mismatches": int(near),
        }
        depth = meta.get("tree_depth", 0) if cells["method"] == "head" else 0
        methods[cells["method"]] = {"overall": overall, "max_draft_depth": depth}
    return {"meta": meta, "methods": methods}


def _load_numbers(path: Path) -> dict:
    if not path.is_file():
        raise DraftsmithError(f"{path}: named by a {SIDECAR} but missing; fix its 'numbers'.")
    return summary_from_report_md(path) if path.suffix == ".md" else json.loads(path.read_text())


# ---- cells -----------------------------------------------------------------------------------


def _benchmark(meta: dict, entry: dict) -> str:
    bench, requests = meta.get("bench", {}), entry["overall"]["requests"]
    name = bench.get("name")
    if name == "mt_bench":
        return f"MT-bench, {requests} turns"
    if name == "spec_bench" and entry.get("categories"):
        turns = sum(entry["categories"].get(c, {}).get("requests", 0) for c in MT_BENCH_CATEGORIES)
        return f"Spec-Bench, {requests} requests ({turns} MT-bench turns)"
    return f"{name}, {requests} requests"


def _tree(meta: dict, key: str, entry: dict) -> str:
    key = split_name(key)[0]
    if key.startswith("llama_cpp_"):
        cpp = meta.get("llama_cpp", {})
        if key == "llama_cpp_ngram":
            return f"n-gram, up to {cpp.get('ngram_n_max')}"
        return f"chain of {cpp.get('draft_n_max')}"
    spec = meta.get("heads", {}).get(key) or (meta if key == "head" else None)
    if spec is None:
        return f"up to {entry.get('max_draft_depth')} tokens"
    tree, nodes, depth = spec.get("tree"), spec.get("tree_nodes"), spec.get("tree_depth")
    if nodes and depth and nodes == depth + 1:
        return f"chain of {depth}"
    if tree == "dynamic":
        return f"dynamic, {nodes} nodes"
    if isinstance(tree, str) and re.fullmatch(r"tree\d+", tree):
        return tree
    return f"{nodes} nodes, depth {depth}"


def _method(meta: dict, key: str) -> str:
    key = split_name(key)[0]  # llama_cpp_draft@q4_0: one target type of several in the run
    spec = meta.get("heads", {}).get(key)
    if spec is not None:
        return spec["method"]
    if key == "head":
        return meta.get("head_method", "head")
    if key == "llama_cpp_draft":
        return f"{meta.get('head_method', 'draft')} in llama.cpp"
    if key == "openvino_draft":
        return f"{meta.get('head_method', 'draft')} in OpenVINO GenAI"
    return {"hf_prompt_lookup": "prompt lookup (HF)", "llama_cpp_ngram": "n-gram (llama.cpp)"}.get(
        key, key
    )


def _target(meta: dict, key: str) -> str | None:
    if key.startswith("llama_cpp_"):
        settings, label = meta.get("llama_cpp", {}), split_name(key)[1]
        gguf_type = (settings.get("resolved_types") or {}).get(label)
        if gguf_type:
            return f"{gguf_type.upper()} GGUF"
        gguf = settings.get("target_gguf", "")
        gguf = gguf.get(label, "") if isinstance(gguf, dict) else gguf
        m = re.search(r"[.-](q\d+_\w+|bf16|f16|f32)\.gguf$", gguf, re.IGNORECASE)
        return f"{m.group(1).upper()} GGUF" if m else None
    if key.startswith("openvino_"):
        weights = split_name(key)[1] or meta.get("openvino", {}).get("weights")
        return f"{str(weights).upper()} IR" if weights else "OpenVINO IR"
    dtype = (meta.get("vllm") or {}).get("dtype") if key.startswith("vllm_") else None
    dtype = dtype or meta.get("target_dtype")
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)


def _fastest(meta: dict, key: str) -> dict | None:
    """The fastest plain method of `key`'s engine in its run (older summaries: llama.cpp's)."""
    engine = next((e for e in ENGINE_NAMES if key.startswith(f"{e}_")), "llama_cpp")
    found = (meta.get("fastest_plain_by_engine") or {}).get(engine)
    return found or (meta.get("fastest_plain") if engine == "llama_cpp" else None)


def _speedup(meta: dict, key: str, entry: dict) -> str:
    """Against the method's own baseline; an engine method (llama.cpp, OpenVINO) of a run with
    several target types also against the fastest plain type of its engine in that run, when
    that is another one."""
    overall, base = entry["overall"], entry.get("baseline") or "plain"
    if overall.get("speedup_vs_plain") is not None:
        name = BASELINE_NAMES.get(split_name(base)[0], base)
        text = f"{overall['speedup_vs_plain']:.2f}x vs {name}"
        fastest, vs_fastest = _fastest(meta, key), overall.get("speedup_vs_fastest_plain")
        if fastest and vs_fastest is not None and fastest["method"] != base:
            kind = (fastest.get("type") or split_name(fastest["method"])[1]).upper()
            text += f"; {vs_fastest:.2f}x vs fastest plain ({kind})"
        return text
    if overall.get("speedup_vs_hf_generate") is not None:
        return f"{overall['speedup_vs_hf_generate']:.2f}x vs HF generate"
    return "no baseline in this run"


def _speedup_vs_fastest(meta: dict, key: str, entry: dict) -> str:
    """Against the fastest plain decoding of the method's engine in its run; where the run
    measured no other plain decoding of that engine (the HF harness runs one), against its own
    baseline, saying so."""
    overall, base = entry["overall"], entry.get("baseline") or "plain"
    fastest, engine = _fastest(meta, key), ENGINE_NAMES.get(split_name(key)[0].rsplit("_", 1)[0])
    if engine and fastest and overall.get("speedup_vs_fastest_plain") is not None:
        kind = (fastest.get("type") or split_name(fastest["method"])[1]).upper()
        return f"{overall['speedup_vs_fastest_plain']:.2f}x vs fastest {engine} plain ({kind})"
    if overall.get("speedup_vs_plain") is None:
        return "no baseline in this run"
    name = BASELINE_NAMES.get(split_name(base)[0], base)
    return f"{overall['speedup_vs_plain']:.2f}x vs {name} (no faster plain of this engine measured)"


def _changed(key: str, overall: dict) -> str:
    """Outputs that differ from the method's own engine's greedy decoding: for an engine method
    (llama.cpp, OpenVINO) its engine's plain output, whose kernels differ from HF's."""
    n = overall["requests"]
    if key.startswith(("llama_cpp_", "openvino_")):
        return f"{overall.get('baseline_mismatches', 0)}/{n}"
    near = overall.get("near_tie_mismatches", 0)
    text = f"{overall['greedy_mismatches']}/{n}"
    return f"{text} ({near} near ties)" if near else text


# ---- rows ------------------------------------------------------------------------------------


def _rows_of_run(run: Run, summary: dict, specs: dict, where: Path) -> list[Row]:
    meta, rows = summary["meta"], []
    for key, entry in summary["methods"].items():
        if entry.get("max_draft_depth", 0) == 0 and split_name(key)[0] in BASELINE_NAMES:
            continue
        spec = specs.get(key)
        if spec is None:
            raise DraftsmithError(
                f"{where}: method '{key}' of {run.numbers} has no entry in 'rows'; add one "
                "(its recipe, and whether the README shows it)."
            )
        cells = {
            "method": _method(meta, key),
            "tree": _tree(meta, key, entry),
            "target": _target(meta, key),
            "benchmark": _benchmark(meta, entry),
        }
        cells.update({k: spec[k] for k in OVERRIDES if k in spec})
        if cells["target"] is None:
            raise DraftsmithError(
                f"{where}: {run.numbers} records no target dtype for '{key}'; "
                "add \"target\" to its entry in 'rows'."
            )
        threads = meta.get("threads")
        machine = f"{run.machine}, {threads} thread{'s' if threads != 1 else ''}"
        rows.append(
            Row(
                run=run.run_id,
                recipe=spec.get("recipe", "-"),
                new_tokens=meta.get("bench", {}).get("max_new_tokens"),
                tau=entry["overall"]["tau"],
                tokens_per_s=entry["overall"].get("tokens_per_s"),
                speedup=_speedup(meta, key, entry),
                speedup_vs_fastest=_speedup_vs_fastest(meta, key, entry),
                changed=_changed(key, entry["overall"]),
                machine=machine,
                date=run.date,
                report=run.report,
                readme=bool(spec.get("readme", False)),
                lead=bool(spec.get("lead", False)),
                **cells,
            )
        )
    return rows


def _sidecar_runs(docs: Path) -> list[tuple[Path, dict]]:
    """(sidecar, run spec) for every run of every `docs/**/source.json`, newest first."""
    found = []
    for sidecar in sorted(docs.rglob(SIDECAR)):
        try:
            specs = json.loads(sidecar.read_text())["runs"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise DraftsmithError(
                f'{sidecar}: not a {{"runs": [...]}} JSON object ({err}).'
            ) from None
        for spec in specs:
            missing = [k for k in ("numbers", "date", "machine", "command") if k not in spec]
            if missing:
                raise DraftsmithError(f"{sidecar}: a run lacks {missing}; add them.")
            found.append((sidecar, spec))
    found.sort(key=lambda s: (s[0].parent / s[1]["numbers"]).as_posix())
    found.sort(key=lambda s: s[1]["date"], reverse=True)  # stable: equal dates keep path order
    return found


def load(root: Path) -> tuple[list[Run], list[Row]]:
    """Every run named by a `docs/**/source.json` (newest first) and its rows."""
    docs = root / "docs"
    runs, rows = [], []
    for sidecar, spec in _sidecar_runs(docs):
        numbers = sidecar.parent / spec["numbers"]
        report = numbers if numbers.suffix == ".md" else numbers.parent / "report.md"
        if numbers.suffix != ".md" and (numbers.name != "summary.json" or not report.is_file()):
            report = numbers
        run = Run(
            run_id=f"R{len(runs) + 1}",
            numbers=numbers.relative_to(docs).as_posix(),
            report=report.relative_to(docs).as_posix(),
            date=spec["date"],
            machine=spec["machine"],
            command=spec["command"],
        )
        runs.append(run)
        rows += _rows_of_run(run, _load_numbers(numbers), spec.get("rows", {}), sidecar)
    return runs, rows


# ---- rendering -------------------------------------------------------------------------------

RESULTS_COLUMNS = (
    "run|recipe|method|benchmark|new tokens|tree|tau|tokens/s|speedup|changed outputs"
    "|target|machine|date|report"
).split("|")
DEFINITIONS = (
    "tau is the mean number of tokens a target verify step emits (bonus token included); speedup "
    "is tokens/s against the named baseline in the same run; changed outputs counts answers that "
    "differ from the engine's own greedy decoding (HF harness: HF `generate` in the target's "
    "dtype, near ties are top-2 gaps within one rounding step; llama.cpp: its plain decoding)."
)


def _cells(row: Row, columns: list[str], link_prefix: str) -> list[str]:
    name = row.report.rsplit("/", 1)[0] if row.report.endswith("/report.md") else row.report
    values = {
        "run": row.run,
        "recipe": row.recipe,
        "method": row.method,
        "benchmark": row.benchmark,
        "new tokens": str(row.new_tokens),
        "tree": row.tree,
        "tau": f"{row.tau:.2f}",
        "speedup": row.speedup,
        "tokens/s": "-" if row.tokens_per_s is None else f"{row.tokens_per_s:.1f}",
        "changed outputs": row.changed,
        "target": row.target,
        "machine": row.machine,
        "date": row.date,
        "report": f"[{name}]({link_prefix}{row.report})",
    }
    return [values[c] for c in columns]


def _table(rows: list[Row], columns: list[str], link_prefix: str) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(_cells(r, columns, link_prefix)) + " |" for r in rows]


def results_md(runs: list[Run], rows: list[Row]) -> str:
    """docs/results.md: every drafting method of every committed report, and how each was made."""
    lines = [
        "# Results",
        "",
        "Every drafting method of every committed benchmark report, newest first. Written by",
        "`python scripts/results_table.py --write` from each report's `summary.json` and the",
        "`source.json` beside it (recipe, date, machine, command); do not edit by hand.",
        "",
        DEFINITIONS,
        "",
        *_table(rows, RESULTS_COLUMNS, ""),
        "",
        "## How each run was made",
    ]
    for run in runs:
        lines += [
            "",
            f"**{run.run_id}** ({run.date}, {run.machine}): [{run.numbers}]({run.numbers})",
        ]
        lines += ["", "```bash", run.command, "```"]
    return "\n".join(lines) + "\n"


def splice(text: str, block: str, where: str = "README.md") -> str:
    """`text` with the part between the markers (markers included) replaced by `block`."""
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise DraftsmithError(
            f"{where}: needs one '{START}' line and one '{END}' line after it; add them where "
            "the results table goes."
        )
    head, rest = text.split(START)
    return head + block + rest.split(END, 1)[1]


def render(root: Path) -> dict[Path, str]:
    """README.md and docs/results.md as the committed reports say they should read."""
    runs, rows = load(root)
    readme = root / "README.md"
    return {
        readme: splice(readme.read_text(), readme_block(rows, recipe_budgets(root))),
        root / RESULTS_MD: results_md(runs, rows),
    }


def stale(root: Path) -> list[Path]:
    """The files whose text differs from what `render` would write."""
    return [p for p, t in render(root).items() if not p.is_file() or p.read_text() != t]


def check(root: Path) -> str | None:
    """None when README.md and docs/results.md agree with the reports, else a one-line message."""
    out = stale(root)
    if not out:
        return None
    names = ", ".join(p.relative_to(root).as_posix() for p in out)
    return (
        f"{names}: out of date with the committed reports; run "
        "`python scripts/results_table.py --write`."
    )


def write(root: Path) -> list[Path]:
    """Rewrite the files that changed; both are rendered before either is replaced."""
    files = render(root)
    changed = [p for p, t in files.items() if not p.is_file() or p.read_text() != t]
    for path in changed:
        atomic_write(path, lambda tmp, text=files[path]: Path(tmp).write_text(text))
    return changed
