"""The suite reads nothing from beside the checkout: a pytest plugin that fails any test which does.

A bare `git clone` has nothing next to it, so a test that opens, lists or hands a subprocess a path
in the checkout's parent folder (a sibling folder beside it) passes only on machines that happen
to have that folder. An audit hook (PEP 578) sees every `open`, `os.listdir`, `os.scandir` and
`subprocess.Popen` of the test process; a test during which one named such a path fails, naming the
path, and a read at collection time ends the session the same way. Temporary folders, the
interpreter's own prefixes and the per-user caches stay allowed even when they sit beside the
checkout (a clone in /tmp, or in a home folder).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
_BESIDE = REPOSITORY.parent
_HOME = Path.home()
# A checkout at the top of the file system has everything beside it; nothing can be told apart.
_BESIDE_ROOT_FOLDER = str(_BESIDE) == _BESIDE.anchor
_ALLOWED = tuple(
    os.path.realpath(path)
    for path in (
        REPOSITORY,
        tempfile.gettempdir(),
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        os.environ.get("TANDEM_CACHE", _HOME / ".cache"),
        _HOME / ".config",
        _HOME / ".local",
        _HOME / ".pyenv",
    )
)
_WATCHED_EVENTS = frozenset({"open", "os.listdir", "os.scandir", "subprocess.Popen"})


def beside_the_checkout(path: str) -> bool:
    """Whether `path` (absolute or relative to the working directory) lies in the checkout's
    parent folder but outside the checkout and every allowed folder."""
    resolved = os.path.realpath(path)
    if _BESIDE_ROOT_FOLDER or not _under(resolved, os.path.realpath(_BESIDE)):
        return False
    return not any(_under(resolved, allowed) for allowed in _ALLOWED)


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


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
        self.touched: list[str] = []
        sys.addaudithook(self._audit)

    def _audit(self, event: str, args: tuple[object, ...]) -> None:
        if event not in _WATCHED_EVENTS:
            return
        for path in _paths_of(event, args):
            if beside_the_checkout(path):
                self.touched.append(f"{event} {path}")

    def take(self) -> list[str]:
        touched, self.touched = self.touched, []
        return touched


_reads = RepositoryReads()


def pytest_collection_finish(session: pytest.Session) -> None:
    if touched := _reads.take():
        raise pytest.UsageError(
            f"collecting the tests read outside the repository ({REPOSITORY}): {touched}"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    _reads.take()
    yield
    if touched := _reads.take():
        pytest.fail(f"{item.nodeid} read outside the repository ({REPOSITORY}): {touched}")
