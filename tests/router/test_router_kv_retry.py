"""A decode answer that failed before any output after a KV handoff is retried once without
remote prefill: emulator engines, the prefill engine killed between its answer and the decode
engine's NIXL pull (the emulator fails such a request as vLLM's `kv_load_failure_policy: fail`
does; real vLLM with the operator's `recompute` policy is tests/realvllm/test_failures.py)."""

from __future__ import annotations

import threading

import httpx
import pytest
from engine_standin import EngineStandIn
from router_harness import (
    LONG,
    SIDE_CHANNELS,
    Engine,
    Router,
    metric,
    metrics,
    running,
    wait_all_healthy,
    wait_until,
)
from stalling_relay import StallingRelay

pytestmark = pytest.mark.timeout(120)


def assert_sent_again_locally(router: Router, answer: httpx.Response, error_kind: str) -> None:
    """Answered through the decode engine's own prefill after one failure of `error_kind` on the
    decode request that carried the handoff."""
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-tandem-route"] == "local"
    text = metrics(router.url)
    assert metric(text, "tandem_router_retries_total", pool="decode", reason="kv_transfer") == 1
    assert metric(text, "tandem_router_upstream_errors_total", kind=error_kind) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_kv_pull_is_retried_on_decode_without_remote_prefill(stream: bool) -> None:
    prefill, decode = Engine("prefill"), Engine("decode")
    standin = EngineStandIn(prefill.url)
    # The stand-in relays the prefill engine's answers, which name that engine's side channel.
    SIDE_CHANNELS[standin.url] = SIDE_CHANNELS[prefill.url]
    router = Router(
        ["--prefill", standin.url, "--decode", decode.url, "--disaggregation", "always"]
    )
    try:
        with running(prefill, decode, router):
            wait_all_healthy(router)
            warm = httpx.post(
                f"{router.url}/v1/completions",
                json={"model": "tiny", "prompt": LONG + "warm", "max_tokens": 2},
                timeout=60,
            )
            assert warm.headers["x-tandem-route"] == "disaggregated"
            standin.arm(prefill.kill)
            body = {
                "model": "tiny",
                "prompt": LONG + "after the kill",
                "max_tokens": 4,
                "stream": stream,
            }
            answer = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
            assert standin.kills == 1
            assert_sent_again_locally(router, answer, "kv_transfer")
            assert "x-tandem-prefill-engine" not in answer.headers
            if stream:
                events = [line for line in answer.text.splitlines() if line.startswith("data: ")]
                assert events[-1] == "data: [DONE]"
                assert not any('"error"' in e for e in events)
            else:
                assert answer.json()["usage"]["completion_tokens"] == 4
    finally:
        standin.stop()


def test_a_decode_connection_broken_before_any_answer_after_a_handoff_is_sent_again_locally() -> (
    None
):
    """The decode engine's connection closes on the request with the handoff, before any answer
    (an engine that dies on it): the engine aborted it, so the router sends it once more without
    the handoff instead of answering 502."""
    prefill, decode = Engine("prefill"), Engine("decode")
    standin = EngineStandIn(decode.url)
    router = Router(
        ["--prefill", prefill.url, "--decode", standin.url, "--disaggregation", "always"]
    )
    try:
        with running(prefill, decode, router):
            wait_all_healthy(router)
            standin.drop_handoffs = True
            body = {"model": "tiny", "prompt": LONG + "dropped", "max_tokens": 4}
            answer = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
            assert standin.dropped == 1
            assert_sent_again_locally(router, answer, "connect")
            assert answer.json()["usage"]["completion_tokens"] == 4
    finally:
        standin.stop()


def test_a_decode_connect_that_timed_out_is_tried_once_more_with_the_handoff() -> None:
    """The only decode engine stops accepting (its connect times out) between the prefill answer
    and the decode request: nothing reached it, so the router tries it once more with the same
    handoff, which is still unread, instead of answering 502. A 4 s connect timeout spans two of the
    kernel's SYN retransmits (+1 s, +3 s), so the second attempt gets through once the relay
    resumes within 3 s of the first timeout, well inside the 30 s lease of the handoff."""
    prefill, decode = Engine("prefill", kv_lease_s=30), Engine("decode", kv_lease_s=30)
    relay = StallingRelay(decode.url)
    router = Router(
        [
            *("--prefill", prefill.url, "--decode", relay.url),
            *("--disaggregation", "always", "--connect-seconds", "4"),
        ]
    )

    def timed_out() -> bool:
        text = metrics(router.url)
        return metric(text, "tandem_router_upstream_errors_total", kind="timeout") >= 1

    try:
        with running(prefill, decode, router):
            wait_all_healthy(router)
            relay.stall()
            resumer = threading.Thread(target=lambda: (wait_until(timed_out, 20), relay.resume()))
            resumer.start()
            body = {"model": "tiny", "prompt": LONG + "stalled", "max_tokens": 4}
            answer = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
            resumer.join(30)
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-tandem-route"] == "disaggregated"
            assert answer.json()["usage"]["completion_tokens"] == 4
            text = metrics(router.url)
            assert metric(text, "tandem_router_upstream_errors_total", kind="timeout") == 1
            assert metric(text, "tandem_router_retries_total", pool="decode", reason="connect") == 1
            assert metric(text, "tandem_router_retries_total", reason="kv_transfer") == 0
    finally:
        relay.stop()
