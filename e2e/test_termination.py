"""The stand-in kubelet's termination of a pod's process (harness/termination.py), on real local
processes: preStop first, SIGTERM to the main process, SIGKILL at the end of the grace period."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

from e2e.harness.processes import Supervisor
from e2e.harness.termination import TerminationRecord, grace_seconds, terminate

# Exits 0 on SIGTERM after writing when it got it; with "stubborn", ignores SIGTERM.
CHILD = """
import signal, sys, time
path = sys.argv[1]
def stop(*_):
    open(path, "a").write(f"sigterm {time.monotonic()}\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if "stubborn" in sys.argv else stop)
while True:
    time.sleep(0.05)
"""


def _pod(grace: int, pre_stop: dict[str, Any] | None) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "c"}
    if pre_stop is not None:
        container["lifecycle"] = {"preStop": pre_stop}
    return {
        "metadata": {"name": "p", "namespace": "n", "deletionGracePeriodSeconds": grace},
        "spec": {"containers": [container], "terminationGracePeriodSeconds": 99},
        "status": {"podIP": "127.0.0.1"},
    }


def _run(tmp_path: Path, pod: dict[str, Any], *flags: str) -> tuple[TerminationRecord, float, str]:
    supervisor = Supervisor(tmp_path / "logs")
    marks = tmp_path / "marks"
    child = supervisor.start("child", [sys.executable, "-c", CHILD, str(marks), *flags])
    time.sleep(0.5)  # its handler installed
    record = TerminationRecord("n", "p", "engine", grace_seconds(pod), "")
    started = time.monotonic()
    terminate(child, pod, record, env={}, tandem=(), seen_at=started, stop=threading.Event())
    supervisor.stop_all()
    return record, started, marks.read_text() if marks.exists() else ""


def test_the_delete_carries_the_grace_period() -> None:
    assert grace_seconds(_pod(7, None)) == 7
    pod = _pod(7, None)
    del pod["metadata"]["deletionGracePeriodSeconds"]
    assert grace_seconds(pod) == 99


def test_pre_stop_sleep_comes_before_sigterm(tmp_path: Path) -> None:
    record, started, marks = _run(tmp_path, _pod(10, {"sleep": {"seconds": 1}}))
    sigterm_at = float(marks.split()[1])
    assert sigterm_at - started >= 1.0
    assert record.events == ["slept 1.0 s"]
    assert not record.killed
    assert record.exit_code == 0


def test_pre_stop_exec_runs_to_its_end_first(tmp_path: Path) -> None:
    hook = {
        "exec": {"command": [sys.executable, "-c", "import time; time.sleep(0.5); print('hooked')"]}
    }
    record, started, marks = _run(tmp_path, _pod(10, hook))
    assert record.events[0].startswith("exec exited 0: hooked")
    assert float(marks.split()[1]) - started >= 0.5


def test_a_process_ignoring_sigterm_is_killed_at_the_end_of_the_grace_period(
    tmp_path: Path,
) -> None:
    record, started, _ = _run(tmp_path, _pod(1, {"sleep": {"seconds": 5}}), "stubborn")
    # the preStop sleep is cut at the grace period too
    assert record.pre_stop_s < 2
    assert record.killed
    assert time.monotonic() - started < 5
