"""The tree holds real folders only, and nothing in it shadows the standard library."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()


def test_tree_has_no_symbolic_links() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    links = [line.split("\t", 1)[1] for line in tracked if line.startswith("120000")]
    assert links == []


@pytest.mark.timeout(60)
def test_stdlib_operator_is_not_shadowed_from_repo_root() -> None:
    # -S skips site, so nothing is preloaded: the working directory is searched first.
    code = "import operator; print(operator.__file__)"
    result = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert Path(result.stdout.strip()).resolve().parent == STDLIB
