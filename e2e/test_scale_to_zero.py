"""Scale to zero and back on the real control plane with a real Prometheus.

The operator (installed by Helm, with the chart's RBAC) runs the built-in autoscaler with
`scaleToZero`; Prometheus scrapes the engine pods and the router pod (the router's admin port, its
pod labels copied as the rendered ServiceMonitor does). An idle cluster goes to zero engines
after idleSeconds while the router stays up; a request arriving then is held by the router, the
autoscaler reads the held-request gauge and wakes decode, the new decode pod's engine answers
the held request; long prompts then wake prefill (P/D pays). Bounded: every phase has a deadline.
"""

from __future__ import annotations

import concurrent.futures
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client as k8s

from e2e.harness.kube import eventually
from e2e.harness.podrunner import PodRunner, RunningPod

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "autoscaling"))
from pod_discovery import pod_discovery
from prometheus_process import ENGINE_POD_RELABELING, PrometheusProcess, engine_pods_job

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

NAME = NAMESPACE = "zero"
MODEL = "tiny-zero"
GROUP, VERSION, PLURAL = "tandem.dev", "v1alpha1", "servingclusters"
IDLE_S = 12
LONG = " ".join(["word"] * 400)  # past minUncachedTokens (256): P/D pays for it

# The router pods' admin port (/metrics), with the labels the ServiceMonitor's podTargetLabels add.
ROUTER_POD_RELABELING: list[dict[str, Any]] = [
    {
        "source_labels": ["__meta_kubernetes_pod_label_tandem_dev_role"],
        "regex": "router",
        "action": "keep",
    },
    {
        "source_labels": ["__meta_kubernetes_pod_container_port_name"],
        "regex": "admin",
        "action": "keep",
    },
    *ENGINE_POD_RELABELING[2:],
]


def manifest(prometheus_url: str) -> dict[str, Any]:
    pool_resources = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"nvidia.com/gpu": 1}}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ServingCluster",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {
            "model": {"name": "tiny", "servedName": MODEL},
            "prefill": {"replicas": 1, "resources": pool_resources},
            "decode": {"replicas": 1, "resources": pool_resources},
            "router": {
                "replicas": 1,
                "disaggregation": {"mode": "auto", "minUncachedTokens": 256},
            },
            "monitoring": {"enabled": False},
            "autoscaling": {
                "enabled": True,
                "prometheusURL": prometheus_url,
                "intervalSeconds": 2,
                "metricsWindowSeconds": 8,
                "scaleDownStabilizationSeconds": 30,
                "prefill": {"min": 1, "max": 2},
                "decode": {"min": 1, "max": 2},
                "scaleToZero": {
                    "enabled": True,
                    "idleSeconds": IDLE_S,
                    "wakeTimeoutSeconds": 240,
                },
            },
        },
    }


@pytest.fixture(scope="module")
def prometheus(api: k8s.ApiClient) -> Iterator[PrometheusProcess]:
    with pod_discovery(api, [NAMESPACE]) as discovery_url:
        routers = {
            "job_name": "tandem-routers",
            "http_sd_configs": [{"url": discovery_url, "refresh_interval": "1s"}],
            "relabel_configs": ROUTER_POD_RELABELING,
        }
        server = PrometheusProcess([engine_pods_job(discovery_url), routers]).start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture(scope="module")
def zero_cluster(
    tandem_release: RunningPod, prometheus: PrometheusProcess, api: k8s.ApiClient
) -> Iterator[dict[str, Any]]:
    core = k8s.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": NAMESPACE}})
    custom = k8s.CustomObjectsApi(api)
    body = manifest(prometheus.url)
    custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, body)
    try:
        yield body
    finally:
        custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, NAME)
        core.delete_namespace(NAMESPACE)


class Cluster:
    """The test cluster as the tests watch it: its processes, its autoscaling status, requests."""

    def __init__(self, api: k8s.ApiClient, pod_runner: PodRunner) -> None:
        self.custom = k8s.CustomObjectsApi(api)
        self.pod_runner = pod_runner

    def running(self, role: str) -> list[RunningPod]:
        return [p for p in self.pod_runner.by_role(role, NAMESPACE) if p.child.alive()]

    def scaling(self) -> dict[str, Any]:
        body = self.custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, NAME)
        return dict((body.get("status") or {}).get("autoscaling") or {})

    def details(self) -> str:
        return f"status.autoscaling: {self.scaling()}\n{self.pod_runner.report()}"

    def url(self) -> str:
        [router] = self.running("router")
        return f"http://{router.ip}:8000"

    def complete(self, prompt: str) -> httpx.Response:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
        return httpx.post(self.url() + "/v1/completions", json=body, timeout=300)

    def asleep(self) -> dict[str, Any]:
        """Waits for both pools at zero and their processes gone; the last status."""
        asleep = eventually(
            lambda: (s := self.scaling()).get("decode", {}).get("replicas") == 0
            and s.get("prefill", {}).get("replicas") == 0
            and s,
            timeout_s=IDLE_S + 90, interval_s=1, what="both pools at zero", details=self.details,
        )  # fmt: skip
        eventually(lambda: not self.running("prefill") and not self.running("decode"),
                   timeout_s=60, what="the engine processes gone", details=self.details)  # fmt: skip
        return dict(asleep)


