"""The package layout never shadows the standard library's `operator` module."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(60)
def test_stdlib_operator_is_not_shadowed_from_repo_root() -> None:
    code = "import operator, tandem.operator; print(operator.__file__); print(tandem.operator.__file__)"
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    stdlib_file, package_file = result.stdout.split()
    assert Path(stdlib_file).resolve().parent == Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert Path(package_file).resolve() == (ROOT / "operator" / "__init__.py").resolve()


@pytest.mark.timeout(60)
def test_stdlib_operator_functions_work_beside_the_package() -> None:
    code = "import tandem.operator, operator; assert operator.itemgetter(1)([0, 7]) == 7"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
