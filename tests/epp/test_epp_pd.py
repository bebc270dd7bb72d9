"""P/D behind the endpoint picker: Envoy sends each request to the relay beside the decode engine
the picker chose (`tandem relay`), which prefills on the prefill engine the picker named and
decodes on its engine with the prefill's kv_transfer_params (a real NIXL handoff between
emulated engines)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from epp.epp_harness import Envoy, PickerRouter, Relay
from router.router_harness import (
    DEBUG,
    LONG,
    SHORT,
    Engine,
    Router,
    metric,
    metrics,
    running,
    wait_until,
)

pytestmark = pytest.mark.timeout(240)

SEQUENCE = [f"family {name}: {LONG} question {i}" for i in range(2) for name in ("a", "b", "c")]


class PdPool:
    def __init__(self, extra: list[str] | None = None) -> None:
        self.prefill = Engine("prefill", extra=extra)
        self.decode = [Engine("decode", extra=extra), Engine("decode", extra=extra)]
        self.relays = [Relay(d.url) for d in self.decode]
        self.args = ["--prefill", self.prefill.url, "--min-uncached-tokens", "32"]
        self.args += [arg for d in self.decode for arg in ("--decode", d.url)]

    @property
    def relay_of(self) -> dict[str, str]:
        return {d.url: r.url for d, r in zip(self.decode, self.relays, strict=True)}

    def counters(self) -> list[float]:
        """Generated tokens of the prefill engine, then finished requests of each decode engine."""
        texts = [metrics(e.url) for e in (self.prefill, *self.decode)]
        return [
            metric(texts[0], "vllm:generation_tokens_total"),
            *(metric(t, "vllm:request_success_total") for t in texts[1:]),
        ]


@pytest.fixture(scope="module")
def pool() -> Iterator[PdPool]:
    pd = PdPool()
    with running(pd.prefill, *pd.decode, *pd.relays):
        yield pd


def test_pd_through_envoy_and_the_relay(pool: PdPool) -> None:
    router = PickerRouter(pool.args, pool.relay_of)
    with running(router):
        envoy = Envoy(router.epp_port)
        try:
            envoy.wait_ready()
            pulled_before = sum(
                metric(metrics(d.url), "vllm:prompt_tokens_cached_by_source_total", source="p2p")
                for d in pool.decode
            )
            prefilled_before = pool.counters()[0]
            body = {"model": "tiny", "prompt": LONG, "max_tokens": 6, "stream": True}
            with httpx.stream(
                "POST", envoy.url + "/v1/completions", json=body, headers=DEBUG, timeout=60
            ) as response:
                assert response.status_code == 200
                assert response.headers["x-tandem-route"] == "disaggregated"
                assert response.headers["x-tandem-prefill-engine"] == pool.prefill.url
                assert response.headers["x-tandem-decode-engine"] in pool.relay_of
                events = [line for line in response.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            assert len(events) == 7
            # one token on the prefill engine, the prompt's KV pulled by the decode engine
            assert pool.counters()[0] - prefilled_before == 1
            pulled = sum(
                metric(metrics(d.url), "vllm:prompt_tokens_cached_by_source_total", source="p2p")
                for d in pool.decode
            )
            assert pulled > pulled_before
            # a short prompt stays local: the relay passes it to its engine
            short = httpx.post(
                envoy.url + "/v1/completions",
                json={"model": "tiny", "prompt": SHORT, "max_tokens": 3},
                # a client naming a prefill engine itself: the picker removes the header
                headers={**DEBUG, "x-tandem-prefill-endpoint": "127.0.0.2:1"},
                timeout=60,
            )
            assert short.status_code == 200
            assert short.headers["x-tandem-route"] == "local"
            engines = httpx.get(router.url + "/engines", timeout=5).json()
            assert [e["in_flight"] for e in engines] == [0, 0, 0]
        finally:
            envoy.stop()


def test_pd_placement_equals_the_routers(pool: PdPool) -> None:
    """The same requests to `tandem router` and through Envoy to the picker: the same route
    (prefill engine used or not) and the same decode engine, request by request."""
    plain = Router(pool.args)
    picker = PickerRouter(pool.args, pool.relay_of)
    with running(plain, picker):
        envoy = Envoy(picker.epp_port)
        try:
            envoy.wait_ready()
            by_router: list[list[float]] = []
            by_picker: list[list[float]] = []
            for prompt in [*SEQUENCE, SHORT]:
                for url, record in ((plain.url, by_router), (envoy.url, by_picker)):
                    before = pool.counters()
                    response = httpx.post(
                        url + "/v1/completions",
                        json={"model": "tiny", "prompt": prompt, "max_tokens": 2},
                        timeout=60,
                    )
                    assert response.status_code == 200, response.text
                    after = pool.counters()
                    record.append([a - b for a, b in zip(after, before, strict=True)])
        finally:
            envoy.stop()
    assert by_picker == by_router
    # new prompts went P/D; repeats (cached on their decode engine) and the short one local
    assert [step[0] for step in by_router[:3]] == [1.0, 1.0, 1.0]
    assert by_router[-1][0] == 0.0
    assert {tuple(step[1:]) for step in by_router} == {(1.0, 0.0), (0.0, 1.0)}  # both decoders


def test_pd_with_a_lora_adapter_through_the_relay() -> None:
    """An adapter request placed P/D by the picker: the relay accepts the adapter's name (read
    from its engine's /v1/models) and both pools serve it."""
    lora = ["--enable-lora", "--max-loras", "1", "--lora-modules", "a1=/adapters/a1"]
    pd = PdPool(lora)
    router = PickerRouter(pd.args, pd.relay_of)
    with running(pd.prefill, *pd.decode, *pd.relays, router):
        envoy = Envoy(router.epp_port)
        try:
            envoy.wait_ready()

            def served(url: str) -> bool:
                body = {"model": "a1", "prompt": "ready?", "max_tokens": 1}
                return httpx.post(url + "/v1/completions", json=body, timeout=30).is_success

            def engines() -> list[dict[str, Any]]:
                answer: list[dict[str, Any]] = httpx.get(router.url + "/engines").json()
                return answer

            def picker_knows_a1() -> bool:
                """Every engine healthy with `a1` read from its /v1/models: a prefill engine
                not known to serve it yet is no P/D candidate for it."""
                return all(e["healthy"] and "a1" in (e["adapters"] or ()) for e in engines())

            # the picker and each relay have read their engines' adapters
            wait_until(
                lambda: picker_knows_a1() and all(served(r.url) for r in (router, *pd.relays)),
                timeout=20,
            )
            prefilled_before = pd.counters()[0]
            answer = httpx.post(
                envoy.url + "/v1/completions",
                json={"model": "a1", "prompt": f"an adapter's turn: {LONG}", "max_tokens": 4},
                headers=DEBUG,
                timeout=60,
            )
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == "a1"
            assert answer.headers["x-tandem-route"] == "disaggregated", engines()
            assert pd.counters()[0] - prefilled_before == 1
            unknown = httpx.post(
                envoy.url + "/v1/completions",
                json={"model": "a9", "prompt": "hello", "max_tokens": 2},
                timeout=60,
            )
            assert unknown.status_code == 404
        finally:
            envoy.stop()
