"""A `tandem ...` subprocess on a free 127.0.0.1 port, for the suites that start real processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
# Real vLLM 0.32's transcripts, KV-event frames, P/D exchanges and the tiny model
# (tests/fixtures/vllm-0.32/README.md says how they were captured).
GOLDEN = ROOT / "tests" / "fixtures" / "vllm-0.32"
MODEL_DIR = GOLDEN / "model"


def terminate(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s`; reaped either way."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(grace_s)


class TandemProcess:
    """One `python -m tandem.cli ARGS` process, its output in a log file; `stop()` reaps it."""

    def __init__(
        self, name: str, args: list[str], port: int, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"tandem-test-{name}-{port}.log"
        self.log = self.log_path.open("wb")
        self.args = args
        self.env = env
        self.proc = self._launch()

    def _launch(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", *self.args],
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(self.env or {})},
        )

    def restart(self) -> None:
        """Kills the process and starts it again with the same arguments on the same port: a pod
        restarted in place, with nothing of its former state."""
        self.kill()
        self.proc = self._launch()

    def wait_ready(
        self,
        path: str = "/health",
        timeout: float = 40.0,
        ready: Callable[[int], bool] = lambda status: status == 200,
    ) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}: {self.output()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if ready(httpx.get(self.url + path, timeout=1.0).status_code):
                    return
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} not ready after {timeout} s: {self.output()}")

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        terminate(self.proc)
        self.log.close()
        with contextlib.suppress(OSError):
            self.log_path.unlink()
