"""The architecture contracts (pyproject.toml, `lint-imports`) hold, and each catches the import circles embed_lib
once had: a contract that a deliberately added upward import does not break would protect nothing."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root))  # the copy's packages, not the installed ones
    return subprocess.run([str(LINT), "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("arch")
    for pkg in ("embed_lib", "sweeps", "serving", "benchmarks"):
        shutil.copytree(REPO / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root)
    return root


def test_the_contracts_hold_on_this_tree(tree):
    out = _lint(tree)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "7 kept, 0 broken" in out.stdout


@pytest.mark.parametrize("module, upward, contract", [
    # the tensors reached the report through the retrieval check (study_data -> retrieval -> study)
    ("training/tensors.py", "from embed_lib.report.study import run_study", "embed_lib in layers by concern"),
    # the encoder and its ONNX backend imported each other
    ("encoding/onnx_backend.py", "from embed_lib.encoding.encoders import FrozenEncoder", "embed_lib.encoding"),
    # the teacher's recipe and stage reached back to the module that configured them
    ("teacher/recipe.py", "from embed_lib.teacher.scores import teacher_scores", "embed_lib.teacher"),
    ("data/tasks.py", "import sweeps.report", "embed_lib never imports sweeps"),
])
def test_an_upward_import_breaks_a_contract_and_names_the_chain(tree, module, upward, contract):
    path = tree / "embed_lib" / module
    original = path.read_text()
    try:
        path.write_text(original + f"\n{upward}  # deliberately against the architecture\n")
        out = _lint(tree)
    finally:
        path.write_text(original)
    assert out.returncode != 0
    broken = out.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken and "embed_lib." + module[:-3].replace("/", ".") in broken, out.stdout[-3000:]


def _project_modules() -> list[Path]:
    """Every Python file of the project outside tests/ (tracked, or new and not ignored)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.split()
    return [REPO / f for f in out if not f.startswith("tests/") and (REPO / f).is_file()]


def test_no_module_over_300_lines_and_no_function_over_60_outside_tests():
    import ast

    modules = _project_modules()
    assert len(modules) > 50  # the listing found the project
    long_modules = {m.relative_to(REPO).as_posix(): n for m in modules if (n := len(m.read_text().splitlines())) > 300}
    assert not long_modules, long_modules
    long_functions = []
    for m in modules:
        for node in ast.walk(ast.parse(m.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long_functions.append(f"{m.relative_to(REPO)}:{node.lineno} {node.name}")
    assert not long_functions, long_functions


def test_every_benchmark_script_parses_its_arguments():
    """`python benchmarks/X.py --help` prints its usage: a script without a parser ran the benchmark instead
    (`chaos.py --help` started a Ray cluster and a Serve application; `gpu_check.py --help` wrote its results)."""
    missing = []
    for path in sorted((REPO / "benchmarks").glob("*.py")):
        text = path.read_text()
        guard = re.search(r'^if __name__ == "__main__"(.*):', text, re.M)
        if guard and not guard.group(1) and "parse_args(" not in text:  # a guard with a condition: an internal entry
            missing.append(path.name)
    assert not missing, f"benchmarks without an argument parser (so no --help): {missing}"