def test_idle_cluster_goes_to_zero_and_a_held_request_wakes_it(
    zero_cluster: dict[str, Any], api: k8s.ApiClient, pod_runner: PodRunner
) -> None:
    core = k8s.CoreV1Api(api)
    cluster = Cluster(api, pod_runner)
    running, scaling, details = cluster.running, cluster.scaling, cluster.details

    eventually(lambda: len(running("prefill")) == 1 and len(running("decode")) == 1 and running("router"),
               timeout_s=120, what="one prefill, one decode and a router process", details=details)  # fmt: skip
    [router] = running("router")
    url = cluster.url()
    complete = cluster.complete

    def answers() -> bool:
        try:
            return complete("hello").status_code == 200
        except httpx.HTTPError:  # the router process is still starting
            return False

    eventually(answers, timeout_s=90, what="a first answer", details=details)

    # Idle: both pools to zero together; the router stays up and ready.
    asleep = cluster.asleep()
    assert "no request for" in asleep["decode"]["reason"]
    assert httpx.get(url + "/health", timeout=5).status_code == 200
    assert running("router") == [router]

    # A request now is held; decode wakes first and serves it; prefill stays at zero.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        answer = pool.submit(complete, "hello again")
        woken = eventually(lambda: scaling().get("decode", {}).get("replicas") == 1 and scaling(),
                           timeout_s=60, interval_s=0.5, what="decode woken", details=details)  # fmt: skip
        assert "held by the router" in woken["decode"]["reason"]
        assert woken["prefill"]["replicas"] == 0
        response = answer.result(timeout=300)
        cold_s = time.monotonic() - started
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"]
    print(f"scale-from-zero: answered {cold_s:.1f}s after the request was sent")

    # Long prompts: served by decode for want of prefill, which then wakes.
    assert complete(LONG).status_code == 200
    eventually(lambda: scaling().get("prefill", {}).get("replicas") == 1, timeout_s=60, interval_s=0.5,
               what="prefill woken once P/D pays", details=details)  # fmt: skip
    eventually(
        lambda: len(running("prefill")) == 1,
        timeout_s=90,
        what="a prefill process",
        details=details,
    )

    def goes_pd() -> bool:
        prompt = f"{time.monotonic()} {LONG}"
        response = complete(prompt)
        return (
            response.status_code == 200
            and response.headers.get("x-tandem-route") == "disaggregated"
        )

    eventually(
        goes_pd, timeout_s=90, interval_s=1, what="a long prompt through P/D", details=details
    )
    reasons = {
        e.reason
        for e in core.list_namespaced_event(
            NAMESPACE, field_selector=f"involvedObject.name={NAME}"
        ).items
    }
    assert {"ScaledUp", "ScaledDown"} <= reasons, reasons


def test_in_planner_mode_both_pools_sleep_and_wake_together(
    zero_cluster: dict[str, Any], api: k8s.ApiClient, pod_runner: PodRunner
) -> None:
    """The same cluster switched to `mode: planner`: idle, both pools go to zero; a held request
    wakes both in one evaluation (the planner sizes both pools from one plan) and is answered."""
    cluster = Cluster(api, pod_runner)
    cluster.custom.patch_namespaced_custom_object(
        GROUP, VERSION, NAMESPACE, PLURAL, NAME, {"spec": {"autoscaling": {"mode": "planner"}}}
    )
    asleep = cluster.asleep()
    assert "no request for" in asleep["prefill"]["reason"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        answer = pool.submit(cluster.complete, "hello, planner")
        woken = eventually(
            lambda: (s := cluster.scaling()).get("decode", {}).get("replicas") == 1 and s,
            timeout_s=60, interval_s=0.5, what="decode woken", details=cluster.details,
        )  # fmt: skip
        assert woken["prefill"]["replicas"] == 1, woken
        assert "the planner sizes both pools" in woken["prefill"]["reason"]
        response = answer.result(timeout=300)
        cold_s = time.monotonic() - started
    assert response.status_code == 200, response.text
    print(f"scale-from-zero in planner mode: answered {cold_s:.1f}s after the request was sent")
    eventually(lambda: len(cluster.running("prefill")) == 1, timeout_s=90,
               what="a prefill process", details=cluster.details)  # fmt: skip
