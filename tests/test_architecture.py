"""The package layout is a contract: data -> heads -> train -> eval, never backwards.

Inside eval/ the three jobs have a direction of their own: eval.engine (decoding) is the base and
imports no other part of eval; eval.bench (the benchmark) and eval.publish (export, proof, upload)
each build on the engine and never on each other, so either can change without the other.
On top of that: no import cycle between the project's modules, no code file over 500 lines, and
no script over 80 (scripts/*.py parse arguments and call a module that holds the logic).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("data", "heads", "train", "eval")
# package -> packages it must never import
FORBIDDEN = {
    "data": {"heads", "train", "eval"},
    "heads": {"train", "eval"},
    "train": {"eval"},
}
# eval sub-package -> the eval modules it must never import (prefixes)
EVAL_FORBIDDEN = {
    "eval.engine": ("eval.",),  # the base: nothing of eval but itself (checked below)
    "eval.bench": ("eval.publish", "eval.studies", "eval.analysis"),
    "eval.publish": ("eval.bench", "eval.studies", "eval.analysis"),
    # studies (recipe and scale searches) and analysis (acceptance-gap measurements) sit on top:
    # they may use the engine and the benchmark; nothing below imports them
}
MAX_LINES = 500
# path -> why it may be longer than MAX_LINES (empty: no file has a reason today)
LONG_FILES: dict[str, str] = {}
SKIP_DIRS = {"tests", "outputs", "node_modules", "site-packages"}
# a script is argument parsing and a call: its logic lives in an importable, tested module
MAX_SCRIPT_LINES = 80
# scripts/<name>.py -> why it may be longer than MAX_SCRIPT_LINES (empty: none has a reason)
LONG_SCRIPTS: dict[str, str] = {}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _project_modules() -> dict[str, Path]:
    return {
        _module_name(p): p
        for package in PACKAGES
        for p in sorted((ROOT / package).rglob("*.py"))
        if "__pycache__" not in p.parts
    }


def _imports(path: Path, module: str, modules) -> set[str]:
    """The project modules `path` imports, anywhere in the file (function-level and relative
    imports included). Each import names the deepest module it reaches: `from eval.engine import
    kv_cache` is an edge to eval.engine.kv_cache, `from eval.engine.tree import Draft` one to
    eval.engine.tree, `import a.b` one to a.b."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:
                    found.add(f"{source}.{alias.name}")
                elif source in modules:
                    found.add(source)
    return found - {module}


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (see _imports)."""
    modules = _project_modules()
    return {module: _imports(path, module, modules) for module, path in modules.items()}


def knots(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module: each module of a knot reaches
    every other one through imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(components)


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle (a -> b -> ... -> a) per knot."""
    return [_cycle_in(graph, knot) for knot in knots(graph)]


def _cycle_in(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, as a path back to it."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{component} is not strongly connected")


def _code_files() -> list[Path]:
    files = []
    for pattern in ("*.py", "*.sh"):
        for p in ROOT.rglob(pattern):
            rel = p.relative_to(ROOT).parts
            if SKIP_DIRS & set(rel) or any(part.startswith(".") for part in rel):
                continue
            files.append(p)
    return sorted(files)


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def wrong_way(graph: dict[str, set[str]]) -> list[str]:
    """Every import against the layering (FORBIDDEN) or against eval's direction."""
    bad = []
    for module, edges in sorted(graph.items()):
        forbidden = FORBIDDEN.get(module.split(".")[0], set())
        hits = {e for e in edges if e.split(".")[0] in forbidden}
        for package, banned in EVAL_FORBIDDEN.items():
            if _inside(module, package):
                hits |= {e for e in edges if e.startswith(banned) and not _inside(e, package)}
        if hits:
            bad.append(f"{module} imports {sorted(hits)}")
    return bad


def test_packages_and_eval_jobs_import_only_their_way():
    bad = wrong_way(import_graph())
    assert not bad, (
        "layering (data -> heads -> train -> eval; in eval: engine <- bench, engine <- publish) "
        "violated:\n" + "\n".join(bad)
    )


