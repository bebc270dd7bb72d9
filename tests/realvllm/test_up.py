"""`tandem up --engine vllm` of the tiny example, as a user runs it: real vLLM prefill and decode
engines from the interpreter named by --vllm-python, each on CPU cores of its own, answering
through the router; Ctrl-C stops everything."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from harness import EXAMPLE, VLLM_PYTHON, PDCluster, openai_client
from tandem_process import MODEL_DIR, ROOT

from tandem.common.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_tandem_up_serves_the_tiny_example_on_real_vllm(
    pd_cluster: PDCluster, tmp_path: Path
) -> None:
    pd_cluster.stop()  # at most two vLLM engines on this machine: the shared pair makes room
    port = free_port()
    up = subprocess.Popen(
        [
            sys.executable, "-m", "tandem.cli", "up", str(EXAMPLE),
            "--engine", "vllm", "--vllm-python", VLLM_PYTHON,
            "--set", f"spec.model.name={MODEL_DIR}",
            "--port", str(port), "--run-dir", str(tmp_path),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    output: list[str] = []
    try:
        assert up.stdout is not None
        for line in up.stdout:
            output.append(line)
            if "ready" in line or up.poll() is not None:
                break
        assert any("ready" in line for line in output), "".join(output)
        raw = openai_client(f"http://127.0.0.1:{port}").chat.completions.with_raw_response.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hello from tandem up! " * 20}],
            max_tokens=4,
        )
        assert raw.headers["x-tandem-route"] == "disaggregated"
        assert raw.parse().usage is not None
        # The operator's flags ran on real vLLM: each engine on a core of its own.
        cores = {
            name: re.findall(
                r"core ids=\[([\d, ]+)\]", (tmp_path / "logs" / f"{name}.log").read_text()
            )
            for name in ("prefill-0", "decode-0")
        }
        assert all(cores.values()), cores
        assert not set(cores["prefill-0"][0].split(", ")) & set(cores["decode-0"][0].split(", "))
    finally:
        up.send_signal(signal.SIGINT)
        rest, _ = up.communicate(timeout=120)
    assert up.returncode == 0, "".join(output) + rest
