"""Scale from zero at the router: a request arriving while no decode engine is ready is held and
served once one starts; past `engineWaitSeconds` it gets 503 with Retry-After, never a hang.
Real router and emulator processes over 127.0.0.1."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time
from typing import Any

import httpx
import pytest
from router_harness import (
    DEBUG,
    ENGINE_ARGS,
    LONG,
    SHORT,
    SIDE_CHANNELS,
    Proc,
    Router,
    kv_transfer_config,
    metric,
    metrics,
    wait_until,
)

from tandem.common.ports import free_port
from tandem.common.routing import DisaggregationConfig
from tandem.router.wake import wait_retry_after_s, wants_prefill


def engine_on(port: int, role: str, speedup: str = "20", extra: tuple[str, ...] = ()) -> Proc:
    """An emulator engine on a given port: the address the router already lists."""
    side_channel = SIDE_CHANNELS.setdefault(f"http://127.0.0.1:{port}", free_port())
    args = [
        "emulate",
        *ENGINE_ARGS,
        *extra,
        "--speedup",
        speedup,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--kv-transfer-config",
        kv_transfer_config("kv_producer" if role == "prefill" else "kv_consumer"),
    ]
    env = {
        "PYTHONHASHSEED": "0",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel),
    }
    return Proc(f"engine-{role}", args, port, env)


def predictions(router: Router) -> list[dict[str, Any]]:
    """The predictive policy's debug line of each ticket the router ended, oldest first."""
    marker = "predictor: prediction "
    lines = router.log_path.read_text(errors="replace").splitlines()
    return [json.loads(line.split(marker, 1)[1]) for line in lines if marker in line]


def post(url: str, prompt: str) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4}
    return httpx.post(url + "/v1/completions", json=body, headers=DEBUG, timeout=120)


def test_request_is_held_until_a_decode_engine_starts_then_served() -> None:
    decode_port, prefill_port = free_port(), free_port()
    decode_url = f"http://127.0.0.1:{decode_port}"
    SIDE_CHANNELS.setdefault(decode_url, free_port())
    SIDE_CHANNELS.setdefault(f"http://127.0.0.1:{prefill_port}", free_port())
    router = Router(
        [
            "--decode",
            decode_url,
            "--prefill",
            f"http://127.0.0.1:{prefill_port}",
            "--engine-wait-seconds",
            "90",
            "--min-uncached-tokens",
            "32",
        ]
    )
    engine: Proc | None = None
    try:
        router.wait_ready()
        # Ready with no engine at all: the router holds, so it stays in its Service.
        assert httpx.get(router.url + "/health", timeout=5).status_code == 200
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(post, router.url, LONG)
            wait_until(
                lambda: metric(metrics(router.url), "tandem_router_engine_wait_requests") == 1,
                timeout=30,
            )
            time.sleep(1.0)
            assert not answer.done(), "the request must wait, not fail"
            engine = engine_on(decode_port, "decode")
            started = time.monotonic()
            response = answer.result(timeout=90)
            served_after_s = time.monotonic() - started
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"]
        assert response.headers["x-tandem-route"] == "local"
        text = metrics(router.url)
        assert metric(text, "tandem_router_engine_wait_requests") == 0
        assert metric(text, "tandem_router_engine_wait_seconds_count", outcome="ready") == 1
        # A long prompt served locally only for want of a prefill engine: P/D would have paid.
        assert metric(text, "tandem_router_prefill_wanted_total") == 1
        print(f"held request served {served_after_s:.2f}s after the engine process started")
    finally:
        if engine is not None:
            engine.stop()
        router.stop()


