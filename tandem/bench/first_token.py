"""The probes of a scale-from-zero measurement (benchmarks/scale_to_zero.py) and of the tests that
wake a cluster with a request: time to first token of one streamed chat request, and `tandem up`'s
output lines waited for with a bound."""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from typing import IO

import httpx


class OutputLines:
    """A process's output, read on a thread so a wait for a line is bounded in time; `seen` holds
    every line read so far."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        assert process.stdout is not None
        threading.Thread(target=self._read, args=(process.stdout,), daemon=True).start()

    def _read(self, stdout: IO[str]) -> None:
        for line in stdout:
            self.lines.put(line)

    def wait_for(self, needle: str, timeout_s: float) -> str:
        """The first line read from now on that contains `needle`; RuntimeError with the output
        seen after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            self.seen.append(line)
            if needle in line:
                return line
        raise RuntimeError(f"no {needle!r} within {timeout_s:g}s:\n{''.join(self.seen)}")


def first_content_s(
    port: int, model: str, prompt: str, max_tokens: int = 8, timeout_s: float = 300.0
) -> tuple[float, httpx.Headers]:
    """Seconds from sending one streamed chat completion to 127.0.0.1:`port` until its first
    content chunk, and the answer's headers (the router's `x-tandem-route` among them). Raises
    RuntimeError on an answer other than 200 or a stream without content."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    start = time.monotonic()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=timeout_s) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read()!r}")
        first = None
        for line in response.iter_lines():
            if first is None and '"content"' in line:
                first = time.monotonic() - start
        if first is None:
            raise RuntimeError("a stream without content")
        return first, response.headers
