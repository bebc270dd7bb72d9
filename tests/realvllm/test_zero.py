"""`tandem up --engine vllm` with scale to zero, on real vLLM: the idle cluster's engines are
stopped (vLLM's own SIGTERM shutdown), a request arriving then is held by the router while real
vLLM engines start again, and is answered; the time to its first token is measured."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import EXAMPLE, VLLM_PYTHON
from tandem_process import MODEL_DIR, ROOT

from tandem.bench.first_token import OutputLines, first_content_s
from tandem.common.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_real_vllm_engines_stop_when_idle_and_start_for_a_held_request(tmp_path: Path) -> None:
    # At most two vLLM engines on this machine: this module runs after every module that uses the
    # shared pair (conftest's MODULE_ORDER puts unlisted modules last), which test_up has stopped.
    port = free_port()
    up = subprocess.Popen(
        [
            sys.executable, "-m", "tandem.cli", "up", str(EXAMPLE),
            "--engine", "vllm", "--vllm-python", VLLM_PYTHON,
            "--set", f"spec.model.name={MODEL_DIR}",
            "--set", "spec.autoscaling.scaleToZero.enabled=true",
            "--set", "spec.autoscaling.scaleToZero.idleSeconds=5",
            "--set", "spec.autoscaling.scaleToZero.wakeTimeoutSeconds=600",
            "--port", str(port), "--run-dir", str(tmp_path),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    output = OutputLines(up)
    seen = output.seen
    wait_for = output.wait_for

    try:
        wait_for("ready", 600)
        prompt = "Hello from a cluster at zero! " * 20
        warm_s, headers = first_content_s(port, "tiny", prompt, 4, 600)
        assert headers["x-tandem-route"] == "disaggregated"
        wait_for("decode: 1 -> 0", 120)
        wait_for_engines_gone = time.monotonic() + 120
        while "prefill: 1 -> 0" not in "".join(seen) and time.monotonic() < wait_for_engines_gone:
            time.sleep(0.5)
        cold_s, headers = first_content_s(
            port, "tiny", "A new question after the idle window. " * 20, 4, 600
        )
        route = headers["x-tandem-route"]
        print(f"real vLLM TTFT warm {warm_s:.2f}s, from zero {cold_s:.2f}s (route {route})")
        # The wake was printed before the answer; read tandem up's output up to it.
        wait_for("decode: 0 -> 1", 60)
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=180)
    assert up.returncode == 0, "".join(seen)
