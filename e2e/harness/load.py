"""Continuous, bounded client load on a router for the e2e tests: each request checked whole."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field


@dataclass
class LoadResult:
    sent: int = 0
    ok: int = 0
    longest_s: float = 0.0
    failures: list[str] = field(default_factory=list)
    spans: list[tuple[float, float]] = field(default_factory=list)

    def overlapping(self, start: float, end: float) -> int:
        """How many requests were in flight at some moment of [start, end] (monotonic clock)."""
        return sum(1 for began, ended in self.spans if began <= end and ended >= start)


class Load:
    """Threads sending completions to `url` one after another until stopped, at most
    `max_requests` in all and `max_seconds` long: `workers` ask for `short_tokens` each, and
    `long_workers` ask for `long_tokens` each (still running when an engine is told to stop), the
    k-th starting k·`long_stagger_s` late so that their requests stay spread over time instead of
    starting and ending together. Requests alternate streamed and plain. A request counts as ok
    only with status 200 and every token it asked for (`ignore_eos`), and for a stream its
    `[DONE]` with no error event before it."""

    def __init__(
        self,
        url: str,
        model: str,
        *,
        workers: int = 2,
        short_tokens: int = 16,
        long_workers: int = 0,
        long_tokens: int = 600,
        long_stagger_s: float = 0.0,
        max_requests: int = 20_000,
        max_seconds: float = 240.0,
    ) -> None:
        self.url = url
        self.model = model
        self.max_requests = max_requests
        self.deadline = time.monotonic() + max_seconds
        self.result = LoadResult()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._work, args=(i, short_tokens, 0.0), daemon=True)
            for i in range(workers)
        ] + [
            threading.Thread(
                target=self._work, args=(workers + k, long_tokens, k * long_stagger_s), daemon=True
            )
            for k in range(long_workers)
        ]

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> LoadResult:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)
        return self.result

    def _next(self) -> int | None:
        with self._lock:
            if (
                self._stop.is_set()
                or self.result.sent >= self.max_requests
                or time.monotonic() > self.deadline
            ):
                return None
            self.result.sent += 1
            return self.result.sent

    def _work(self, worker: int, tokens: int, delay_s: float) -> None:
        if self._stop.wait(delay_s):
            return
        while (number := self._next()) is not None:
            stream = number % 2 == 0
            prompt = f"worker {worker} request {number}: " + "drain me gently. " * 40
            started = time.monotonic()
            problem = self.request(prompt, tokens, stream)
            ended = time.monotonic()
            with self._lock:
                self.result.longest_s = max(self.result.longest_s, ended - started)
                self.result.spans.append((started, ended))
                if problem is None:
                    self.result.ok += 1
                else:
                    self.result.failures.append(f"#{number} stream={stream}: {problem}")

    def request(self, prompt: str, tokens: int, stream: bool) -> str | None:
        """One request; None when it was answered whole, else what went wrong."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": tokens,
            "ignore_eos": True,
            "stream": stream,
        }
        request = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as answer:
                data = answer.read().decode()
        except urllib.error.HTTPError as error:
            return f"{error.code} {error.read()[:200]!r}"
        except OSError as error:
            return repr(error)
        if not stream:
            got = json.loads(data).get("usage", {}).get("completion_tokens")
            return None if got == tokens else f"{got} of {tokens} tokens"
        events = [line[6:] for line in data.splitlines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return f"stream without [DONE]: {events[-2:]}"
        chunks = [json.loads(e) for e in events[:-1]]
        errors = [c for c in chunks if "error" in c]
        if errors:
            return f"error event {errors[0]}"
        finish = [ch.get("finish_reason") for c in chunks for ch in c.get("choices", [])]
        return None if "length" in finish else f"stream finished {[f for f in finish if f]}"
