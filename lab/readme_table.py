"""The README's results block: one row per recipe, the recipe to use above it and the recipes
without a benchmark report below it (lab/results_table.py builds the rows and splices
the block between the markers).

A README row is a row of the results table that its report's source.json marks `"readme": true`.
Its recipe cell names a conf/experiment/*.yaml first, in backticks; one row per recipe, at most
README_MAX_ROWS: the row marked `"lead": true` first (the measurement a newcomer should see:
the second target's, against the machine's fastest plain decoding), then the highest tau. Its
speedup is against the fastest plain decoding of its
engine in its run (the HF harness runs one plain decoding, and the cell says so).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Protocol

import yaml

from data.errors import DraftsmithError

START, END = "<!-- results:start -->", "<!-- results:end -->"
README_MAX_ROWS = 8
COLUMNS = ("what to run", "method (draft tree)", "tau (benchmark)", "speedup", "machine", "report")
SHORT_BUDGET_MIN = 20  # the budget of the recipe named "when you have 20 minutes"


class ReadmeRow(Protocol):
    """What the block reads of a results_table.Row."""

    recipe: str
    method: str
    benchmark: str
    tree: str
    tau: float
    speedup_vs_fastest: str
    machine: str
    report: str  # relative to docs/
    readme: bool
    lead: bool


def recipe_name(row: ReadmeRow) -> str | None:
    """The experiment a row's recipe cell names first (`eagle3_llama` ...), if any."""
    found = re.match(r"`(\w+)`", row.recipe)
    return found.group(1) if found else None


def recipe_budgets(root: Path) -> dict[str, float | None]:
    """{experiment: trainer.time_budget_min or None} of conf/experiment/*.yaml, smoke runs out."""
    out = {}
    for path in sorted((root / "conf" / "experiment").glob("*.yaml")):
        if not path.stem.endswith("_tiny"):
            trainer = (yaml.safe_load(path.read_text()) or {}).get("trainer") or {}
            out[path.stem] = trainer.get("time_budget_min") or None
    return out


def _minutes(budget: float) -> str:
    return f"{budget / 60:g} h" if budget >= 60 else f"{budget:g} min"


def _link(row: ReadmeRow) -> str:
    name = row.report.rsplit("/", 1)[0] if row.report.endswith("/report.md") else row.report
    return f"[{name.removeprefix('reports/')}](docs/{row.report})"


def readme_rows(rows: list[ReadmeRow], budgets: dict[str, float | None]) -> list[ReadmeRow]:
    """The rows marked `readme`, the lead first, then highest tau; one per recipe of
    conf/experiment."""
    shown = sorted((r for r in rows if r.readme), key=lambda r: (not r.lead, -r.tau))
    if sum(r.lead for r in shown) > 1:
        raise DraftsmithError('README rows: mark one row "lead": true, not several.')
    names = [recipe_name(r) for r in shown]
    not_recipes = [r.recipe for r, name in zip(shown, names) if name not in budgets]
    twice = sorted({name for name in names if names.count(name) > 1})
    if not_recipes or twice or len(shown) > README_MAX_ROWS:
        raise DraftsmithError(
            f"README rows: one per recipe of conf/experiment, at most {README_MAX_ROWS} "
            f"({len(shown)} marked; not a recipe: {not_recipes}; marked twice: {twice}); set "
            '"readme": false on the others in their source.json.'
        )
    return shown


def _which_recipe(shown: list[ReadmeRow], budgets: dict[str, float | None]) -> str:
    best = max(shown, key=lambda r: r.tau)
    budget = budgets[recipe_name(best)]
    text = f"**Which recipe:** `{recipe_name(best)}` for the best tau ({best.tau:.2f}"
    text += f", {_minutes(budget)})" if budget else ")"
    short = sorted(
        (r for r in shown if (budgets[recipe_name(r)] or 1e9) <= SHORT_BUDGET_MIN),
        key=lambda r: -r.tau,
    )
    if short and short[0] is not best:
        text += (
            f"; `{recipe_name(short[0])}` when you have {SHORT_BUDGET_MIN} minutes "
            f"({short[0].tau:.2f})"
        )
    return text + "."


def readme_block(rows: list[ReadmeRow], budgets: dict[str, float | None]) -> str:
    """The block between the README's markers, markers included."""
    shown = readme_rows(rows, budgets)
    lines = [
        START,
        "<!-- written by `python scripts/results_table.py --write` from docs/**/summary.json "
        "and source.json; edit those, not this table -->",
    ]
    if shown:
        lines += [_which_recipe(shown, budgets), ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in shown:
        budget = budgets[recipe_name(row)]
        run = f"`{recipe_name(row)}`" + (f" ({_minutes(budget)})" if budget else "")
        cells = [run, f"{row.method} ({row.tree})", f"{row.tau:.2f} on {row.benchmark}"]
        cells += [row.speedup_vs_fastest, row.machine, _link(row)]
        lines.append("| " + " | ".join(cells) + " |")
    measured = {recipe_name(r) for r in rows}
    unmeasured = [f"`{name}`" for name in budgets if name not in measured]
    if unmeasured:
        lines += ["", f"No benchmark report yet: {', '.join(unmeasured)}."]
    return "\n".join([*lines, END])
