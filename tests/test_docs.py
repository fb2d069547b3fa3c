"""The front door stays true: the README's results table is what the committed reports say, every
relative link in README.md and docs/ resolves, and the README stays a short read."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path
from urllib.parse import unquote

import pytest

from data.errors import DraftsmithError
from eval.bench import report
from lab import readme_table, results_table

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250
SPEED_BF16 = Path("docs/reports/2026-12-01-speed-bf16")  # a committed report with a summary.json


def _copy_checkout(tmp_path: Path) -> Path:
    """README.md, docs/ and the recipes in a scratch folder, so a test can change them."""
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copytree(ROOT / "conf" / "experiment", tmp_path / "conf" / "experiment")
    return tmp_path


def _script():
    spec = importlib.util.spec_from_file_location(
        "results_table_script", ROOT / "scripts" / "results_table.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the results table ----------------------------------------------------------------------


def _a_readme_row(root: Path) -> tuple[Path, str]:
    """(summary.json, method key) of a row the README shows, whichever rows it shows today."""
    for sidecar, run in results_table._sidecar_runs(root / "docs"):
        numbers = sidecar.parent / run["numbers"]
        if numbers.name != "summary.json":
            continue
        for key, spec in run.get("rows", {}).items():
            if spec.get("readme"):
                return numbers, key
    raise AssertionError("no report row is marked for the README")


def test_readme_table_and_results_md_match_the_reports():
    assert results_table.check(ROOT) is None


def test_check_fails_after_a_deliberate_change(tmp_path):
    root = _copy_checkout(tmp_path)
    assert results_table.check(root) is None
    # a README row's number moves in its report: the README no longer agrees
    summary, key = _a_readme_row(root)
    data = json.loads(summary.read_text())
    data["methods"][key]["overall"]["tau"] = 2.5
    summary.write_text(json.dumps(data))
    message = results_table.check(root)
    assert message is not None and "README.md" in message and "\n" not in message
    assert "| 2.50 on " in results_table.render(root)[root / "README.md"]
    # writing brings both files back in line, and the new number is in them
    assert set(results_table.write(root)) == {root / "README.md", root / "docs" / "results.md"}
    assert results_table.check(root) is None
    assert "| 2.50 on " in (root / "README.md").read_text()


def test_a_hand_edit_of_the_readme_table_is_caught(tmp_path):
    root = _copy_checkout(tmp_path)
    readme = root / "README.md"
    block = readme.read_text().split(results_table.START)[1].split(results_table.END)[0]
    row = next(line for line in block.splitlines() if line.startswith("| `eagle3_llama_long`"))
    # change the row's tau cell, whatever today's value is
    cells = row.split("|")
    i = next(i for i, c in enumerate(cells) if re.match(r" \d+\.\d\d on ", c))
    cells[i] = re.sub(r"\d+\.\d\d", "9.99", cells[i], count=1)
    readme.write_text(readme.read_text().replace(row, "|".join(cells)))
    assert "README.md" in results_table.check(root)


def _readme_block() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return text.split(results_table.START)[1].split(results_table.END)[0].strip().splitlines()


def test_readme_shows_one_row_per_recipe_and_which_to_use():
    block = _readme_block()
    table = [line for line in block if line.startswith("|")]
    header, rows = table[0], table[2:]
    assert header == "| " + " | ".join(readme_table.COLUMNS) + " |"
    assert 0 < len(rows) <= readme_table.README_MAX_ROWS
    names = [re.match(r"\| `(\w+)`", row).group(1) for row in rows]
    assert len(set(names)) == len(names)
    assert all((ROOT / "conf" / "experiment" / f"{name}.yaml").is_file() for name in names)
    taus = [float(re.search(r"\| (\d+\.\d\d) on ", row).group(1)) for row in rows]
    leads = [r for r in results_table.load(ROOT)[1] if r.readme and r.lead]
    assert len(leads) <= 1
    rest = taus[len(leads) :]  # the lead row first, the others by tau
    assert rest == sorted(rest, reverse=True)
    if leads:
        assert names[0] == readme_table.recipe_name(leads[0])
    which = next(line for line in block if line.startswith("**Which recipe:**"))
    best = names[taus.index(max(taus))]
    assert which.startswith(f"**Which recipe:** `{best}` for the best tau")
    assert "stop 4" not in "\n".join(block)  # rows say what ran, not which session ran it


def test_two_readme_rows_of_one_recipe_are_a_clear_error(tmp_path):
    root = _copy_checkout(tmp_path)
    sidecar, index, key = next(
        (path, i, k)
        for path in sorted((root / "docs").rglob(results_table.SIDECAR))
        for i, run in enumerate(json.loads(path.read_text())["runs"])
        for k, spec in run.get("rows", {}).items()
        if spec.get("readme") and len(run["rows"]) > 1
    )
    data = json.loads(sidecar.read_text())
    rows = data["runs"][index]["rows"]
    other = next(k for k in rows if k != key)
    rows[other] = {**rows[key], "readme": True}  # the same recipe, shown twice
    sidecar.write_text(json.dumps(data))
    with pytest.raises(DraftsmithError, match="one per recipe .* marked twice"):
        results_table.render(root)


def test_the_lead_row_comes_first_and_only_one_may_lead(tmp_path):
    root = _copy_checkout(tmp_path)
    marked = [
        (path, i, k, spec["recipe"])
        for path in sorted((root / "docs").rglob(results_table.SIDECAR))
        for i, run in enumerate(json.loads(path.read_text())["runs"])
        for k, spec in run.get("rows", {}).items()
        if spec.get("readme")
    ]
    assert len(marked) >= 2

    def lead(path, index, key, value=True):
        data = json.loads(path.read_text())
        data["runs"][index]["rows"][key]["lead"] = value
        path.write_text(json.dumps(data))

    for m in marked:  # start from no lead
        lead(*m[:3], value=False)

    before = results_table.render(root)[root / "README.md"]
    top = next(line for line in before.splitlines() if line.startswith("| `"))
    names = {m[3]: re.match(r"`(\w+)`", m[3]).group(1) for m in marked}
    path, index, key, recipe = next(m for m in marked if not top.startswith(f"| `{names[m[3]]}`"))
    lead(path, index, key)
    block = results_table.render(root)[root / "README.md"]
    first = next(line for line in block.splitlines() if line.startswith("| `"))
    assert first.startswith(f"| `{names[recipe]}`")
    lead(*next(m[:3] for m in marked if m[:3] != (path, index, key)))
    with pytest.raises(DraftsmithError, match='mark one row "lead"'):
        results_table.render(root)


def test_script_check_exits_1_with_one_line(tmp_path, capsys):
    root = _copy_checkout(tmp_path)
    script = _script()
    assert script.main(["--check", "--root", str(root)]) == 0
    (root / "docs" / "results.md").write_text("stale\n")
    capsys.readouterr()
    assert script.main(["--check", "--root", str(root)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "docs/results.md" in err and "--write" in err
    assert script.main(["--write", "--root", str(root)]) == 0
    assert script.main(["--check", "--root", str(root)]) == 0


def test_every_committed_summary_is_named_by_a_sidecar():
    named = {
        (sidecar.parent / run["numbers"]).resolve()
        for sidecar in (ROOT / "docs").rglob(results_table.SIDECAR)
        for run in json.loads(sidecar.read_text())["runs"]
    }
    summaries = {  # benchmark summaries (evaluate.py's, with per-method results)
        p.resolve()
        for p in (ROOT / "docs").rglob("summary*.json")
        if "methods" in json.loads(p.read_text())
    }
    assert summaries - named == set(), "add these reports to a source.json beside them"


def test_a_drafting_method_without_a_row_entry_is_a_clear_error(tmp_path):
    root = _copy_checkout(tmp_path)
    sidecar = root / SPEED_BF16 / "source.json"
    data = json.loads(sidecar.read_text())
    del data["runs"][0]["rows"]["d24"]
    sidecar.write_text(json.dumps(data))
    with pytest.raises(DraftsmithError, match="method 'd24' .* has no entry in 'rows'"):
        results_table.load(root)


def test_missing_markers_are_a_clear_error():
    with pytest.raises(DraftsmithError, match="results:start"):
        results_table.splice("# no table here\n", "block")


def test_report_md_reads_back_what_the_harness_wrote(tmp_path):
    """The fallback for a report committed without its summary.json: parse the harness's own
    report.md and get the summary's numbers (to its two decimals)."""
    summary = json.loads((ROOT / SPEED_BF16 / "summary.json").read_text())
    path = tmp_path / "report.md"
    path.write_text(report.render_markdown(summary, []))
    parsed = results_table.summary_from_report_md(path)
    assert parsed["meta"]["bench"] == {"name": "mt_bench", "max_new_tokens": 64}
    assert parsed["meta"]["threads"] == 1 and parsed["meta"]["tree"] == "tree16"
    for name, entry in summary["methods"].items():
        got, want = parsed["methods"][name]["overall"], entry["overall"]
        assert got["tau"] == pytest.approx(want["tau"], abs=0.005)
        assert got["requests"] == want["requests"]
        assert got["greedy_mismatches"] == want["greedy_mismatches"]
        assert got["near_tie_mismatches"] == want["near_tie_mismatches"]