def test_no_import_cycles():
    graph = import_graph()
    report = []
    for knot, cycle in zip(knots(graph), find_cycles(graph)):
        report.append(" -> ".join(cycle))
        report += [f"    {v} imports {sorted(graph[v] & set(knot))}" for v in knot]
    assert not report, "import cycles (each with every import inside its knot):\n" + "\n".join(
        report
    )


def test_no_long_code_files():
    long = []
    for path in _code_files():
        rel = str(path.relative_to(ROOT))
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES and rel not in LONG_FILES:
            long.append(f"{rel}: {lines} lines")
    assert not long, (
        f"code files over {MAX_LINES} lines (split by concept, or give a reason in LONG_FILES):\n"
        + "\n".join(long)
    )
    stale = [p for p in LONG_FILES if not (ROOT / p).is_file()]
    assert not stale, f"LONG_FILES names files that are gone: {stale}"


def test_scripts_are_thin():
    long = []
    for path in sorted((ROOT / "scripts").glob("*.py")):
        rel = str(path.relative_to(ROOT))
        lines = len(path.read_text().splitlines())
        if lines > MAX_SCRIPT_LINES and rel not in LONG_SCRIPTS:
            long.append(f"{rel}: {lines} lines")
    assert not long, (
        f"scripts over {MAX_SCRIPT_LINES} lines (move the logic into the module where its "
        "concept lives, and test it there; or give a reason in LONG_SCRIPTS):\n" + "\n".join(long)
    )
    stale = [p for p in LONG_SCRIPTS if not (ROOT / p).is_file()]
    assert not stale, f"LONG_SCRIPTS names scripts that are gone: {stale}"


def test_the_checks_see_what_they_guard(tmp_path):
    """The graph follows relative and function-level imports and finds a cycle; the line
    count sees every package."""
    graph = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}}
    assert find_cycles(graph) == [["a.x", "a.y", "a.z", "a.x"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []
    package = tmp_path / "pkg" / "sub"
    package.mkdir(parents=True)
    mod = package / "m.py"
    mod.write_text(
        "from . import sibling\nfrom ..top import thing\ndef f():\n    import pkg.late\n"
    )
    known = {"pkg.sub", "pkg.sub.sibling", "pkg.top", "pkg.late", "pkg.sub.m"}
    assert _imports(mod, "pkg.sub.m", known) == {"pkg.sub.sibling", "pkg.top", "pkg.late"}
    assert wrong_way({"eval.engine.x": {"eval.engine.y", "eval.bench.z"}}) == [
        "eval.engine.x imports ['eval.bench.z']"
    ]
    assert wrong_way({"eval.publish.a": {"eval.bench", "eval.engine.t"}}) == [
        "eval.publish.a imports ['eval.bench']"
    ]
    assert wrong_way({"eval.bench.b": {"eval.engine.t", "eval.studies.s"}}) == [
        "eval.bench.b imports ['eval.studies.s']"
    ]
    assert wrong_way({"eval.studies.s": {"eval.bench.b", "eval.engine.t"}}) == []
    assert wrong_way({"heads.h": {"train.loop", "data.x"}}) == ["heads.h imports ['train.loop']"]
    graph = import_graph()
    assert "eval.engine.kv_cache" in graph["eval.engine.generator"]
    files = {str(p.relative_to(ROOT)) for p in _code_files()}
    assert {"heads/base.py", "scripts/gpu_check.py", "train.py"} <= files
    assert not any(f.startswith("tests/") for f in files)


def test_no_forked_modelling_files():
    forks = [
        str(p.relative_to(ROOT))
        for p in ROOT.rglob("modeling_*.py")
        if ".venv" not in p.parts and "site-packages" not in p.parts
    ]
    assert not forks, f"copied HF modelling files: {forks}"


def test_layout_from_product_card():
    for name in ("train", "heads", "data", "conf", "scripts", "tests", "eval"):
        assert (ROOT / name).is_dir(), name
    for name in ("pyproject.toml", "README.md", "train.py", "evaluate.py"):
        assert (ROOT / name).is_file(), name
    for name in ("engine", "bench", "publish"):
        assert (ROOT / "eval" / name / "__init__.py").is_file(), f"eval/{name}"
