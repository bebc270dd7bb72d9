"""The package layout never shadows the standard library's `operator` module.

`operator/` at the top of the tree has no `__init__.py`: `tandem.operator` is a namespace package
reached through the `tandem/operator` link, and a folder without `__init__.py` never wins over a
regular module of the same name, whatever the interpreter preloads and wherever it starts.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()


def run_python(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
    )
    return result.stdout


@pytest.mark.timeout(60)
def test_stdlib_operator_is_not_shadowed_from_repo_root() -> None:
    code = (
        "import operator, tandem.operator, tandem.operator.render;"
        "print(operator.__file__); print(tandem.operator.render.__file__)"
    )
    stdlib_file, render_file = run_python("-c", code).split()
    assert Path(stdlib_file).resolve().parent == STDLIB
    assert Path(render_file).resolve() == (ROOT / "operator" / "render.py").resolve()


@pytest.mark.timeout(60)
def test_stdlib_operator_wins_even_when_nothing_is_preloaded() -> None:
    # -S skips site, so no .pth file can have imported `operator` before the working directory
    # is searched: the top-level folder must still lose.
    code = "import sys; print('operator' in sys.modules); import operator; print(operator.__file__)"
    preloaded, stdlib_file = run_python("-S", "-c", code).split()
    assert preloaded == "False"
    assert Path(stdlib_file).resolve().parent == STDLIB


def test_top_level_operator_folder_is_not_a_regular_package() -> None:
    assert not (ROOT / "operator" / "__init__.py").exists()
    assert (ROOT / "tandem" / "operator").resolve() == (ROOT / "operator").resolve()


@pytest.mark.timeout(60)
def test_stdlib_operator_functions_work_beside_the_package() -> None:
    run_python("-c", "import tandem.operator, operator; assert operator.itemgetter(1)([0, 7]) == 7")
