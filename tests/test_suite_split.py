"""The unit suite (`pytest -m "not integration"`) stays a few minutes of tiny models: a test that
needs what only the set-up builds (llama.cpp, vLLM's tool environment), converts a target to
OpenVINO, or starts a command line or launcher in another process carries the integration mark.

Read from the source: each test's own code, the module's helpers and fixtures it reaches
(by call, by parameter, or by name in a string, as request.getfixturevalue takes them).
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# a command line or launcher run in a subprocess: seconds of imports at least, often minutes
COMMANDS = ("train.py", "evaluate.py", "self_distill.py", "accelerate.commands.launch")
SUBPROCESS = {"run", "Popen", "check_call", "check_output", "call"}
# a target converted to OpenVINO IR (the models of tests/test_openvino.py)
HEAVY_CALLS = {"openvino_target_dir"}


def _marked(node: ast.AST) -> bool:
    return "mark.integration" in ast.unparse(node)


def _strings(node: ast.AST) -> list[str]:
    return [
        n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]


def _engine_or_conversion(node: ast.AST) -> str | None:
    """What in this one function makes it integration: failing without an engine the set-up
    builds, or a heavy conversion; else None."""
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
        func = call.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        owner = getattr(func.value, "id", "") if isinstance(func, ast.Attribute) else ""
        says_set_up = any("scripts/setup_" in s for s in _strings(call))
        if owner == "pytest" and name == "fail" and says_set_up:
            return "needs an engine the set-up builds"
        if name in HEAVY_CALLS:
            return f"calls {name}"
    return None


def _starts_a_process(node: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and getattr(n.func.value, "id", "") == "subprocess"
        and n.func.attr in SUBPROCESS
        for n in ast.walk(node)
    )


def unmarked_heavy_tests(source: str, where: str = "test") -> list[str]:
    """'<where>::<test>: <why>' for each test function that, by itself or through the module's
    helpers and fixtures, needs an engine build, converts to OpenVINO or runs a command line in
    a subprocess, without the integration mark (on the test or the module)."""
    tree = ast.parse(source)
    if any(
        isinstance(n, ast.Assign)
        and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
        and _marked(n.value)
        for n in tree.body
    ):
        return []
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}

    def reached(node: ast.FunctionDef) -> set[str]:
        """The module's functions this one names: calls, parameters (fixtures), strings."""
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        names |= {a.arg for a in node.args.args} | set(_strings(node))
        return (names & functions.keys()) - {node.name}

    found = []
    for name, node in functions.items():
        marks = {ast.unparse(d) for d in node.decorator_list}  # a mark on some params is not one
        if not name.startswith("test_") or "pytest.mark.integration" in marks:
            continue
        closure, todo = [], [name]  # the test first, then what it reaches
        while todo:
            current = todo.pop(0)
            if current not in closure:
                closure.append(current)
                todo.extend(sorted(reached(functions[current])))
        why = None
        for current in closure:
            why = _engine_or_conversion(functions[current])
            if why:
                why += "" if current == name else f" (through {current})"
                break
        if why is None and any(_starts_a_process(functions[f]) for f in closure):
            strings = [s for f in closure for s in _strings(functions[f])]
            named = [c for c in COMMANDS if any(c in s for s in strings)]
            why = f"runs {named[0]} in a subprocess" if named else None
        if why:
            found.append(f"{where}::{name}: {why}")
    return found


def test_tests_that_need_engines_or_command_lines_are_marked_integration():
    found = []
    for path in sorted(TESTS.glob("test_*.py")):
        found += unmarked_heavy_tests(path.read_text(), f"tests/{path.name}")
    fix = "mark these @pytest.mark.integration (or their file: pytestmark):"
    assert not found, "\n".join([fix, *found])


def test_the_check_sees_what_it_guards():
    source = '''
import subprocess, sys
import pytest

def _need_server():
    if not llama_cpp.available():
        pytest.fail("llama.cpp is not built here: run bash scripts/setup_llama_cpp.sh")

@pytest.fixture(scope="module")
def setup():
    _need_server()

def cli(*args):
    return subprocess.run([sys.executable, "train.py", *args])

def test_cli_unmarked():
    cli("trainer.lr=-1")

@pytest.mark.integration
def test_cli_marked():
    cli("trainer.lr=-1")

def test_fixture_unmarked(setup):
    pass

@pytest.mark.parametrize("name", ["setup"])
def test_fixture_by_name(name, request):
    request.getfixturevalue(name)

def test_a_script_that_is_no_command_line():
    subprocess.run([sys.executable, "scripts/bench_report.py"])

def test_train_py_named_without_a_subprocess():
    """train.py is named here, and runs nowhere."""
    assert "train.py".endswith(".py")

def test_openvino(tmp_path):
    openvino_target_dir(None, tmp_path)
'''
    assert unmarked_heavy_tests(source) == [
        "test::test_cli_unmarked: runs train.py in a subprocess",
        "test::test_fixture_unmarked: needs an engine the set-up builds (through _need_server)",
        "test::test_fixture_by_name: needs an engine the set-up builds (through _need_server)",
        "test::test_openvino: calls openvino_target_dir",
    ]
    whole_file = "import pytest\npytestmark = pytest.mark.integration\n" + source
    assert unmarked_heavy_tests(whole_file) == []