def test_rows_say_where_they_come_from():
    runs, rows = results_table.load(ROOT)
    assert rows and any(r.readme for r in rows)
    ids = {run.run_id for run in runs}
    for row in rows:
        assert row.run in ids and re.fullmatch(r"\d{4}-\d\d-\d\d", row.date)
        assert (ROOT / "docs" / row.report).is_file()
        assert re.fullmatch(
            r"\d+\.\d\dx vs [^;]+(; \d+\.\d\dx vs fastest plain \(\w+\))?"
            r"|no baseline in this run",
            row.speedup,
        )


def _typed_run(docs: Path) -> None:
    """A run with two llama.cpp target types (eval/bench/llama_cpp_targets.py's names)."""

    def method(tps, vs_plain, vs_fastest, baseline=None, depth=3):
        overall = {"tau": 1.5 if depth else 1.0, "requests": 8, "tokens_per_s": tps,
                   "speedup_vs_plain": vs_plain, "speedup_vs_fastest_plain": vs_fastest,
                   "baseline_mismatches": 0, "greedy_mismatches": 0}  # fmt: skip
        return {"overall": overall, "max_draft_depth": depth, "baseline": baseline}

    summary = {
        "meta": {"bench": {"name": "mt_bench", "max_new_tokens": 64}, "threads": 1,
                 "head_method": "eagle3",
                 "llama_cpp": {"draft_n_max": 3, "resolved_types": {"q4_0": "q4_0", "auto": "q4_1"},
                               "target_gguf": {"q4_0": "/c/t-q4_0.gguf", "auto": "/c/t.gguf"}},
                 "fastest_plain": {"method": "llama_cpp_plain@q4_0", "type": "q4_0",
                                   "tokens_per_s": 60.0}},
        "methods": {
            "llama_cpp_plain@q4_0": method(60.0, None, 1.0, depth=0),
            "llama_cpp_plain@auto": method(40.0, None, 40 / 60, depth=0),
            "llama_cpp_draft@q4_0": method(30.0, 0.5, 0.5, "llama_cpp_plain@q4_0"),
            "llama_cpp_draft@auto": method(20.0, 0.5, 20 / 60, "llama_cpp_plain@auto"),
        },
    }  # fmt: skip
    (docs / "typed").mkdir(parents=True)
    (docs / "typed" / "summary.json").write_text(json.dumps(summary))
    rows = {k: {"recipe": "r"} for k in ("llama_cpp_draft@q4_0", "llama_cpp_draft@auto")}
    run = {"numbers": "summary.json", "date": "2026-12-02", "machine": "m", "command": "c",
           "rows": rows}  # fmt: skip
    (docs / "typed" / "source.json").write_text(json.dumps({"runs": [run]}))


