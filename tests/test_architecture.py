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
