"""The per-request timing breakdown over real HTTP: `x-tandem-<stage>-ms` headers and the same
values in the router's Prometheus histograms, for P/D and local routes."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from router_harness import LONG, SHORT, Engine, Router, metric, metrics, running

pytestmark = pytest.mark.timeout(120)

STAGES = ("queue", "schedule", "prefill", "kv-handoff", "upstream", "ttft")
# Headers carry 3 decimals of a millisecond; sums of rounded values may drift by that much each.
ROUNDING_MS = 0.0005 * len(STAGES)


@pytest.fixture(scope="module")
def pd() -> Iterator[tuple[Engine, Engine]]:
    prefill, decode = Engine("prefill", speedup=50), Engine("decode", speedup=50)
    with running(prefill, decode):
        yield prefill, decode


def breakdown(headers: httpx.Headers) -> dict[str, float]:
    return {
        name.removeprefix("x-tandem-").removesuffix("-ms"): float(value)
        for name, value in headers.items()
        if name.startswith("x-tandem-") and name.endswith("-ms")
    }


def timed_stream(router: Router, prompt: str) -> tuple[httpx.Headers, float, list[str]]:
    """Streams one completion; returns its headers, the client's wall time to them, the events."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": True}
    started = time.perf_counter()
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as response:
        wall_ms = (time.perf_counter() - started) * 1e3
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    return response.headers, wall_ms, events


def check_consistent(stages: dict[str, float], wall_ms: float) -> None:
    assert all(value >= 0 for value in stages.values()), stages
    assert stages["queue"] + stages["schedule"] + stages["upstream"] <= stages["ttft"] + ROUNDING_MS
    assert (
        stages.get("prefill", 0) + stages.get("kv-handoff", 0) <= stages["upstream"] + ROUNDING_MS
    )
    assert stages["ttft"] <= wall_ms


def test_pd_and_local_breakdown_headers_match_histograms(pd: tuple[Engine, Engine]) -> None:
    prefill, decode = pd
    router = Router(
        ["--prefill", prefill.url, "--decode", decode.url, "--min-uncached-tokens", "32"]
    )
    with running(router):
        headers, wall_ms, events = timed_stream(router, LONG)
        assert headers["x-tandem-route"] == "disaggregated"
        assert events[-1] == "data: [DONE]"
        split = breakdown(headers)
        assert set(split) == set(STAGES)
        check_consistent(split, wall_ms)
        assert split["kv-handoff"] > 0  # the decode pod pulled the KV before its first byte
        # One measurement, two outputs: the histograms hold exactly the header values.
        text = metrics(router.url)
        for stage, histogram in (
            ("queue", "tandem_router_queue_seconds_sum"),
            ("schedule", "tandem_router_decision_seconds_sum"),
            ("prefill", "tandem_router_prefill_seconds_sum"),
            ("kv-handoff", "tandem_router_kv_handoff_seconds_sum"),
            ("ttft", "tandem_router_ttft_seconds_sum"),
        ):
            assert metric(text, histogram) * 1e3 == pytest.approx(split[stage], abs=0.0006)

        headers, wall_ms, events = timed_stream(router, SHORT)  # under the threshold: local
        assert headers["x-tandem-route"] == "local"
        assert events[-1] == "data: [DONE]"
        split = breakdown(headers)
        assert set(split) == {"queue", "schedule", "upstream", "ttft"}
        check_consistent(split, wall_ms)
        text = metrics(router.url)
        assert metric(text, "tandem_router_kv_handoff_seconds_count") == 1
        assert metric(text, "tandem_router_ttft_seconds_count") == 2

        started = time.perf_counter()
        plain = httpx.post(
            router.url + "/v1/completions",
            json={"model": "tiny", "prompt": "not streamed: " + LONG, "max_tokens": 2},
            timeout=60,
        )
        wall_ms = (time.perf_counter() - started) * 1e3
        assert plain.status_code == 200
        assert plain.headers["x-tandem-route"] == "disaggregated"
        split = breakdown(plain.headers)
        assert set(split) == set(STAGES)
        check_consistent(split, wall_ms)


def test_colocated_worker_has_no_pd_stages(pd: tuple[Engine, Engine]) -> None:
    _, decode = pd
    router = Router(["--worker", decode.url])
    with running(router):
        headers, wall_ms, _ = timed_stream(router, LONG)
        assert headers["x-tandem-route"] == "local"
        split = breakdown(headers)
        assert set(split) == {"queue", "schedule", "upstream", "ttft"}
        check_consistent(split, wall_ms)
