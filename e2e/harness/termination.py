"""The kubelet's termination of a pod, for the pod runner: preStop hook, SIGTERM, grace, SIGKILL.

What a kubelet does when a pod it runs gets its deletionTimestamp (the API server's graceful
deletion), and what this models:

1. the container's `lifecycle.preStop` hook runs — `sleep` (the kubelet sleeps), `exec` (the
   command runs with the container's environment; `tandem ...` is this checkout's) or `httpGet`
   (a GET to the pod's IP, or `host`) — bounded by the grace period;
2. SIGTERM goes to the container's main process (only it: its children are its own business);
3. at `deletionGracePeriodSeconds` after the kubelet saw the deletion, SIGKILL (the whole group);
4. once the process has exited, the kubelet removes the Pod object (a delete with grace 0);
   until then the Pod stays, terminating, and controllers and watchers see it so.

Not modelled: the one-off 2 s extension the kubelet grants a preStop hook that overruns the grace
period, and a grace period shortened by a second delete while terminating.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from e2e.harness.processes import Child

RUNNER_ANNOTATION = "e2e.tandem.dev/pod-runner"
"""Marks a pod whose process the runner runs: KWOK leaves its deletion to the runner
(e2e/cluster/kwok.yaml), as it is the kubelet's once the containers have stopped."""


@dataclass
class TerminationRecord:
    """How one pod's termination went, for tests and reports."""

    namespace: str
    name: str
    role: str
    grace_s: float
    pre_stop: str  # the hook's kind, or "" without one
    pre_stop_s: float = 0.0
    exit_after_sigterm_s: float | None = None  # None until the process exits
    killed: bool = False  # SIGKILLed at the end of the grace period
    exit_code: int | None = None
    held_at_sigterm: int | None = None  # an engine's running + waiting requests, from /metrics
    events: list[str] = field(default_factory=list)


def pre_stop_hook(pod: Mapping[str, Any]) -> dict[str, Any] | None:
    """The first container's preStop handler, if any."""
    container = pod["spec"]["containers"][0]
    hook = (container.get("lifecycle") or {}).get("preStop")
    return dict(hook) if hook else None


def grace_seconds(pod: Mapping[str, Any]) -> float:
    """The grace period of this deletion: the one the delete carried, else the pod spec's."""
    meta = pod["metadata"]
    grace = meta.get("deletionGracePeriodSeconds")
    if grace is None:
        grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
    return float(grace)


def requests_held(pod: Mapping[str, Any]) -> int | None:
    """An engine pod's running and waiting requests now (vLLM's gauges), None if not an engine
    or not answering: what its drain has to finish."""
    if (pod["metadata"].get("labels") or {}).get("tandem.dev/role") not in ("prefill", "decode"):
        return None
    try:
        url = f"http://{pod['status']['podIP']}:8000/metrics"
        with urllib.request.urlopen(url, timeout=1) as answer:
            text = answer.read().decode()
    except OSError:
        return None
    held = 0.0
    for line in text.splitlines():
        if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")):
            held += float(line.rsplit(" ", 1)[1])
    return int(held)


def _port(pod: Mapping[str, Any], port: int | str) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for entry in pod["spec"]["containers"][0].get("ports") or []:
        if entry.get("name") == port:
            return int(entry["containerPort"])
    raise ValueError(f"no container port named {port}")


def run_pre_stop(
    hook: Mapping[str, Any],
    pod: Mapping[str, Any],
    *,
    env: Mapping[str, str],
    tandem: Sequence[str],
    deadline: float,
    stop: threading.Event,
) -> str:
    """Runs the hook until it ends or `deadline` (monotonic) passes; returns what happened."""
    remaining = max(deadline - time.monotonic(), 0.0)
    if "sleep" in hook:
        seconds = float(hook["sleep"]["seconds"])
        stop.wait(min(seconds, remaining))
        return f"slept {min(seconds, remaining):.1f} s"
    if "exec" in hook:
        command = list(hook["exec"]["command"])
        if command[:1] == ["tandem"]:
            command = [*tandem, *command[1:]]
        try:
            done = subprocess.run(
                command, env=dict(env), capture_output=True, timeout=remaining, check=False
            )
        except subprocess.TimeoutExpired:
            return "exec: cut at the end of the grace period"
        return f"exec exited {done.returncode}: {done.stdout.decode(errors='replace')[-200:]}"
    if "httpGet" in hook:
        get = hook["httpGet"]
        host = get.get("host") or pod["status"]["podIP"]
        url = f"http://{host}:{_port(pod, get['port'])}{get.get('path', '/')}"
        try:
            with urllib.request.urlopen(url, timeout=max(remaining, 0.1)) as answer:
                return f"httpGet {answer.status}"
        except OSError as error:
            return f"httpGet failed: {error}"
    return f"unsupported preStop handler {sorted(hook)}"


def terminate(
    child: Child,
    pod: Mapping[str, Any],
    record: TerminationRecord,
    *,
    env: Mapping[str, str],
    tandem: Sequence[str],
    seen_at: float,
    stop: threading.Event,
) -> None:
    """Steps 1-3 for one pod's process (step 4 is the caller's); returns once it has exited."""
    deadline = seen_at + record.grace_s
    hook = pre_stop_hook(pod)
    if hook is not None and child.alive():
        started = time.monotonic()
        record.events.append(
            run_pre_stop(hook, pod, env=env, tandem=tandem, deadline=deadline, stop=stop)
        )
        record.pre_stop_s = time.monotonic() - started
    record.held_at_sigterm = requests_held(pod)
    sigterm_at = time.monotonic()
    if child.alive():
        with contextlib.suppress(ProcessLookupError):
            child.popen.send_signal(signal.SIGTERM)
    while child.alive() and time.monotonic() < deadline and not stop.is_set():
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.popen.wait(timeout=0.1)
    record.killed = child.alive()
    child.stop(grace_s=0)  # SIGKILL to the group: what the process left behind goes too
    record.exit_after_sigterm_s = time.monotonic() - sigterm_at
    record.exit_code = child.popen.returncode
