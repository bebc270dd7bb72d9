"""The P/D flow over real HTTP: emulator prefill and decode engines with a real NIXL KV handoff."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from router_harness import (
    DEBUG,
    LONG,
    SHORT,
    Engine,
    Router,
    completion,
    metric,
    metrics,
    running,
)

from tandem.common.ports import free_port

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def pd() -> Iterator[tuple[Engine, Engine]]:
    prefill, decode = Engine("prefill"), Engine("decode")
    with running(prefill, decode):
        yield prefill, decode


def test_pd_relay_reaches_both_engines(pd: tuple[Engine, Engine]) -> None:
    prefill, decode = pd
    router = Router(
        ["--prefill", prefill.url, "--decode", decode.url, "--min-uncached-tokens", "32"]
    )
    with running(router):
        p0, d0 = metrics(prefill.url), metrics(decode.url)
        body = {
            "model": "tiny",
            "prompt": LONG,
            "max_tokens": 6,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream(
            "POST", router.url + "/v1/completions", json=body, headers=DEBUG, timeout=60
        ) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            assert response.headers["x-tandem-route"] == "disaggregated"
            assert response.headers["x-tandem-prefill-engine"] == prefill.url
            assert float(response.headers["x-tandem-prefill-ms"]) > 0
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert '"usage"' in events[-2]
        p1, d1 = metrics(prefill.url), metrics(decode.url)
        # the prefill pod produced exactly one token and the decode pod pulled the prompt's KV
        assert (
            metric(p1, "vllm:generation_tokens_total") - metric(p0, "vllm:generation_tokens_total")
            == 1
        )
        assert (
            metric(d1, "vllm:generation_tokens_total") - metric(d0, "vllm:generation_tokens_total")
            == 6
        )
        pulled = metric(d1, "vllm:prompt_tokens_cached_by_source_total", source="p2p") - metric(
            d0, "vllm:prompt_tokens_cached_by_source_total", source="p2p"
        )
        assert pulled > 0
        chat = httpx.post(
            router.url + "/v1/chat/completions",
            timeout=60,
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": LONG}],
                "max_tokens": 3,
            },
        )
        assert chat.status_code == 200
        assert chat.json()["object"] == "chat.completion"
        short = completion(router, SHORT)  # below the threshold: the decode pod prefills locally
        assert short.headers["x-tandem-route"] == "local"
        text = metrics(router.url)
        assert metric(text, "tandem_router_decisions_total", decision="disaggregated") == 2
        assert metric(text, "tandem_router_decisions_total", decision="local") == 1
        assert metric(text, "tandem_router_prefill_seconds_count") == 2
        assert metric(text, "tandem_router_kv_handoff_seconds_count") == 2


def test_client_kv_transfer_params_are_stripped(pd: tuple[Engine, Engine]) -> None:
    prefill, decode = pd
    router = Router(["--prefill", prefill.url, "--decode", decode.url, "--disaggregation", "never"])
    hostile = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2]],
        "remote_engine_id": "attacker",
        "remote_request_id": "x",
        "remote_host": "127.0.0.2",
        "remote_port": free_port(),
    }
    with running(router):
        before = metrics(decode.url)
        started = time.monotonic()
        response = completion(router, LONG, kv_transfer_params=hostile)
        assert response.status_code == 200
        assert time.monotonic() - started < 5  # a relayed bad handshake would take 15-30 s
        after = metrics(decode.url)
        assert metric(after, "vllm:nixl_num_failed_transfers_total") == metric(
            before, "vllm:nixl_num_failed_transfers_total"
        )
        assert metric(after, "vllm:prompt_tokens_cached_by_source_total", source="p2p") == metric(
            before, "vllm:prompt_tokens_cached_by_source_total", source="p2p"
        )
        assert metric(metrics(router.url), "tandem_router_stripped_kv_transfer_params_total") == 1


def test_prefill_retry_and_decode_local_fallback(pd: tuple[Engine, Engine]) -> None:
    prefill, decode = pd
    dead = f"http://127.0.0.1:{free_port()}"
    retrying = Router(
        [
            "--prefill",
            dead,
            "--prefill",
            prefill.url,
            "--decode",
            decode.url,
            "--disaggregation",
            "always",
            "--queue-weight",
            "0",
            "--kv-usage-weight",
            "0",
        ]
    )
    fallback = Router(["--prefill", dead, "--decode", decode.url, "--disaggregation", "always"])
    with running(retrying, fallback):
        for _ in range(3):
            response = completion(retrying, LONG)
            assert response.status_code == 200
            assert response.headers["x-tandem-route"] == "disaggregated"
        response = completion(fallback, LONG)
        assert response.status_code == 200
        assert response.headers["x-tandem-route"] == "local"
        assert (
            metric(metrics(fallback.url), "tandem_router_decisions_total", decision="fallback") == 1
        )
