"""Test harness: emulator processes on free 127.0.0.1 ports, and the golden vLLM transcripts."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT.parent / "shared" / "golden"
MODEL_DIR = GOLDEN / "model"

needs_golden = pytest.mark.skipif(not GOLDEN.is_dir(), reason="golden transcripts not present")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Emulator:
    """One `tandem emulate` process; stopped (and reaped) on exit."""

    def __init__(
        self, args: list[str], env: dict[str, str] | None = None, port: int | None = None
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"tandem-emulator-{self.port}.log"
        argv = [
            sys.executable,
            "-m",
            "tandem.cli",
            "emulate",
            *args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        self.log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"emulator exited with {self.proc.returncode}: {self.output()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            time.sleep(0.05)
        raise TimeoutError(f"emulator not ready after {timeout} s: {self.output()}")

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        with contextlib.suppress(OSError):
            self.log_path.unlink()


@contextlib.contextmanager
def emulator(
    args: list[str], env: dict[str, str] | None = None, ready: bool = True
) -> Iterator[Emulator]:
    proc = Emulator(args, env)
    try:
        if ready:
            proc.wait_ready()
        yield proc
    finally:
        proc.stop()


TINY_ARGS = [
    "--model",
    str(MODEL_DIR),
    "--served-model-name",
    "tiny",
    "--max-model-len",
    "1024",
    "--block-size",
    "32",
    "--enable-prefix-caching",
    "--load-format",
    "dummy",
    "--speedup",
    "20",
]


def shape(value: object) -> object:
    """The structure of a JSON value: key sets, list element shapes and scalar type names."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def golden_json(*parts: str) -> dict[str, object]:
    import json

    data = json.loads(GOLDEN.joinpath(*parts).read_text())
    assert isinstance(data, dict)
    return data


def metric_value(text: str, prefix: str) -> float:
    """The value of the first sample line of a /metrics body starting with `prefix`."""
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {prefix!r}")


def counter_values(text: str) -> dict[str, float]:
    """Every vllm:* sample that does not measure time: counters, gauges, histogram counts and sums
    of token-valued histograms (what the same traffic must reproduce exactly)."""
    values = {}
    for line in text.splitlines():
        if not line.startswith("vllm:") or "_created" in line or "_bucket" in line:
            continue
        if "seconds" in line or "cache_config_info" in line:
            continue
        key, value = line.rsplit(" ", 1)
        values[key] = float(value)
    return values


def golden_request(path: Path) -> tuple[str, dict[str, object]]:
    """(URL path, JSON body) of a golden NAME.req.http."""
    import json

    raw = path.read_bytes().decode()
    head, _, body = raw.partition("\r\n\r\n")
    return head.split()[1], json.loads(body)
