"""Scale to zero and back: the pure rules (zero.py), the router demand read through a real
Prometheus scraping a real router that holds a request, and the KEDA / HPA renderings."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml
from prometheus_process import running_prometheus, static_job
from tandem_process import TandemProcess

from tandem.common.ports import free_port
from tandem.common.roles import LABEL_CLUSTER, LABEL_ROLE
from tandem.operator.api import AutoscalingSpec
from tandem.operator.autoscaling import handlers
from tandem.operator.autoscaling.external import external_autoscalers, wake_query
from tandem.operator.autoscaling.handlers import ZeroClock, evaluate
from tandem.operator.autoscaling.planner import PlannerMemory
from tandem.operator.autoscaling.planner_loop import PlannerState
from tandem.operator.autoscaling.prometheus import PrometheusClient
from tandem.operator.autoscaling.zero import (
    RouterDemand,
    ZeroMemory,
    ZeroPolicy,
    read_router_demand,
    zero_decision,
    zero_steps,
)
from tandem.operator.manifest import parse_manifest
from tandem.operator.router_render import router_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llama-8b-pd.yaml"
AUTO = ZeroPolicy(idle_s=60, mode="auto", decode_min=2, prefill_min=1)
QUIET = RouterDemand(routers=1)


def demand(**values: float) -> RouterDemand:
    return RouterDemand(routers=1, **values)  # type: ignore[arg-type]


def desired(steps: dict[str, Any]) -> dict[str, int]:
    return {pool: step.desired for pool, step in steps.items()}


# -- the rules ---------------------------------------------------------------------------------


def test_idle_window_sends_both_pools_to_zero_together() -> None:
    sizes = {"prefill": 3, "decode": 2}
    steps, memory = zero_steps(AUTO, demand(arrived=4), sizes, ZeroMemory(), now=0)
    assert steps == {}
    assert memory.last_active == 0
    steps, memory = zero_steps(AUTO, QUIET, sizes, memory, now=59)
    assert steps == {}  # idle for 59 s of 60
    steps, memory = zero_steps(AUTO, QUIET, sizes, memory, now=60)
    assert desired(steps) == {"prefill": 0, "decode": 0}
    assert "no request for 60s" in steps["decode"].message


def test_a_request_in_flight_or_held_keeps_the_cluster_awake() -> None:
    sizes = {"prefill": 1, "decode": 1}
    memory = ZeroMemory(last_active=0)
    for busy in (demand(in_flight=1), demand(held=1), demand(arrived=0.5)):
        steps, after = zero_steps(AUTO, busy, sizes, memory, now=1000)
        assert steps == {}
        assert after.last_active == 1000


def test_the_idle_clock_starts_at_the_first_evaluation_not_at_zero() -> None:
    # A restarted operator (or a router with no history) never sleeps a cluster at once.
    steps, memory = zero_steps(AUTO, QUIET, {"decode": 1}, ZeroMemory(), now=5000)
    assert steps == {}
    assert memory.last_active == 5000


def test_held_requests_wake_decode_first_and_prefill_stays_at_zero() -> None:
    asleep = {"prefill": 0, "decode": 0}
    steps, _ = zero_steps(AUTO, QUIET, asleep, ZeroMemory(last_active=0), now=500)
    assert desired(steps) == {"prefill": 0, "decode": 0}
    steps, memory = zero_steps(AUTO, demand(held=3), asleep, ZeroMemory(last_active=0), now=500)
    assert desired(steps) == {"decode": 2, "prefill": 0}
    assert memory.last_active == 500
    assert "3 request(s) held" in steps["decode"].message


def test_prefill_wakes_once_pd_would_pay() -> None:
    awake = {"prefill": 0, "decode": 2}
    steps, _ = zero_steps(AUTO, demand(arrived=5), awake, ZeroMemory(last_active=0), now=10)
    assert desired(steps) == {"prefill": 0}  # short prompts only: decode serves them well
    steps, _ = zero_steps(
        AUTO, demand(arrived=5, prefill_wanted=1), awake, ZeroMemory(last_active=0), now=10
    )
    assert desired(steps) == {"prefill": 1}


def test_mode_always_wakes_prefill_with_decode() -> None:
    always = AUTO.model_copy(update={"mode": "always"})
    steps, _ = zero_steps(
        always, demand(held=1), {"prefill": 0, "decode": 0}, ZeroMemory(last_active=0), now=1
    )
    assert desired(steps) == {"decode": 2, "prefill": 1}


def test_planner_mode_wakes_both_pools_together_whatever_the_disaggregation_mode() -> None:
    # The planner sizes both pools from one plan that needs both pools' metrics.
    for mode in ("auto", "never"):
        together = AUTO.model_copy(update={"mode": mode, "together": True})
        asleep = {"prefill": 0, "decode": 0}
        steps, _ = zero_steps(together, demand(held=1), asleep, ZeroMemory(last_active=0), now=1)
        assert desired(steps) == {"decode": 2, "prefill": 1}
        assert "the planner sizes both pools" in steps["prefill"].message
        # While both pools run, the zero rules leave their size to the planner.
        awake = {"prefill": 1, "decode": 2}
        steps, _ = zero_steps(together, demand(arrived=3), awake, ZeroMemory(last_active=0), now=1)
        assert steps == {}
        steps, _ = zero_steps(together, QUIET, awake, ZeroMemory(last_active=0), now=60)
        assert desired(steps) == {"prefill": 0, "decode": 0}


def test_without_router_metrics_nothing_wakes_and_nothing_sleeps() -> None:
    for missing in (None, RouterDemand(routers=0)):
        steps, _ = zero_steps(
            AUTO, missing, {"prefill": 0, "decode": 0}, ZeroMemory(last_active=0), now=10_000
        )
        assert desired(steps) == {"prefill": 0, "decode": 0}
        assert "no router metrics" in steps["decode"].message
        steps, _ = zero_steps(
            AUTO, missing, {"prefill": 2, "decode": 2}, ZeroMemory(last_active=0), now=10_000
        )
        assert steps == {}


def test_never_mode_has_no_prefill_pool_to_wake() -> None:
    never = AUTO.model_copy(update={"mode": "never"})
    steps, _ = zero_steps(never, demand(held=1), {"decode": 0}, ZeroMemory(last_active=0), now=1)
    assert desired(steps) == {"decode": 2}


def test_zero_decisions_read_as_the_autoscaler_status_words() -> None:
    steps, _ = zero_steps(
        AUTO, demand(held=1), {"prefill": 0, "decode": 0}, ZeroMemory(last_active=0), now=1
    )
    assert zero_decision(steps["decode"], 0).reason == "ScaledUp"
    assert zero_decision(steps["prefill"], 0).reason == "Asleep"
    steps, _ = zero_steps(AUTO, QUIET, {"decode": 3}, ZeroMemory(last_active=0), now=100)
    decision = zero_decision(steps["decode"], 3)
    assert decision.reason == "ScaledDown"
    assert decision.changed


# -- the router's demand through a real Prometheus ---------------------------------------------


class PoolsKube:
    """The autoscaler's view of the API server: one cluster's two pool Deployments (replicas all
    ready), the status it writes and the replicas it patches."""

    def __init__(self, cluster: str, sizes: dict[str, int]) -> None:
        self.cluster = cluster
        self.sizes = dict(sizes)
        self.status: dict[str, Any] = {}

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[Any]:
        assert (api_version, kind, selector) == (
            "apps/v1",
            "Deployment",
            f"{LABEL_CLUSTER}={self.cluster}",
        )
        return [
            {
                "metadata": {"name": f"{self.cluster}-{pool}", "labels": {LABEL_ROLE: pool}},
                "spec": {"replicas": size},
                "status": {"readyReplicas": size},
            }
            for pool, size in self.sizes.items()
        ]

    def patch_status(self, *args: Any) -> dict[str, Any]:
        self.status = args[-1]
        return {}

    def request(self, method: str, path: str, params: Any, body: Any, content_type: str) -> None:
        assert method == "PATCH"
        pool = path.rsplit("/", 1)[1].removeprefix(f"{self.cluster}-")
        self.sizes[pool] = body["spec"]["replicas"]


def planner_wakes_both_pools(prometheus_url: str, manifest: dict[str, Any]) -> None:
    """One evaluation of the built-in autoscaler in planner mode with both pools at 0 and a
    request held: both pools wake together, and the planner's memory starts afresh."""
    manifest["spec"]["autoscaling"].update(
        {
            "enabled": True,
            "mode": "planner",
            "prometheusURL": prometheus_url,
            "scaleToZero": {"enabled": True},
        }
    )
    autoscaling = AutoscalingSpec.model_validate(manifest["spec"]["autoscaling"])
    kube = PoolsKube(manifest["metadata"]["name"], {"prefill": 0, "decode": 0})
    planner = PlannerState(memory=PlannerMemory(prefill_slowdown=2.0))
    decisions = asyncio.run(
        evaluate(
            kube,  # type: ignore[arg-type]
            manifest,
            autoscaling,
            {},
            {},
            logging.getLogger("test"),
            planner,
            ZeroClock(),
        )
    )
    assert {pool: d.reason for pool, d in decisions.items()} == {
        "prefill": "ScaledUp",
        "decode": "ScaledUp",
    }
    assert kube.sizes == {"prefill": 1, "decode": 1}
    assert kube.status["autoscaling"]["prefill"]["reason"].startswith("prefill: 0 -> 1")
    assert planner.memory == PlannerMemory()


