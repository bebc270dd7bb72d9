"""PromQL builders and the async client against a real Prometheus scraping real /metrics endpoints.

The endpoints here are prometheus_client servers that expose vLLM's metric names with values the
test sets, so every aggregate can be checked exactly; test_autoscaling_emulator.py does the same
with real emulator processes under load.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from kubernetes import client as k8s
from pod_discovery import pod_targets, serve_targets
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_process import PrometheusProcess, engine_pods_job, running_prometheus

from tandem.common.ports import free_port
from tandem.operator.autoscaling.decision import ScalingMemory, decide
from tandem.operator.autoscaling.policy import PoolPolicy
from tandem.operator.autoscaling.prometheus import PrometheusClient, PrometheusUnavailable
from tandem.operator.autoscaling.queries import PoolSelector, pool_queries, read_pool_signals

pytestmark = pytest.mark.timeout(60)

TTFT_BUCKETS = (0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2)


@dataclass
class FakeEngine:
    """A real /metrics endpoint carrying the vLLM series the autoscaler reads."""

    address: str
    ttft: Any
    itl: Any
    waiting: Any
    running: Any
    kv_usage: Any
    success: Any
    server: Any


def start_engine(engine: str) -> FakeEngine:
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    values = {"model_name": "tiny", "engine": engine}
    port = free_port()
    metrics = {
        "ttft": Histogram(
            "vllm:time_to_first_token_seconds",
            "ttft",
            labels,
            registry=registry,
            buckets=TTFT_BUCKETS,
        ),
        "itl": Histogram(
            "vllm:inter_token_latency_seconds",
            "itl",
            labels,
            registry=registry,
            buckets=ITL_BUCKETS,
        ),
        "waiting": Gauge("vllm:num_requests_waiting", "waiting", labels, registry=registry),
        "running": Gauge("vllm:num_requests_running", "running", labels, registry=registry),
        "kv_usage": Gauge("vllm:kv_cache_usage_perc", "kv", labels, registry=registry),
        "success": Counter(
            "vllm:request_success", "ok", [*labels, "finished_reason"], registry=registry
        ),
    }
    bound = {k: m.labels(**values) if k != "success" else m for k, m in metrics.items()}
    bound["success"] = metrics["success"].labels(**values, finished_reason="stop")
    for name in ("waiting", "running", "kv_usage"):
        bound[name].set(0)
    server, _ = start_http_server(port, addr="127.0.0.1", registry=registry)
    return FakeEngine(address=f"127.0.0.1:{port}", server=server, **bound)


def pod(name: str, address: str, labels: dict[str, str], port_name: str = "http") -> k8s.V1Pod:
    """A Running pod whose `port_name` port is the given real endpoint."""
    ip, port = address.split(":")
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(name=name, namespace="serving", labels=labels),
        spec=k8s.V1PodSpec(
            node_name="kwok-node",
            containers=[
                k8s.V1Container(
                    name="vllm",
                    ports=[
                        k8s.V1ContainerPort(name=port_name, container_port=int(port)),
                        k8s.V1ContainerPort(name="kv-events", container_port=5557),
                    ],
                )
            ],
        ),
        status=k8s.V1PodStatus(pod_ip=ip, phase="Running"),
    )


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[PrometheusProcess, dict[str, list[FakeEngine]]]]:
    """Four engines discovered as pods and relabelled exactly as docs/autoscaling.md says, plus a
    router pod that the relabelling must drop."""
    engines = {
        pool: [start_engine(f"{pool}-{i}") for i in range(2)] for pool in ("prefill", "decode")
    }
    router = start_engine("router")
    pods = [
        pod(
            f"llama-{pool}-{i}",
            engine.address,
            {"tandem.dev/cluster": "llama", "tandem.dev/role": pool},
        )
        for pool, pool_engines in engines.items()
        for i, engine in enumerate(pool_engines)
    ]
    pods.append(
        pod(
            "llama-router-0",
            router.address,
            {"tandem.dev/cluster": "llama", "tandem.dev/role": "router"},
        )
    )
    try:
        with (
            serve_targets(lambda: pod_targets(pods)) as discovery,
            running_prometheus([engine_pods_job(discovery)]) as prometheus,
        ):
            prometheus.wait_for_targets(4)
            yield prometheus, engines
    finally:
        for engine in [router, *(e for pool_engines in engines.values() for e in pool_engines)]:
            engine.server.shutdown()
            engine.server.server_close()


def test_relabelling_keeps_engine_http_ports_with_pool_labels(
    cluster: tuple[PrometheusProcess, dict[str, list[FakeEngine]]],
) -> None:
    prometheus, engines = cluster
    targets = prometheus.targets()
    assert sorted(t["labels"]["pod"] for t in targets) == [
        "llama-decode-0",
        "llama-decode-1",
        "llama-prefill-0",
        "llama-prefill-1",
    ]
    labels = next(t["labels"] for t in targets if t["labels"]["pod"] == "llama-prefill-1")
    assert labels["namespace"] == "serving"
    assert (labels["tandem_dev_cluster"], labels["tandem_dev_role"]) == ("llama", "prefill")
    assert labels["instance"] == engines["prefill"][1].address


POLICY = PoolPolicy(
    pool="prefill",
    max_replicas=8,
    target_latency_s=0.8,
    target_waiting_per_replica=2,
    metrics_window_s=10,
)
DECODE = PoolPolicy(
    pool="decode", max_replicas=8, target_latency_s=0.05, max_kv_usage=0.85, metrics_window_s=10
)


def test_matchers_select_namespace_cluster_and_role_and_escape_values() -> None:
    selector = PoolSelector(namespace="serving", cluster='we"ird', pool="decode")
    assert (
        selector.matchers()
        == '{namespace="serving",tandem_dev_cluster="we\\"ird",tandem_dev_role="decode"}'
    )
    queries = pool_queries(PoolSelector(namespace="ns", cluster="c", pool="prefill"), POLICY)
    assert queries["latency_s"] == (
        "histogram_quantile(0.9, sum by (le) (rate({"
        '__name__=~"vllm[:_]time_to_first_token_seconds_bucket",'
        'namespace="ns",tandem_dev_cluster="c",tandem_dev_role="prefill"}[10s])))'
    )


async def test_idle_pools_read_as_idle(
    cluster: tuple[PrometheusProcess, dict[str, list[FakeEngine]]],
) -> None:
    prometheus, _ = cluster
    async with PrometheusClient(prometheus.url) as client:
        signals = await read_pool_signals(
            client, PoolSelector(namespace="serving", cluster="llama", pool="prefill"), POLICY
        )
        other = await read_pool_signals(
            client, PoolSelector(namespace="serving", cluster="other", pool="prefill"), POLICY
        )
    assert signals.engines == 2
    assert signals.latency_s is None
    assert other.engines == 0


async def test_loaded_pools_give_the_expected_aggregates_and_decisions(
    cluster: tuple[PrometheusProcess, dict[str, list[FakeEngine]]],
) -> None:
    prometheus, engines = cluster
    for engine in engines["prefill"]:
        for _ in range(50):
            engine.ttft.observe(1.5)  # bucket (1.0, 2.5]: p90 interpolates to 2.35
            engine.success.inc()
        engine.waiting.set(6)
        engine.running.set(2)
    for engine, kv in zip(engines["decode"], (0.9, 1.0), strict=True):
        for _ in range(200):
            engine.itl.observe(0.04)  # bucket (0.025, 0.05]
        engine.kv_usage.set(kv)
        engine.running.set(16)
    selector_p = PoolSelector(namespace="serving", cluster="llama", pool="prefill")
    selector_d = PoolSelector(namespace="serving", cluster="llama", pool="decode")
    async with PrometheusClient(prometheus.url) as client:
        deadline = time.monotonic() + 15
        while True:
            prefill = await read_pool_signals(client, selector_p, POLICY)
            decode = await read_pool_signals(client, selector_d, DECODE)
            if (
                prefill.latency_s
                and decode.latency_s
                and prefill.waiting == 12
                and decode.kv_usage == 0.95
            ) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
    assert prefill.engines == 2
    assert prefill.latency_s == pytest.approx(2.35, abs=0.01)
    assert (prefill.waiting, prefill.running) == (12, 4)
    assert prefill.request_rate is not None
    assert prefill.request_rate > 0
    assert decode.latency_s == pytest.approx(0.0475, abs=0.001)
    assert decode.kv_usage == pytest.approx(0.95)

    decision, _ = decide(POLICY, prefill, current=2, ready=2, state=ScalingMemory(), now=0)
    # TTFT 2.35/0.8 -> ceil(2 x 2.94) = 6; waiting 6/replica vs 2 -> 6; step cap max(4, 6) = 6.
    assert (decision.reason, decision.desired) == ("ScaledUp", 6)
    decision, _ = decide(DECODE, decode, current=2, ready=2, state=ScalingMemory(), now=0)
    # ITL 0.0475 is within 10 % of 0.05 (holds 2); KV 0.95/0.85 -> ceil(2.24) = 3.
    assert decision.signals == {"latency": 2, "kvUsage": 3}
    assert decision.desired == 3


async def test_unreachable_or_refusing_prometheus_raises_unavailable() -> None:
    async with PrometheusClient(f"http://127.0.0.1:{free_port()}", timeout_s=1) as client:
        with pytest.raises(PrometheusUnavailable, match="unreachable"):
            await client.query("up")


async def test_bad_query_is_reported_with_prometheus_error(
    cluster: tuple[PrometheusProcess, dict[str, list[FakeEngine]]],
) -> None:
    prometheus, _ = cluster
    async with PrometheusClient(prometheus.url) as client:
        with pytest.raises(PrometheusUnavailable, match="bad_data"):
            await client.query("sum(")
        assert await client.value("scalar(vector(3))") == 3.0
        assert await client.value("vector(0) / 0 ") is None


def test_http_server_answers() -> None:
    # The client's error path for non-JSON answers: point it at a plain /metrics endpoint.
    engine = start_engine("x")
    try:

        async def run() -> None:
            async with PrometheusClient(f"http://{engine.address}") as client:
                with pytest.raises(PrometheusUnavailable, match="without JSON"):
                    await client.query("up")

        asyncio.run(run())
        assert httpx.get(f"http://{engine.address}/metrics").status_code == 200
    finally:
        engine.server.shutdown()
        engine.server.server_close()


async def _first_failure(
    client: PrometheusClient, selector: PoolSelector, timeout_s: float = 15
) -> PrometheusUnavailable:
    """The first PrometheusUnavailable of repeated reads (the bad value shows after a scrape)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            await read_pool_signals(client, selector, DECODE)
        except PrometheusUnavailable as exc:
            return exc
        await asyncio.sleep(0.5)
    raise AssertionError("the bad value never made the reading unavailable")


