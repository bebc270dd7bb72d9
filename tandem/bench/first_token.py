"""Time to first token of one streamed chat request: the probe of a scale-from-zero measurement
(benchmarks/scale_to_zero.py) and of the tests that wake a cluster with a request."""

from __future__ import annotations

import time

import httpx


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
