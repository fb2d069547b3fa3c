"""The package layout is a contract: data -> heads -> train -> eval, never backwards.

Inside eval/ the three jobs have a direction of their own: eval.engine (decoding) is the base and
imports no other part of eval; eval.bench (the benchmark) and eval.publish (export, proof, upload)
each build on the engine and never on each other, so either can change without the other.
On top of that: no import cycle between the project's modules, no code file over 500 lines, and
no script over 80 (scripts/*.py parse arguments and call a module that holds the logic).

The lab (lab/: measurement campaigns, analyses, the report generators) sits outside the product:
pyproject does not install it, and nothing of the product (the four packages, conf/ and the
entry points train.py and evaluate.py) imports it, so what `pip install .` ships never needs it.
"""

from __future__ import annotations

import ast
import re
from fnmatch import fnmatchcase
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("data", "heads", "train", "eval")
LAB = "lab"
# the product's modules outside its packages: the root entry points
ENTRY_POINTS = ("train.py", "evaluate.py")
# package -> packages it must never import
FORBIDDEN = {
    "data": {"heads", "train", "eval"},
    "heads": {"train", "eval"},
    "train": {"eval"},
}
# eval sub-package -> the eval modules it must never import (prefixes)
EVAL_FORBIDDEN = {
    "eval.engine": ("eval.",),  # the base: nothing of eval but itself (checked below)
    "eval.bench": ("eval.publish",),
    "eval.publish": ("eval.bench",),
    # eval.cli sits on top and may use both; the lab's studies sit outside eval (see LAB)
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
        for package in (*PACKAGES, LAB)
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
    assert wrong_way({"eval.bench.b": {"eval.engine.t", "eval.publish.p"}}) == [
        "eval.bench.b imports ['eval.publish.p']"
    ]
    assert wrong_way({"eval.cli.c": {"eval.bench.b", "eval.publish.p"}}) == []
    assert wrong_way({"lab.s": {"eval.bench.b", "train.loop", "data.x"}}) == []
    assert wrong_way({"heads.h": {"train.loop", "data.x"}}) == ["heads.h imports ['train.loop']"]
    graph = import_graph()
    assert "eval.engine.kv_cache" in graph["eval.engine.generator"]
    assert "lab.studies.store" in graph["lab.studies.recipes"]  # the lab's cycles count too
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


# ---- the lab stays outside the product ------------------------------------------------------

# a Hydra config building a lab object would make the installed package need the lab
_LAB_TARGET = re.compile(rf"_target_:\s*['\"]?{LAB}\.")


def imported_names(source: str) -> set[str]:
    """Every absolute module name the code imports: import statements anywhere in the file, and
    importlib.import_module / __import__ of a constant string."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
    return names


def lab_imports(root: Path) -> list[str]:
    """'<file> imports [...]' for each product file under `root` that reaches into the lab: a
    module of the four packages or a root entry point importing it, or a config whose
    `_target_` is a lab object."""
    bad = []
    code = [p for package in PACKAGES for p in sorted((root / package).rglob("*.py"))]
    for path in [*code, *(root / name for name in ENTRY_POINTS)]:
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        hits = sorted(n for n in imported_names(path.read_text()) if _inside(n, LAB))
        if hits:
            bad.append(f"{path.relative_to(root)} imports {hits}")
    for path in sorted((root / "conf").rglob("*.yaml")):
        if _LAB_TARGET.search(path.read_text()):
            bad.append(f"{path.relative_to(root)} builds a lab object (_target_: {LAB}.*)")
    return bad


def test_the_product_never_imports_the_lab():
    bad = lab_imports(ROOT)
    assert not bad, (
        "the installed product reaches into lab/, which pip install leaves out; move what it "
        "needs into the package where its concept lives:\n" + "\n".join(bad)
    )


def test_the_lab_scan_sees_every_way_in(tmp_path):
    """Top-level, function-level, `from` and importlib imports of the lab are found, in a
    package and in an entry point; a name that only starts with the same letters is not."""
    (tmp_path / "eval" / "bench").mkdir(parents=True)
    (tmp_path / "data").mkdir()
    (tmp_path / "conf" / "bench").mkdir(parents=True)
    (tmp_path / "eval" / "bench" / "a.py").write_text("import lab.studies.store\nimport labels\n")
    (tmp_path / "eval" / "bench" / "b.py").write_text("def f():\n    from lab import x\n")
    (tmp_path / "data" / "c.py").write_text("import importlib\nimportlib.import_module('lab.y')\n")
    (tmp_path / "train.py").write_text("from lab.analysis.target_quality import score\n")
    (tmp_path / "evaluate.py").write_text("from eval.bench import a\n")
    (tmp_path / "conf" / "bench" / "x.yaml").write_text("_target_: lab.studies.recipes.Search\n")
    assert lab_imports(tmp_path) == [
        "data/c.py imports ['lab.y']",
        "eval/bench/a.py imports ['lab.studies.store']",
        "eval/bench/b.py imports ['lab']",
        "train.py imports ['lab.analysis.target_quality']",
        "conf/bench/x.yaml builds a lab object (_target_: lab.*)",
    ]


def test_pip_install_leaves_the_lab_out():
    """pyproject's package discovery (setuptools matches each dotted package name against the
    include and exclude patterns) finds the product's packages and none of the lab's."""
    from setuptools.config.pyprojecttoml import read_configuration  # Python 3.10 has no tomllib

    tool = read_configuration(ROOT / "pyproject.toml", expand=False)["tool"]["setuptools"]
    find = tool["packages"]["find"]

    def shipped(package: str) -> bool:
        def matches(patterns):
            return any(fnmatchcase(package, p) for p in patterns)

        return matches(find.get("include", ["*"])) and not matches(find.get("exclude", []))

    lab_packages = [_module_name(p) for p in sorted((ROOT / LAB).rglob("__init__.py"))]
    assert {"lab", "lab.studies", "lab.analysis"} <= set(lab_packages)
    assert all(shipped(p) for p in ("train", "heads.interop", "eval.bench", "conf"))
    assert not [p for p in lab_packages if shipped(p)], "pyproject's packages.find ships the lab"
    data = [key for key in tool.get("package-data", {}) if _inside(key, LAB)]
    assert not data, f"pyproject's package-data ships lab files: {data}"