@pytest.mark.parametrize("policy", ["weighted", "predictive"])
def test_a_request_refused_by_the_last_draining_engine_is_held_until_a_new_one_starts(
    policy: str,
) -> None:
    """A pool going to zero: its last decode engine drains after SIGTERM (vLLM's refusal) while a
    request arrives. The router marks the engine draining, holds the request as one that found no
    engine (the held gauge wakes the pool), and serves it on the engine that starts next on the
    same address, once the drained one has exited. Under the predictive policy the request is
    predicted again on its new plan: the refused plan's ticket ends unanswered (its debug line has
    no output) and a ticket of the new plan sees the answer."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    draining = engine_on(port, "decode", speedup="1", extra=("--shutdown-timeout", "60"))
    router = Router(
        ["--decode", url, "--engine-wait-seconds", "90", "--policy", policy, "--log-level", "debug"]
    )
    fresh: Proc | None = None
    try:
        draining.wait_ready()
        router.wait_ready()
        assert post(router.url, SHORT).status_code == 200
        # Long enough (seconds at speedup 1) that the engine still drains when the router's
        # request reaches it.
        long_body = {"model": "tiny", "prompt": SHORT, "max_tokens": 1500, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            held_by_engine = pool.submit(
                httpx.post, f"{url}/v1/completions", json=long_body, timeout=120
            )
            wait_until(lambda: metric(metrics(url), "vllm:num_requests_running") >= 1, timeout=30)
            draining.proc.send_signal(signal.SIGTERM)
            probe = {"model": "tiny", "prompt": SHORT, "max_tokens": 1}
            wait_until(
                lambda: (
                    httpx.post(f"{url}/v1/completions", json=probe, timeout=30).status_code == 500
                )
            )
            answer = pool.submit(post, router.url, SHORT)
            wait_until(
                lambda: metric(metrics(router.url), "tandem_router_engine_wait_requests") == 1,
                timeout=30,
            )
            text = metrics(router.url)
            refused = {"pool": "decode", "endpoint": url, "kind": "draining"}
            assert metric(text, "tandem_router_upstream_errors_total", **refused) == 1
            engines = httpx.get(router.url + "/engines", timeout=5).json()
            assert [e["draining"] for e in engines] == [True]
            assert (
                held_by_engine.result(timeout=90).json()["choices"][0]["finish_reason"] == "length"
            )
            assert draining.proc.wait(90) is not None
            wait_until(
                lambda: (
                    metric(metrics(router.url), "tandem_router_engine_healthy", endpoint=url) == 0
                ),
                timeout=30,
            )
            assert not answer.done(), "the request must wait for the new engine, not fail"
            fresh = engine_on(port, "decode")
            response = answer.result(timeout=90)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"]
        engines = httpx.get(router.url + "/engines", timeout=5).json()
        assert [(e["healthy"], e["draining"]) for e in engines] == [(True, False)]
        text = metrics(router.url)
        # Held once or, when a health check caught the engine first, twice: never timed out.
        assert metric(text, "tandem_router_engine_wait_seconds_count", outcome="ready") >= 1
        assert metric(text, "tandem_router_engine_wait_seconds_count", outcome="timeout") == 0
        assert metric(text, "tandem_router_engine_wait_requests") == 0
        if policy == "predictive":
            # the first request's ticket, then the held request's: its refused plan's (and a
            # plan refused again, if any) unanswered, its last plan's answered
            outputs = [p["output"] for p in predictions(router)]
            assert outputs[0], outputs
            assert None in outputs[1:-1], outputs
            assert outputs[-1], outputs
    finally:
        for proc in (fresh, draining):
            if proc is not None:
                proc.stop()
        router.stop()


def test_request_waiting_past_the_bound_gets_503_with_retry_after() -> None:
    router = Router(["--decode", f"http://127.0.0.1:{free_port()}", "--engine-wait-seconds", "1.5"])
    try:
        router.wait_ready()
        started = time.monotonic()
        response = post(router.url, "hello there")
        waited = time.monotonic() - started
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        error = response.json()["error"]
        assert error["type"] == "ServiceUnavailableError"
        assert error["code"] == 503
        assert "after waiting 1.5s" in error["message"]
        assert waited >= 1.5
        text = metrics(router.url)
        assert metric(text, "tandem_router_engine_wait_seconds_count", outcome="timeout") == 1
        assert metric(text, "tandem_router_engine_wait_requests") == 0
    finally:
        router.stop()


def test_without_engine_wait_no_engine_is_503_at_once_and_not_ready() -> None:
    router = Router(["--decode", f"http://127.0.0.1:{free_port()}"])
    try:
        router.wait_ready()
        assert httpx.get(router.url + "/health", timeout=5).status_code == 503
        response = post(router.url, "hello there")
        assert response.status_code == 503
        assert response.headers["retry-after"] == "2"
    finally:
        router.stop()


def test_retry_after_is_half_the_wait_within_bounds() -> None:
    assert wait_retry_after_s(0.4) == 1
    assert wait_retry_after_s(7) == 4
    assert wait_retry_after_s(300) == 60


def test_prefill_is_wanted_only_where_pd_would_pay() -> None:
    auto = DisaggregationConfig(mode="auto", minUncachedTokens=256)
    assert wants_prefill(True, False, 300, 1, auto)
    assert not wants_prefill(True, False, 100, 1, auto)  # short: local anyway
    assert not wants_prefill(True, True, 300, 1, auto)  # a prefill engine was ready
    assert not wants_prefill(False, False, 300, 1, auto)  # went P/D
    assert not wants_prefill(True, False, 300, 2, auto)  # n > 1 never hands off
    assert wants_prefill(True, False, 0, 1, DisaggregationConfig(mode="always"))
    assert not wants_prefill(True, False, 9999, 1, DisaggregationConfig(mode="never"))
