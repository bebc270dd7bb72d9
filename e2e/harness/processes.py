"""Child processes that the harness starts: each in its own process group, logged, reaped."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


class ProcessFailed(RuntimeError):
    """A child exited or never became ready; the message carries the tail of its log."""


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class Child:
    """One running child process and where its output goes."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM to the whole group, SIGKILL after `grace_s`; always reaps the child."""
        if self.popen.poll() is None:
            _signal_group(self.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=grace_s)
        # Helpers the child spawned may outlive it in its group; they go too.
        _signal_group(self.pid, signal.SIGKILL)
        if self.popen.poll() is None:
            self.popen.wait(timeout=10)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def group_members(pgid: int) -> list[int]:
    """Pids still alive (not zombies) in process group `pgid`, read from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command: state ppid pgrp ...
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


@functools.cache
def _die_with_parent() -> tuple[str, ...]:
    """A prefix that makes a child die with the thread that started it (PR_SET_PDEATHSIG).

    Teardown stops every child gracefully; this covers the test run itself being killed, so
    that not even a crashed run leaves an apiserver or an engine behind.
    """
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return ()
    usage = subprocess.run([setpriv, "--help"], capture_output=True, text=True, check=False)
    return (setpriv, "--pdeathsig", "KILL", "--") if "--pdeathsig" in usage.stdout else ()


@dataclass
class Supervisor:
    """Starts children, remembers every process group it made, and stops them in reverse order."""

    log_dir: Path
    children: list[Child] = field(default_factory=list)
    started_groups: set[int] = field(default_factory=set)

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        with log.open("ab") as out:
            popen = subprocess.Popen(
                [*_die_with_parent(), *argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
            )
        child = Child(name, popen, log)
        self.children.append(child)
        self.started_groups.add(child.pid)
        return child

    def stop(self, child: Child, grace_s: float = 5.0) -> None:
        child.stop(grace_s)
        if child in self.children:
            self.children.remove(child)

    def stop_all(self, grace_s: float = 5.0) -> None:
        for child in reversed(list(self.children)):
            self.stop(child, grace_s)

    def leftovers(self) -> list[int]:
        """Pids of any process still alive in a group this supervisor started."""
        return [pid for pgid in sorted(self.started_groups) for pid in group_members(pgid)]


def wait_until(
    predicate: Callable[[], bool],
    *,
    timeout_s: float,
    what: str,
    interval_s: float = 0.2,
    child: Child | None = None,
) -> None:
    """Polls `predicate` until true; fails early with the log tail when `child` dies."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if child is not None and not child.alive():
            raise ProcessFailed(
                f"{child.name} exited with {child.popen.returncode} while waiting for {what}:\n"
                f"{log_tail(child.log)}"
            )
        try:
            if predicate():
                return
        except Exception as error:  # the thing being waited for is not up yet
            last_error = error
        time.sleep(interval_s)
    detail = f" (last error: {last_error!r})" if last_error else ""
    tail = f"\n{log_tail(child.log)}" if child is not None else ""
    raise ProcessFailed(f"timed out after {timeout_s:.0f} s waiting for {what}{detail}{tail}")