async def test_non_finite_and_huge_values_are_unavailable_not_numbers(
    cluster: tuple[PrometheusProcess, dict[str, list[FakeEngine]]],
) -> None:
    prometheus, engines = cluster
    async with PrometheusClient(prometheus.url) as client:
        for promql in ("vector(1) / 0", "-vector(1) / 0", "vector(1e15)"):
            with pytest.raises(PrometheusUnavailable, match="malformed result"):
                await client.value(promql)
        assert await client.value("vector(0.5)") == 0.5
        selector = PoolSelector(namespace="serving", cluster="llama", pool="decode")
        engines["decode"][0].kv_usage.set(float("inf"))  # a broken exporter
        try:
            assert "not a finite number" in str(await _first_failure(client, selector))
        finally:
            engines["decode"][0].kv_usage.set(0.5)
        deadline = time.monotonic() + 15
        while True:  # the next scrape replaces the infinity
            try:
                await read_pool_signals(client, selector, DECODE)
                break
            except PrometheusUnavailable:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.5)
        engines["decode"][1].kv_usage.set(7)  # usage is a fraction: 7 is corrupt, not "full"
        try:
            assert "implausible values" in str(await _first_failure(client, selector))
        finally:
            engines["decode"][1].kv_usage.set(0.5)


@pytest.mark.parametrize(
    "answer",
    [
        {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": [1, "abc"]}]}},
        {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": [1]}]}},
        {"status": "success", "data": {"resultType": "vector", "result": [{"value": [1, "2"]}]}},
        {"status": "success", "data": {"resultType": "scalar", "result": [1, None]}},
        {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": [1, True]}]}},
        {"status": "success"},
    ],
)  # fmt: skip
async def test_malformed_answers_are_unavailable(answer: dict[str, Any]) -> None:
    """A stand-in for a broken Prometheus or a proxy in front of it (a real HTTP server on
    127.0.0.1 answering one fixed body): no real Prometheus sends these shapes."""
    import http.server
    import json
    import threading

    body = json.dumps(answer).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        async with PrometheusClient(url) as client:
            with pytest.raises(PrometheusUnavailable):
                await client.value("up")
    finally:
        server.shutdown()
        server.server_close()