def test_a_run_of_several_target_types_names_each_and_the_fastest_plain(tmp_path):
    _typed_run(tmp_path / "docs")
    _, rows = results_table.load(tmp_path)
    by_target = {row.target: row for row in rows}
    assert set(by_target) == {"Q4_0 GGUF", "Q4_1 GGUF"}  # the plain methods are baselines
    assert {row.method for row in rows} == {"eagle3 in llama.cpp"}
    assert {row.tree for row in rows} == {"chain of 3"}
    # the fastest plain type is its own baseline: no second number; another type names it
    assert by_target["Q4_0 GGUF"].speedup == "0.50x vs llama.cpp plain"
    assert (
        by_target["Q4_1 GGUF"].speedup == "0.50x vs llama.cpp plain; 0.33x vs fastest plain (Q4_0)"
    )


def test_engine_rows_count_changes_against_the_engines_own_plain_output():
    """An engine's draft is judged against the same engine's plain decoding (bf16 compute in
    OpenVINO changes answers against HF before any draft does); the harness's against HF."""
    overall = {"requests": 80, "baseline_mismatches": 34, "greedy_mismatches": 31}
    assert results_table._changed("openvino_draft", overall) == "34/80"
    assert results_table._changed("llama_cpp_draft@q4_0", overall) == "34/80"
    near = {**overall, "near_tie_mismatches": 3}
    assert results_table._changed("chain3", near) == "31/80 (3 near ties)"


