"""The suite reads nothing from beside the checkout: a pytest plugin that fails any test which does.

A bare `git clone` has nothing next to it, so a test that opens, lists or hands a subprocess a path
in the checkout's parent folder (a sibling folder of the checkout) passes only on machines that
happen to have that folder. An audit hook (PEP 578) sees every `open`, `os.listdir`, `os.scandir`
and `subprocess.Popen` of the test process; a test during which one named such a path fails,
naming the path, and a read at collection time ends the session the same way. The checkout is
pytest's root folder. Temporary folders, the interpreter's prefixes and the per-user caches stay
allowed where they lie inside that parent folder (a clone in a home folder); where the checkout
sits directly in the file system's root or in the temporary folder itself, a test's own files
cannot be told from a sibling's, and the session header says the guard stands down.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

_HOME = Path.home()
_WATCHED_EVENTS = frozenset({"open", "os.listdir", "os.scandir", "subprocess.Popen"})


def _allowed_folders() -> list[str]:
    folders = [
        tempfile.gettempdir(),
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        os.environ.get("TANDEM_CACHE", _HOME / ".cache"),
        _HOME / ".cache",
        _HOME / ".config",
        _HOME / ".local",
        _HOME / ".pyenv",
    ]
    return [os.path.realpath(folder) for folder in folders]


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


class ReadsBeside:
    """Which paths lie beside `checkout`: in its parent folder, outside the checkout and outside
    every allowed folder that lies in that parent (an allowed folder that holds the parent, as
    /tmp holds /tmp/ci/, allows nothing there)."""

    def __init__(self, checkout: Path) -> None:
        self.checkout = os.path.realpath(checkout)
        self.parent = os.path.dirname(self.checkout)
        allowed = _allowed_folders()
        self.exempt = [self.checkout] + [
            folder for folder in allowed if _under(folder, self.parent) and folder != self.parent
        ]
        self.stands_down_because = (
            "the checkout sits in the file system's root"
            if self.parent == os.path.dirname(self.parent)
            else f"the checkout sits directly in {self.parent}, a folder its tests write to"
            if self.parent in allowed
            else None
        )

    def __call__(self, path: str) -> bool:
        if self.stands_down_because is not None:
            return False
        resolved = os.path.realpath(path)
        if not _under(resolved, self.parent):
            return False
        return not any(_under(resolved, folder) for folder in self.exempt)


def _paths_of(event: str, args: tuple[object, ...]) -> Iterator[str]:
    if event == "subprocess.Popen":
        executable, argv = args[0], args[1]
        candidates: Iterable[object] = [
            executable,
            *(argv if isinstance(argv, list | tuple) else [argv]),
        ]
        for candidate in candidates:
            text = os.fsdecode(candidate) if isinstance(candidate, str | bytes) else ""
            # A flag's value (`--model=PATH`) names a path as much as a bare argument does.
            for part in text.split("="):
                if part.startswith((os.sep, ".")):
                    yield part
        return
    target = args[0] if args else None
    if isinstance(target, str | bytes | os.PathLike):
        yield os.fsdecode(target)


class RepositoryReads:
    """Records the paths beside the checkout that the test process touched."""

    def __init__(self) -> None:
        self.beside: ReadsBeside | None = None
        self.touched: list[str] = []
        sys.addaudithook(self._audit)

    def _audit(self, event: str, args: tuple[object, ...]) -> None:
        beside = self.beside
        if beside is None or event not in _WATCHED_EVENTS:
            return
        for path in _paths_of(event, args):
            if beside(path):
                self.touched.append(f"{event} {path}")

    def take(self) -> list[str]:
        touched, self.touched = self.touched, []
        return touched


_reads = RepositoryReads()


def pytest_configure(config: pytest.Config) -> None:
    _reads.beside = ReadsBeside(config.rootpath)


def pytest_report_header(config: pytest.Config) -> str:
    beside = _reads.beside
    assert beside is not None
    if beside.stands_down_because is not None:
        return f"reads beside the checkout: not guarded ({beside.stands_down_because})"
    return f"reads beside the checkout: guarded (anything in {beside.parent} but {beside.checkout})"


def pytest_collection_finish(session: pytest.Session) -> None:
    if touched := _reads.take():
        raise pytest.UsageError(f"collecting the tests read outside the repository: {touched}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    _reads.take()
    yield
    if touched := _reads.take():
        pytest.fail(f"{item.nodeid} read outside the repository: {touched}")
