"""`tandem up` with scale to zero: engines stop after the idle window, a request arriving then is
held by the router, the decode engine starts and serves it, and the prefill engine follows once a
prompt long enough for P/D comes. Real processes over 127.0.0.1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_local_up import alive, descendants

from tandem.bench.first_token import OutputLines, first_content_s
from tandem.common.ports import free_port
from tandem.local.zero import RouterCounts, router_demand

pytestmark = pytest.mark.timeout(240)
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LONG = " ".join(["word"] * 600)  # past minUncachedTokens: P/D pays for it


def engines_of(root: int) -> list[int]:
    found = []
    for pid in descendants(root):
        try:
            cmdline = (Path("/proc") / str(pid) / "cmdline").read_bytes()
        except OSError:
            continue
        if b"emulate" in cmdline and alive(pid):
            found.append(pid)
    return found


def test_idle_cluster_goes_to_zero_and_wakes_on_a_request(tmp_path: Path) -> None:
    port = free_port()
    command = [sys.executable, "-m", "tandem.cli", "up", str(EXAMPLES / "llama-8b-pd.yaml"),
               "--speedup", "20", "--port", str(port), "--prefill", "1", "--decode", "1",
               "--run-dir", str(tmp_path),
               "--set", "spec.autoscaling.scaleToZero.enabled=true",
               "--set", "spec.autoscaling.scaleToZero.idleSeconds=4",
               "--set", "spec.autoscaling.scaleToZero.wakeTimeoutSeconds=90"]  # fmt: skip
    env = os.environ | {"COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    children: set[int] = set()
    output = OutputLines(process)
    try:
        output.wait_for("ready", 90)
        children = descendants(process.pid)
        warm_s, headers = first_content_s(port, "llama-8b", LONG)
        assert headers["x-tandem-route"] == "disaggregated"

        # Idle: both pools go to zero together, the router stays up.
        output.wait_for("prefill: 1 -> 0", 60)
        deadline = time.monotonic() + 30
        while engines_of(process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not engines_of(process.pid), "engine processes still running after the idle window"
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200

        # A request now is held, decode wakes first and serves it.
        # (A prompt the engines never saw: the router's index still lists the blocks the stopped
        # engines held, which would make a repeated prompt look cached.)
        cold_s, headers = first_content_s(port, "llama-8b", LONG.replace("word", "cold"))
        assert headers["x-tandem-route"] == "local"
        # The long prompt went to decode only for want of a prefill engine: prefill wakes.
        output.wait_for("prefill: 0 -> 1", 30)
        deadline = time.monotonic() + 60
        route = ""
        while route != "disaggregated" and time.monotonic() < deadline:
            _, headers = first_content_s(port, "llama-8b", f"{time.monotonic()} {LONG}")
            route = headers["x-tandem-route"]
            time.sleep(0.5)
        assert route == "disaggregated"
        print(f"TTFT warm {warm_s:.3f}s, from zero {cold_s:.3f}s")

        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if alive(pid)], "tandem up left processes behind"


def test_router_metrics_become_the_demand_between_two_reads() -> None:
    text = (
        "# TYPE tandem_router_engine_wait_requests gauge\n"
        "tandem_router_engine_wait_requests 2.0\n"
        "# TYPE tandem_router_arrivals counter\n"
        "tandem_router_arrivals_total 7.0\n"
        "# TYPE tandem_router_prefill_wanted counter\n"
        "tandem_router_prefill_wanted_total 1.0\n"
        "# TYPE tandem_router_engine_in_flight gauge\n"
        'tandem_router_engine_in_flight{pool="decode",endpoint="a"} 1.0\n'
        'tandem_router_engine_in_flight{pool="prefill",endpoint="b"} 2.0\n'
    )
    first, counts = router_demand(text, None)
    assert (first.held, first.in_flight, first.arrived, first.prefill_wanted) == (2, 3, 0, 0)
    later, _ = router_demand(text, RouterCounts(arrivals=4, prefill_wanted=1))
    assert (later.arrived, later.prefill_wanted) == (3, 0)
    restarted, _ = router_demand(text, RouterCounts(arrivals=50, prefill_wanted=9))
    assert (restarted.arrived, restarted.prefill_wanted) == (0, 0)
    assert counts == RouterCounts(arrivals=7, prefill_wanted=1)
