"""The package layout is a contract: data -> heads -> train -> eval, never backwards."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# package -> packages it must never import
FORBIDDEN = {
    "data": {"heads", "train", "eval"},
    "heads": {"train", "eval"},
    "train": {"eval"},
}
PACKAGES = ("data", "heads", "train", "eval")
MAX_LINES = 500  # per code file outside tests/ (aim for ~400)
# path -> why it may stay longer than MAX_LINES (empty: none may)
LONG_FILES: dict[str, str] = {}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_packages_import_only_earlier_steps():
    bad = []
    for package, forbidden in FORBIDDEN.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            hits = _imports(path) & forbidden
            if hits:
                bad.append(f"{path.relative_to(ROOT)} imports {sorted(hits)}")
    assert not bad, "layering violated:\n" + "\n".join(bad)


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


def _module_names(root: Path, packages) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `packages` under `root` (a package is
    named by its __init__.py)."""
    names = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports anywhere in its file (function-level imports too).
    `from pkg import x` is an import of the module pkg.x when there is one, else of pkg (x is
    then a name defined in pkg); a name not among `modules` counts as its nearest enclosing
    project module, and importing a submodule does not count as importing its parents."""
    wanted = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            wanted |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package this file belongs to
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            for alias in node.names:
                wanted.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    found = set()
    for target in wanted:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def import_cycles(root: Path, packages=PACKAGES) -> list[list[str]]:
    """Every set of modules that import each other in a circle (strongly connected components
    of the import graph with more than one module), each sorted."""
    modules = _module_names(root, packages)
    graph = {name: _imported_modules(name, path, modules) for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def test_no_import_cycles():
    cycles = import_cycles(ROOT)
    assert not cycles, (
        "modules that import each other in a circle (move what they share into a module of "
        "its own):\n" + "\n".join(" <-> ".join(c) for c in cycles)
    )


def test_the_cycle_check_sees_function_level_and_package_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import A\n")
    (pkg / "a.py").write_text("import pkg.sub.b\nA = 1\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from pkg.a import A  # late, still a circle\n")
    (pkg / "c.py").write_text("from pkg import sub\nfrom . import a\n")  # one way only
    assert import_cycles(tmp_path, ("pkg",)) == [["pkg.a", "pkg.sub.b"]]
    (pkg / "sub" / "b.py").write_text("from pkg import A\n")  # a name of pkg/__init__.py
    assert import_cycles(tmp_path, ("pkg",)) == [["pkg", "pkg.a", "pkg.sub.b"]]
    (pkg / "sub" / "b.py").write_text("X = 1\n")
    assert import_cycles(tmp_path, ("pkg",)) == []


def _code_files(root: Path) -> list[Path]:
    """Every .py file of the project outside tests/ (and outside hidden or output folders)."""
    skip = {"tests", "outputs", "site-packages", "build", "dist"}
    return [
        path
        for path in sorted(root.rglob("*.py"))
        if not any(part in skip or part.startswith(".") for part in path.relative_to(root).parts)
    ]


def test_no_code_file_is_longer_than_the_cap():
    files = _code_files(ROOT)
    assert any(p.name == "loop.py" for p in files) and len(files) > 50  # the walk found them
    long = {
        str(path.relative_to(ROOT)): n
        for path in files
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    unexplained = {path: n for path, n in long.items() if path not in LONG_FILES}
    assert not unexplained, (
        f"code files over {MAX_LINES} lines (split them by concept, or give a reason in "
        f"LONG_FILES): {unexplained}"
    )
    stale = sorted(set(LONG_FILES) - set(long))
    assert not stale, f"LONG_FILES lists files that are no longer long: {stale}"
