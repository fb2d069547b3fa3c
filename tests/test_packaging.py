"""`pip install .` gives a draftsmith that runs from any folder: the wheel carries every module of
the four packages, conf/ and the corpora the code reads, laid out as in the repository (so
data.paths resolves the same relative paths under site-packages), plus the two console scripts.

The wheel is built from a copy of the product files (what git tracks or would add), so a build
leaves nothing in the checkout. The whole file is an integration test (pip builds the wheel in a
subprocess); its longest part is the installed run: a bare venv whose only draftsmith is the
wheel (torch and the rest come from this environment through a .pth file) trains eagle3_tiny for
two steps and benchmarks the head, from a folder outside the repository.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("train", "heads", "data", "eval", "conf")
# a repo-relative data file named in a config or a module constant (with an optional :start:end)
DATA_FILE = re.compile(r"^((?:data|conf)/[\w./-]+\.(?:jsonl|json|txt|yaml|jinja))(?::\d+:\d+)?$")
SCRIPTS = {
    "draftsmith-train": "eval.cli.train:main",
    "draftsmith-evaluate": "eval.cli.evaluate:main",
}


def product_files() -> list[str]:
    """The files under the product folders that a fresh clone has (tracked, or new and not
    ignored), relative to the repository root."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout to list the product files")
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *PRODUCT],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return sorted({f for f in out.splitlines() if (REPO / f).is_file()})


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """draftsmith's wheel, built with this environment's setuptools from a copy of the sources."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    for name in [*product_files(), "pyproject.toml", "README.md"]:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, src / name)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*cmd, str(src), "-w", str(root / "dist")], check=True, timeout=120)
    (built,) = (root / "dist").glob("draftsmith-*.whl")
    return built


def _names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def _read(wheel: Path, suffix: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(suffix)]
        return z.read(name).decode()


def test_the_wheel_holds_every_module_config_and_data_file(wheel):
    names = _names(wheel)
    missing = [f for f in product_files() if f not in names]
    assert not missing, f"left out of the wheel: {missing}"
    assert {"eval/cli/train.py", "eval/engine/generator.py", "conf/config.yaml"} <= names
    assert {"conf/experiment/eagle3_tiny.yaml", "data/corpora/mt_bench/question.jsonl"} <= names
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == set(PRODUCT), tops  # no tests/, scripts/ or stray top-level modules
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


def _named_data_files() -> set[str]:
    """Repo-relative data files the configs and the modules' string constants name."""
    found = set()
    for name in product_files():
        text = (REPO / name).read_text(errors="replace")
        if name.endswith(".yaml"):
            words = re.findall(r"[\w./:-]+", text)
        elif name.endswith(".py"):
            words = [n.value for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Constant)]
        else:
            continue
        found |= {m.group(1) for w in words if isinstance(w, str) and (m := DATA_FILE.match(w))}
    return found


def test_every_data_file_the_code_names_ships(wheel):
    named = _named_data_files()
    assert "data/corpora/oasst_en/conversations.jsonl" in named  # the scan sees the configs
    assert "data/openings/tasks.txt" in named
    assert not sorted(named - _names(wheel))


def test_the_wheel_declares_the_console_scripts_and_an_spdx_license(wheel):
    entry_points = _read(wheel, ".dist-info/entry_points.txt")
    for script, target in SCRIPTS.items():
        assert f"{script} = {target}" in entry_points
    assert "License-Expression: Apache-2.0" in _read(wheel, ".dist-info/METADATA")


def _venv_with(wheel: Path, folder: Path) -> Path:
    """A venv with only the wheel installed; this environment's packages (torch, transformers,
    the embedded target) are on its path through a .pth line, which adds the folder without
    running that folder's own .pth files, so the editable checkout stays out of sight."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps"]
    subprocess.run([*pip, "--no-index", str(wheel)], check=True, timeout=120)
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    # written after the install, so pip never sees (or uninstalls) this environment's draftsmith
    (Path(purelib) / "_draftsmith_test_deps.pth").write_text(sysconfig.get_paths()["purelib"])
    return folder / "bin"


def test_the_installed_package_trains_and_evaluates_from_another_folder(wheel, tmp_path):
    bin_dir = _venv_with(wheel, tmp_path / "venv")
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="1")

    def run(*cmd: str) -> str:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    show = "import eval.cli.train as m, data.paths as p; print(m.__file__); print(p.CONF_DIR)"
    for where in run(str(bin_dir / "python"), "-c", show).split():
        assert Path(where).is_relative_to(tmp_path / "venv")  # the wheel, not the checkout
    run_dir = tmp_path / "run"
    run(
        str(bin_dir / "draftsmith-train"), "+experiment=eagle3_tiny", "trainer.max_steps=2",
        "trainer.eval_every=2", "trainer.save_every=2", "logger.mode=disabled",
        f"hydra.run.dir={run_dir}",
    )  # fmt: skip
    assert (run_dir / "head" / "config.json").is_file()
    # the experiment's corpus is read from the installed copy
    assert str(tmp_path / "venv") in (run_dir / "train.log").read_text()
    eval_dir = tmp_path / "eval"
    run(
        str(bin_dir / "draftsmith-evaluate"), "+experiment=eagle3_tiny",
        f"head_path={run_dir / 'head'}", "bench=mt_bench", "bench.limit=2", "bench.warmup=0",
        "bench.max_new_tokens=8", "tree=3", "threads=1", f"hydra.run.dir={eval_dir}",
    )  # fmt: skip
    summary = json.loads((eval_dir / "summary.json").read_text())
    assert summary["meta"]["num_requests"] == 4  # two MT-bench questions, two turns each
    assert summary["meta"]["tree_depth"] == 3 and summary["methods"]["head"]["overall"]["tau"] >= 1
    assert not list(cwd.iterdir())  # nothing written where the commands ran