# ---- links and length -----------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(\s*(?:<([^>]*)>|([^)\s]+))(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.MULTILINE)


def _relative_links(text: str) -> list[str]:
    """Link targets outside code: no scheme (http, mailto, ...), anchors stripped, none empty."""
    text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.MULTILINE | re.DOTALL)
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = [a or b for a, b in LINK.findall(text)] + REFERENCE.findall(text)
    out = []
    for target in targets:
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):
            continue
        path = unquote(target.split("#", 1)[0].split("?", 1)[0])
        if path:
            out.append(path)
    return out


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_link_finder_sees_links_and_skips_code_and_urls():
    text = (
        "See [a](docs/a.md#part), ![plot](p.png) and [b](<b c.md>).\n"
        "[web](https://example.com) [top](#top) `[x](in_code.md)`\n"
        "```\n[y](in_fence.md)\n```\n[ref]: docs/ref.md\n"
    )
    assert _relative_links(text) == ["docs/a.md", "p.png", "b c.md", "docs/ref.md"]


def test_every_relative_link_resolves():
    broken = [
        f"{md.relative_to(ROOT)} -> {target}"
        for md in _markdown_files()
        for target in _relative_links(md.read_text())
        if not (md.parent / target).exists()
    ]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_is_a_short_read():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


# ---- configs say what and why; the history is a report's ------------------------------------

EXPERIMENT_MAX_COMMENT_LINES = 12


def test_experiment_files_are_short_on_comments():
    """An experiment file says what it trains, its budget and its result in a few lines; what was
    tried before belongs to a dated report (inline comments on settings count too)."""
    long = {
        path.name: n
        for path in sorted((ROOT / "conf" / "experiment").glob("*.yaml"))
        if (n := sum("#" in line for line in path.read_text().splitlines()))
        > EXPERIMENT_MAX_COMMENT_LINES
    }
    assert not long, f"more than {EXPERIMENT_MAX_COMMENT_LINES} comment lines: {long}"


def test_docs_paths_named_in_configs_exist():
    missing = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted((ROOT / "conf").rglob("*.yaml"))
        for name in re.findall(r"\bdocs/[\w./-]*\w", path.read_text())
        if not (ROOT / name).exists()
    ]
    assert not missing, "configs name docs paths that do not exist:\n" + "\n".join(missing)


def test_docs_top_level_holds_guides_reference_results_reports():
    allowed = {"guides", "reports", "reference.md", "results.md", "CHANGELOG.md", "README.md"}
    assert {p.name for p in (ROOT / "docs").iterdir()} <= allowed
    dated = re.compile(r"\d{4}-\d\d-\d\d-[a-z0-9-]+")
    reports = [p for p in (ROOT / "docs" / "reports").iterdir() if p.is_dir()]
    assert reports and all(dated.fullmatch(p.name) for p in reports)
    index = (ROOT / "docs" / "reports" / "README.md").read_text()
    assert [p.name for p in reports if f"({p.name}/" not in index] == []
