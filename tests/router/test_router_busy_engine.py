"""An engine too busy streaming to answer its health probe in time stays in service; one whose
stream stalls as well is taken out. Real router and emulator processes over 127.0.0.1; the
emulator's `--health-delay` holds /health while it runs requests, as a vLLM API server starved
on a loaded machine does (the real-vLLM tier has seen one silent for 28 s)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from router_harness import (
    Engine,
    Router,
    metric,
    metrics,
    running,
    wait_all_healthy,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)

HEALTH_DELAY_S = 3.0
PROBE_TIMEOUT_S = 1.0  # the router's connect and health timeout here


class Stream:
    """One long streamed completion through the router, read in a thread: its chunks so far."""

    def __init__(self, router: Router, max_tokens: int) -> None:
        self.chunks = 0
        self.error: str | None = None
        self.stop = threading.Event()
        body = {
            "model": "tiny",
            "prompt": "a stream long enough to keep the engine busy",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        self._thread = threading.Thread(target=self._read, args=(router.url, body), daemon=True)
        self._thread.start()

    def _read(self, url: str, body: dict[str, object]) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as answer:
                for _ in answer.iter_lines():
                    self.chunks += 1
                    if self.stop.is_set():
                        return
        except httpx.HTTPError as exc:
            self.error = repr(exc)

    def join(self, timeout_s: float) -> None:
        self.stop.set()
        self._thread.join(timeout_s)


def router_for(engine: Engine, tmp_path: Path) -> Router:
    config = tmp_path / "router.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "servedModelName": "tiny",
                "static": {},
                "healthCheckIntervalSeconds": 0.3,
                "timeouts": {"connectSeconds": PROBE_TIMEOUT_S},
            }
        )
    )
    return Router(["--config", str(config), "--decode", engine.url])


def healthy(router: Router, engine: Engine) -> float:
    return metric(metrics(router.url), "tandem_router_engine_healthy", endpoint=engine.url)


@contextlib.contextmanager
def streaming(tmp_path: Path, *faults: str) -> Iterator[tuple[Engine, Router, Stream]]:
    """An engine whose /health is held HEALTH_DELAY_S while it runs requests (and `faults`), its
    router, and a long stream through them that has begun; the stream is let go after."""
    engine = Engine(None, speedup=1.0, extra=["--health-delay", str(HEALTH_DELAY_S), *faults])
    router = router_for(engine, tmp_path)
    with running(engine, router):
        wait_all_healthy(router)  # its first probe may time out on a starting router
        stream = Stream(router, max_tokens=3000)
        try:
            wait_until(lambda: stream.chunks >= 3, timeout=20)
            yield engine, router, stream
        finally:
            stream.join(1)


def test_an_engine_streaming_past_its_health_timeout_keeps_serving(tmp_path: Path) -> None:
    """While a stream flows, every probe of the router times out (the engine's /health answers
    after 3 s, the router waits 1 s, every 0.3 s), yet the engine stays healthy and a new request
    is served beside the stream; without the stream's evidence it would be marked down and the
    request answered 503."""
    with streaming(tmp_path) as (engine, router, stream):
        started = time.monotonic()
        probe = httpx.get(f"{engine.url}/health", timeout=10)
        assert probe.status_code == 200
        assert time.monotonic() - started >= HEALTH_DELAY_S - 0.1  # the probe is held
        seen = [healthy(router, engine)]
        body = {"model": "tiny", "prompt": "served beside the stream", "max_tokens": 4}
        beside = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            seen.append(healthy(router, engine))
            time.sleep(0.1)
        assert stream.error is None, stream.error
        assert beside.status_code == 200, beside.text
        assert seen == [1.0] * len(seen), seen


def test_an_engine_whose_stream_stalls_and_probe_times_out_is_marked_down(tmp_path: Path) -> None:
    """The same engine with its stream stalled after 20 tokens: nothing reaches the router, so
    the timed-out probe counts and the engine is marked unhealthy."""
    with streaming(tmp_path, "--stall-after-tokens", "20") as (engine, router, _):
        wait_until(lambda: healthy(router, engine) == 0.0, timeout=15)
