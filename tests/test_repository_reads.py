"""The suite's guard against reading beside the checkout, and a scan of the sources for such paths."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from repository_reads import REPOSITORY, beside_the_checkout

SIBLING = REPOSITORY.parent / "shared" / "golden" / "model" / "tokenizer.json"


def test_paths_inside_the_checkout_and_in_temporary_folders_are_allowed(tmp_path: Path) -> None:
    assert not beside_the_checkout(str(REPOSITORY / "tests" / "fixtures"))
    assert not beside_the_checkout(str(tmp_path / "x"))
    assert not beside_the_checkout(sys.prefix)


def test_a_sibling_of_the_checkout_is_beside_it() -> None:
    assert beside_the_checkout(str(SIBLING))
    assert beside_the_checkout(str(REPOSITORY.parent / f"{REPOSITORY.name}-other" / "x"))


@pytest.mark.timeout(120)
def test_a_test_that_reads_beside_the_checkout_fails_naming_the_path(tmp_path: Path) -> None:
    """A throwaway test module under tests/ (removed afterwards) opens, lists and hands a
    subprocess a sibling path; pytest, run on it alone, reports each as a failure."""
    module = REPOSITORY / "tests" / f"test_reads_beside_{tmp_path.name}.py"
    module.write_text(
        textwrap.dedent(
            f"""
            import os, subprocess, sys

            def test_open():
                try:
                    open({str(SIBLING)!r}).close()
                except OSError:
                    pass

            def test_listdir():
                try:
                    os.listdir({str(SIBLING.parent)!r})
                except OSError:
                    pass

            def test_subprocess():
                subprocess.run([sys.executable, "-c", "pass", "--model={SIBLING.parent}"])

            def test_inside():
                open({str(REPOSITORY / "README.md")!r}).close()
            """
        )
    )
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", str(module)],
            cwd=REPOSITORY,
            capture_output=True,
            text=True,
            timeout=100,
        )
    finally:
        module.unlink()
    assert "3 failed, 1 passed" in result.stdout, result.stdout + result.stderr
    assert result.stdout.count("read outside the repository") >= 3
    assert str(SIBLING.parent) in result.stdout


# Spellings of "the folder beside the checkout" in code: its parent joined with a name, a
# relative climb out of it, or the shared folder of this machine by name.
_BESIDE_SPELLINGS = re.compile(
    r"ROOT\.parent\s*/|parents\[\d\]\s*/\s*\"shared|\.\./shared|/work/shared|TANDEM_GOLDEN"
)


def test_no_source_names_a_folder_beside_the_checkout() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "*.py", "*.sh", "*.yaml", "*.toml", "Makefile"],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    this_file = Path(__file__).resolve()
    hits = [
        f"{name}:{number}: {line.strip()}"
        for name in tracked
        if (REPOSITORY / name).resolve() != this_file and (REPOSITORY / name).is_file()
        for number, line in enumerate((REPOSITORY / name).read_text().splitlines(), 1)
        if _BESIDE_SPELLINGS.search(line)
    ]
    assert hits == []
