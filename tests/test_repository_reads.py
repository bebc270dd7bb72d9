"""The suite's guard against reading beside the checkout, and a scan of the sources for such paths."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from repository_reads import ReadsBeside

REPOSITORY = Path(__file__).resolve().parents[1]
TESTS = REPOSITORY / "tests"


def layout(tmp_path: Path) -> tuple[Path, Path]:
    """A checkout and a sibling folder beside it, as a clone with shared data next to it."""
    checkout, sibling = tmp_path / "checkout", tmp_path / "shared"
    (checkout / "tests").mkdir(parents=True)
    sibling.mkdir()
    (sibling / "tokenizer.json").write_text("{}")
    return checkout, sibling


def test_a_sibling_of_the_checkout_is_beside_it_and_the_checkout_is_not(tmp_path: Path) -> None:
    checkout, sibling = layout(tmp_path)
    beside = ReadsBeside(checkout)
    assert beside.stands_down_because is None
    assert beside(str(sibling / "tokenizer.json"))
    assert beside(str(tmp_path / "checkout-other" / "x"))
    assert not beside(str(checkout / "tests" / "x"))
    assert not beside(sys.prefix)
    assert not beside(str(REPOSITORY))


def test_the_guard_stands_down_where_it_cannot_tell_a_test_file_from_a_sibling() -> None:
    assert ReadsBeside(Path("/main")).stands_down_because is not None
    assert ReadsBeside(Path(tempfile.gettempdir()) / "main").stands_down_because is not None


@pytest.mark.timeout(120)
def test_a_test_that_reads_beside_the_checkout_fails_naming_the_path(tmp_path: Path) -> None:
    """pytest, run in a throwaway checkout with this plugin, reports a test that opens, lists or
    hands a subprocess a sibling path as failed."""
    checkout, sibling = layout(tmp_path)
    (checkout / "pytest.ini").write_text("[pytest]\n")
    (checkout / "conftest.py").write_text('pytest_plugins = ["repository_reads"]\n')
    (checkout / "tests" / "test_reads.py").write_text(
        textwrap.dedent(
            f"""
            import os, subprocess, sys

            def test_open():
                open({str(sibling / "tokenizer.json")!r}).close()

            def test_listdir():
                os.listdir({str(sibling)!r})

            def test_subprocess():
                subprocess.run([sys.executable, "-c", "pass", "--model={sibling}"], check=True)

            def test_inside():
                open({str(checkout / "pytest.ini")!r}).close()
            """
        )
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "tests"],
        cwd=checkout,
        env={**os.environ, "PYTHONPATH": str(TESTS)},
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert "3 failed, 1 passed" in result.stdout, result.stdout + result.stderr
    assert result.stdout.count("read outside the repository") >= 3
    assert str(sibling) in result.stdout


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
