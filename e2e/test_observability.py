"""The operator's /metrics on the real control plane, read through the shipped dashboards and rules.

The chart's operator (Helm-installed, serving `--metrics-port` as the chart renders it) reconciles
and autoscales a ServingCluster; a real Prometheus scrapes the engine pods (the documented
relabelling, through HTTP service discovery) and the operator pod (honor_labels, as the chart's
operator ServiceMonitor), with the chart's rule file loaded. Every dashboard query and every
alert input that reads an operator series must then return data for this ServingCluster.
"""

from __future__ import annotations

import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client as k8s

from e2e.conftest import OPERATOR_METRICS_PORT
from e2e.harness.kube import eventually
from e2e.harness.podrunner import PodRunner, RunningPod

# The observability and autoscaling suites' helpers, and the process helpers they build on.
TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "autoscaling"), str(TESTS / "observability")]
from pod_discovery import pod_discovery  # noqa: E402
from prometheus_process import PrometheusProcess, engine_pods_job, static_job  # noqa: E402
from shipped import RULES, panel_queries  # noqa: E402

from tandem.observability.rules import AlertRule, rule_groups  # noqa: E402
from tandem.observability.snapshot import interpolate  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

NAME = NAMESPACE = "observe"
GROUP, VERSION, PLURAL = "tandem.dev", "v1alpha1", "servingclusters"
OPERATOR_SERIES = "tandem_operator_"


def manifest(prometheus_url: str) -> dict[str, Any]:
    pool_resources = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"nvidia.com/gpu": 1}}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ServingCluster",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {
            "model": {"name": "tiny", "servedName": "tiny-observe"},
            "prefill": {"replicas": 1, "resources": pool_resources},
            "decode": {"replicas": 1, "resources": pool_resources},
            "router": {"replicas": 1},
            "monitoring": {"enabled": False},
            "autoscaling": {
                "enabled": True,
                "prometheusURL": prometheus_url,
                "intervalSeconds": 2,
                "metricsWindowSeconds": 8,
                "prefill": {"min": 1, "max": 2, "targetTTFTSeconds": 2.5},
                "decode": {"min": 1, "max": 2, "targetITLSeconds": 0.06},
            },
        },
    }


@pytest.fixture(scope="module")
def prometheus(api: k8s.ApiClient, tandem_release: RunningPod) -> Iterator[PrometheusProcess]:
    operator = static_job("tandem-operator", [(f"{tandem_release.ip}:{OPERATOR_METRICS_PORT}", {})])
    with pod_discovery(api, [NAMESPACE]) as discovery_url:
        jobs = [engine_pods_job(discovery_url), operator | {"honor_labels": True}]
        server = PrometheusProcess(jobs, rule_files=[RULES]).start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture(scope="module")
def observed(api: k8s.ApiClient, prometheus: PrometheusProcess) -> Iterator[None]:
    core, custom = k8s.CoreV1Api(api), k8s.CustomObjectsApi(api)
    core.create_namespace({"metadata": {"name": NAMESPACE}})
    custom.create_namespaced_custom_object(
        GROUP, VERSION, NAMESPACE, PLURAL, manifest(prometheus.url)
    )
    try:
        yield
    finally:
        custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, NAME)
        core.delete_namespace(NAMESPACE)


def query(prometheus: PrometheusProcess, expr: str) -> list[dict[str, Any]]:
    body = httpx.get(f"{prometheus.url}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert body["status"] == "success", f"{expr} -> {body}"
    return list(body["data"]["result"])


def test_operator_series_feed_every_panel_and_alert_that_reads_them(
    observed: None, prometheus: PrometheusProcess, tandem_release: RunningPod, pod_runner: PodRunner
) -> None:
    cluster = f'namespace="{NAMESPACE}",tandem_dev_cluster="{NAME}"'

    def evaluated_with_metrics() -> bool:
        """Both pools evaluated with their engines' metrics, both pools ready."""
        available = query(
            prometheus, f"tandem_operator_autoscaler_metrics_available{{{cluster}}} == 1"
        )
        ready = query(prometheus, f'tandem_operator_pool_replicas{{{cluster},state="ready"}} >= 1')
        return len(available) == 2 and len(ready) == 3

    eventually(evaluated_with_metrics, timeout_s=150, interval_s=2,
               what="the autoscaler evaluating both pools with metrics, every pool ready")  # fmt: skip

    # A few requests, so each pool's latency quantile (and the signal the autoscaler reads) exists.
    [router] = pod_runner.by_role("router", NAMESPACE)
    for _ in range(8):
        response = httpx.post(
            f"http://{router.ip}:8000/v1/completions",
            json={"model": "tiny-observe", "prompt": "word " * 300, "max_tokens": 8},
            timeout=30,
        )
        assert response.status_code == 200, response.text
    latency = f'tandem_operator_autoscaler_signal{{{cluster},signal="latency_seconds"}}'
    eventually(lambda: len(query(prometheus, latency)) == 2, timeout_s=30, interval_s=1,
               what="both pools' latency signals")  # fmt: skip

    variables = {"namespace": NAMESPACE, "cluster": NAME, "__rate_interval": "1m"}
    empty = [
        f"{panel}: {panel.expr}"
        for panel in panel_queries()
        if OPERATOR_SERIES in panel.expr
        and not query(prometheus, interpolate(panel.expr, variables))
    ]
    alerts = [r for g in rule_groups() for r in g.rules if isinstance(r, AlertRule)]
    empty += [
        f"{alert.alert}: {probe}"
        for alert in alerts
        for probe in alert.probes
        if OPERATOR_SERIES in probe and not query(prometheus, probe)
    ]
    assert not empty, "operator-fed queries without data:\n" + "\n".join(empty)
    # This cluster's alerts only: other suites' clusters share the control plane (one of them
    # makes Prometheus unreachable on purpose).
    firing = query(
        prometheus,
        f'ALERTS{{{cluster},alertname=~"TandemAutoscalerMetricsUnavailable|TandemPoolNoHealthyEngine"}}',
    )
    assert firing == [], firing

    url = f"http://{tandem_release.ip}:{OPERATOR_METRICS_PORT}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    applied = [
        line
        for line in text.splitlines()
        if line.startswith("tandem_operator_reconciles_total{")
        and f'tandem_dev_cluster="{NAME}"' in line
        and 'result="applied"' in line
    ]
    assert applied, text
    assert float(applied[0].rsplit(" ", 1)[1]) >= 1