def cluster(**zero: Any) -> Any:
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["spec"]["autoscaling"].update(
        {"enabled": True, "scaleToZero": {"enabled": True, **zero}}
    )
    return parse_manifest(manifest)


@pytest.mark.timeout(120)
def test_held_request_reaches_the_autoscaler_through_prometheus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real router holds a request for an engine that is not there; Prometheus scrapes it with
    the labels the ServiceMonitor gives router pods; the demand reads held = 1, the zero rules
    wake decode, and the KEDA wake query (evaluated by the same Prometheus) is positive; the
    built-in autoscaler in planner mode wakes both pools on it. Once the
    request times out (503) the demand reads it as arrived."""
    sc = cluster(idleSeconds=30)
    port = free_port()
    engine = f"http://127.0.0.1:{free_port()}"
    args = ["router", "--host", "127.0.0.1", "--port", str(port), "--model", "tiny"]
    router = TandemProcess(
        "router", [*args, "--decode", engine, "--engine-wait-seconds", "8"], port
    )
    labels = {"namespace": sc.namespace, "tandem_dev_cluster": sc.name, "tandem_dev_role": "router"}
    try:
        router.wait_ready("/v1/models")
        job = static_job("tandem-routers", [(f"127.0.0.1:{router.port}", labels)])
        with (
            running_prometheus([job]) as prometheus,
            concurrent.futures.ThreadPoolExecutor(1) as pool,
        ):
            prometheus.wait_for_targets(1)
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
            answer = pool.submit(httpx.post, router.url + "/v1/completions", json=body, timeout=60)

            async def read() -> tuple[RouterDemand | None, float | None]:
                async with PrometheusClient(prometheus.url) as client:
                    found = await read_router_demand(client, sc.namespace, sc.name, 20)
                    # The prefill wake query parses (a refused query raises) and reads the
                    # counter exposed at 0 (no value before the range holds two samples).
                    assert await client.value(wake_query(sc, "prefill")) in (None, 0.0)
                    return found, await client.value(wake_query(sc, "decode"))

            deadline = time.monotonic() + 30
            held, wake = None, None
            while time.monotonic() < deadline:
                held, wake = asyncio.run(read())
                if held is not None and held.held >= 1:
                    break
                time.sleep(0.3)
            assert held is not None, held
            assert held.routers == 1, held
            assert held.held == 1, held
            assert wake is not None
            assert wake >= 1
            steps, _ = zero_steps(
                AUTO, held, {"prefill": 0, "decode": 0}, ZeroMemory(last_active=0), now=100
            )
            assert desired(steps) == {"decode": 2, "prefill": 0}
            posted: list[str] = []
            monkeypatch.setattr(handlers, "_post", lambda *event: posted.append(event[2]))
            planner_wakes_both_pools(prometheus.url, yaml.safe_load(EXAMPLE.read_text()))
            assert posted == ["ScaledUp", "ScaledUp"]

            response = answer.result(timeout=30)
            assert response.status_code == 503
            assert response.headers["retry-after"] == "4"
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                after, _ = asyncio.run(read())
                if after is not None and after.held == 0 and after.arrived > 0:
                    break
                time.sleep(0.3)
            assert after is not None, after
            assert after.held == 0, after
            assert after.arrived > 0, after
    finally:
        router.stop()


# -- renderings --------------------------------------------------------------------------------


def test_router_holds_for_the_wake_timeout() -> None:
    sc = cluster(wakeTimeoutSeconds=240)
    assert router_config(sc).admission.engine_wait_s == 240
    manifest = yaml.safe_load(EXAMPLE.read_text())
    assert router_config(parse_manifest(manifest)).admission.engine_wait_s == 0


def test_scaled_objects_go_to_zero_after_the_idle_window_and_wake_on_demand() -> None:
    sc = cluster(idleSeconds=600)
    prefill, decode = external_autoscalers(sc, "keda")
    for scaled in (prefill, decode):
        assert scaled["spec"]["minReplicaCount"] == 0
        assert scaled["spec"]["cooldownPeriod"] == 600
        wake = scaled["spec"]["triggers"][-1]
        assert wake["metricType"] == "AverageValue"
        assert wake["metadata"]["activationThreshold"] == "0"
    decode_wake = decode["spec"]["triggers"][-1]["metadata"]["query"]
    assert "tandem_router_engine_wait_requests" in decode_wake
    assert 'tandem_dev_role="router"' in decode_wake
    assert (
        "tandem_router_prefill_wanted_total" in prefill["spec"]["triggers"][-1]["metadata"]["query"]
    )


def test_hpas_scale_to_zero_on_the_routers_demand() -> None:
    sc = cluster()
    for hpa in external_autoscalers(sc, "hpa"):
        kubernetes_validate.validate(hpa, "1.34", strict=True)
        assert hpa["spec"]["minReplicas"] == 0
        demand_metric = hpa["spec"]["metrics"][-1]["external"]["metric"]
        assert demand_metric == {
            "name": "tandem_router_demand",
            "selector": {"matchLabels": {"tandem_dev_cluster": sc.name}},
        }
