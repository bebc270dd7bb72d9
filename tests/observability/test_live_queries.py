"""Every shipped panel and rule evaluated by a real Prometheus scraping a real `tandem up` under `tandem bench`.

`tandem up` runs the P/D example (one prefill and one decode emulator, the router); Prometheus
(Debian's server) scrapes them with the labels the chart's PodMonitor/ServiceMonitor give pods on
Kubernetes (namespace, pod, tandem_dev_cluster, tandem_dev_role) and loads the chart's rule file.
`tandem bench` drives load through the router. Then every dashboard query (variables filled in as
Grafana would) and every recording rule must return data, every alert expression must evaluate,
and every alert's probes (the series that feed it) must return data.

The operator's series come from this process's own `tandem.operator.metrics` server, fed by the
autoscaler's real query and decision code reading this Prometheus and by the operator's status
aggregation of Deployments shaped as the API server returns them. What cannot run here is the
Kubernetes side itself: the kopf daemon loop and the API server (the e2e suite runs those).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import yaml
from prometheus_process import PrometheusProcess, running_prometheus, static_job
from shipped import ROOT, RULES, panel_queries, rules, substitute
from tandem_process import free_port

from tandem.observability import names
from tandem.observability.rules import AlertRule, rule_groups
from tandem.operator import metrics as operator_metrics
from tandem.operator.api import load_manifest
from tandem.operator.autoscaling.decision import PoolState, decide
from tandem.operator.autoscaling.policy import POOLS, pool_policies
from tandem.operator.autoscaling.prometheus import PrometheusClient
from tandem.operator.autoscaling.queries import PoolSelector, read_pool_signals
from tandem.operator.status import aggregate_status, component_roles

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

EXAMPLE = ROOT / "examples" / "llama-8b-pd.yaml"
NAMESPACE, CLUSTER = "default", "llama-8b"
RATE_INTERVAL = "1m"  # what Grafana's $__rate_interval becomes at a 15s scrape interval
# A deliberately slow accelerator (the autoscaling suite's profile, run twice as fast): 5
# requests/s of ~256-token prompts exceed what one prefill engine does, so requests queue at the
# engines and E2E is long beside the client's own overhead.
PROFILE = ROOT / "tests" / "autoscaling" / "small-gpu-profile.yaml"
SPEEDUP = "2"
BENCH = ["--preset", "quick", "--num-requests", "40", "--qps", "5", "--warmup", "0"]


@dataclass
class Live:
    prometheus: PrometheusProcess
    bench: dict[str, Any]
    pods: dict[str, str]  # pod name -> engine URL
    exposition: str  # every component's /metrics text, concatenated


def pod_labels(role: str, pod: str) -> dict[str, str]:
    """The target labels the chart's monitors give a pod's series on Kubernetes."""
    return {
        names.NAMESPACE: NAMESPACE,
        names.CLUSTER: CLUSTER,
        names.ROLE: role,
        names.POD: pod,
    }


def wait_for_line(process: subprocess.Popen[str], needle: str, timeout_s: float) -> None:
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        if needle in line:
            return
    raise AssertionError(f"no {needle!r} from tandem up:\n{''.join(lines)}")


def deployment(replicas: int, ready: int) -> dict[str, Any]:
    """A Deployment's spec and status as the API server reports a rolled-out one."""
    return {
        "metadata": {"generation": 1},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": 1,
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": replicas,
            "availableReplicas": ready,
            "conditions": [{"type": "Available", "status": "True"}],
        },
    }


async def feed_autoscaler(prometheus_url: str) -> None:
    """The autoscaler's series, from its real queries and decision against this Prometheus."""
    sc = load_manifest(str(EXAMPLE))
    policies = pool_policies(sc.spec.autoscaling)
    async with PrometheusClient(prometheus_url) as client:
        for pool in POOLS:
            selector = PoolSelector(namespace=NAMESPACE, cluster=CLUSTER, pool=pool)
            signals = await read_pool_signals(client, selector, policies[pool])
            assert signals.engines == 1, signals
            decision, _ = decide(policies[pool], signals, 1, 1, PoolState(), time.monotonic())
            operator_metrics.record_decision(
                NAMESPACE, CLUSTER, policies[pool], decision, signals, 1
            )


def feed_pool_status(router_url: str) -> None:
    """The pool sizes, from the operator's status aggregation of the pools' Deployments (ready
    replicas: the engines the router finds healthy)."""
    sc = load_manifest(str(EXAMPLE))
    engines = httpx.get(f"{router_url}/engines", timeout=5).json()
    deployments = {}
    for role in component_roles(sc):
        ready = 1 if role == "router" else sum(e["healthy"] and role in e["roles"] for e in engines)
        deployments[role] = deployment(1, ready)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    status = aggregate_status(sc, deployments, now, None, 1)
    operator_metrics.record_pools(NAMESPACE, CLUSTER, status)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("live")
    port = free_port()
    router = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "tandem.cli", "up", str(EXAMPLE), "--speedup", SPEEDUP,
               "--timing-profile", str(PROFILE),
               "--prefill", "1", "--decode", "1", "--port", str(port), "--run-dir", str(tmp / "run")]  # fmt: skip
    env = os.environ | {"COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    up = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    server = None
    try:
        wait_for_line(up, "ready", 90)
        config = yaml.safe_load((tmp / "run" / "router.yaml").read_text())
        pods = {
            f"{CLUSTER}-{role}-{i}": entry["url"]
            for role in ("prefill", "decode")
            for i, entry in enumerate(config["static"][role])
        }
        role_of = {pod: pod.split("-")[-2] for pod in pods}
        operator_port = free_port()
        server = operator_metrics.serve(operator_port, "127.0.0.1")
        jobs = [
            static_job(
                "router", [(f"127.0.0.1:{port}", pod_labels("router", f"{CLUSTER}-router"))]
            ),
            static_job(
                "engines",
                [
                    (url.removeprefix("http://"), pod_labels(role_of[pod], pod))
                    for pod, url in pods.items()
                ],
            ),
            # honor_labels, as the chart's operator ServiceMonitor: the series name their cluster.
            static_job("operator", [(f"127.0.0.1:{operator_port}", {})]) | {"honor_labels": True},
        ]
        with running_prometheus(jobs, rule_files=[RULES]) as prometheus:
            prometheus.wait_for_targets(len(jobs) + len(pods) - 1)
            metrics = [f"--metrics=router={router}/metrics"] + [
                f"--metrics={pod}={url}/metrics" for pod, url in pods.items()
            ]
            bench = subprocess.run(
                [sys.executable, "-m", "tandem.cli", "bench", router, *BENCH, *metrics,
                 "--out", str(tmp / "bench"), "--no-plots", "--quiet"],
                capture_output=True, text=True, timeout=150, env=env, check=False,
            )  # fmt: skip
            assert bench.returncode == 0, bench.stdout + bench.stderr
            asyncio.run(feed_autoscaler(prometheus.url))
            feed_pool_status(router)
            time.sleep(3)  # two scrapes and two rule evaluations after the last request
            exposition = "\n".join(
                httpx.get(url, timeout=5).text
                for url in [
                    f"{router}/metrics",
                    *(f"{u}/metrics" for u in pods.values()),
                    f"http://127.0.0.1:{operator_port}/metrics",
                ]
            )
            record = json.loads((tmp / "bench" / "A.json").read_text())
            yield Live(prometheus, record, pods, exposition)
    finally:
        if server is not None:
            server.shutdown()
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(timeout=30)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()


def query(live: Live, expr: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{live.prometheus.url}/api/v1/query", params={"query": expr}, timeout=10)
    body = response.json()
    assert response.status_code == 200, f"{expr}\n-> {body}"
    assert body["status"] == "success", f"{expr}\n-> {body}"
    return list(body["data"]["result"])


def variables(pod: str | None = None) -> dict[str, str]:
    values = {"namespace": NAMESPACE, "cluster": CLUSTER, "__rate_interval": RATE_INTERVAL}
    return values | ({"pod": pod} if pod else {})


def test_every_panel_query_returns_data(live: Live) -> None:
    empty = []
    checked = 0
    for panel in panel_queries():
        for pod in live.pods if panel.repeat == "pod" else [None]:
            expr = substitute(panel.expr, variables(pod))
            assert "$" not in expr, f"{panel}: unsubstituted variable in {expr}"
            checked += 1
            if not query(live, expr):
                empty.append(f"{panel} ({pod or 'all'}): {expr}")
    assert checked >= 40
    assert not empty, "panels without data:\n" + "\n".join(empty)


def test_dashboard_variables_find_the_cluster(live: Live) -> None:
    """The variables' label_values() queries, as Grafana runs them (series API)."""

    def label_values(match: str, label: str) -> set[str]:
        response = httpx.get(
            f"{live.prometheus.url}/api/v1/series", params={"match[]": match}, timeout=10
        )
        return {series.get(label) for series in response.json()["data"]}

    assert NAMESPACE in label_values(names.ROUTER_REQUESTS, names.NAMESPACE)
    assert CLUSTER in label_values(
        f'{names.ROUTER_REQUESTS}{{namespace="{NAMESPACE}"}}', names.CLUSTER
    )
    selector = f'{{namespace="{NAMESPACE}",tandem_dev_cluster="{CLUSTER}"}}'
    assert label_values(names.ENGINE_RUNNING + selector, names.POD) == set(live.pods)


def test_every_recording_rule_returns_data(live: Live) -> None:
    empty = []
    for rule in rules():
        if "record" not in rule:
            continue
        if not query(live, rule["expr"]):
            empty.append(f"{rule['record']} {rule.get('labels', {})}")
        stored = (
            rule["record"]
            + "{"
            + ",".join(f'{k}="{v}"' for k, v in rule.get("labels", {}).items())
            + "}"
        )
        if not query(live, stored):
            empty.append(f"{stored} (not stored by the rule evaluation)")
    assert not empty, "recording rules without data:\n" + "\n".join(empty)


def test_every_alert_evaluates_and_its_probes_return_data(live: Live) -> None:
    alerts = [
        rule for group in rule_groups() for rule in group.rules if isinstance(rule, AlertRule)
    ]
    assert {a.alert for a in alerts} >= {
        "TandemTTFTSLOBurn", "TandemITLSLOBurn", "TandemQueueingShareHigh",
        "TandemKVHandoffFailures", "TandemRouter5xxRatioHigh", "TandemPoolNoHealthyEngine",
        "TandemPoolAtMaxReplicasBreaching", "TandemPrefixIndexStale",
        "TandemAutoscalerMetricsUnavailable",
    }  # fmt: skip
    empty = []
    for alert in alerts:
        query(live, alert.expr)  # evaluates (quiet alerts return nothing)
        empty += [f"{alert.alert}: {probe}" for probe in alert.probes if not query(live, probe)]
    assert not empty, "alert inputs without data:\n" + "\n".join(empty)
    # An overloaded but healthy cluster: latency and queueing alerts may be pending, none of the
    # alerts that say something is broken.
    body = httpx.get(f"{live.prometheus.url}/api/v1/alerts", timeout=10).json()
    active = {a["labels"]["alertname"] for a in body["data"]["alerts"]}
    print(f"active alerts: {sorted(active)}")
    assert active <= {"TandemTTFTSLOBurn", "TandemITLSLOBurn", "TandemQueueingShareHigh"}, active


def test_every_metric_name_is_served(live: Live) -> None:
    """The names the dashboards and rules query are declared by the router, engines and operator."""
    declared = {
        line.split()[2] for line in live.exposition.splitlines() if line.startswith("# TYPE ")
    }
    wanted = {
        value
        for key, value in vars(names).items()
        if key.isupper()
        and isinstance(value, str)
        and value not in {names.NAMESPACE, names.CLUSTER, names.ROLE, names.POD, names.POOL}
    }
    assert wanted - declared == set()


def test_queueing_share_panel_agrees_with_the_bench_report(live: Live) -> None:
    bench_share = live.bench["queue_share"]
    panel = next(p for p in panel_queries() if p.panel == "Queueing share of E2E")
    result = query(live, substitute(panel.expr, variables()))
    prometheus_share = float(result[0]["value"][1])
    print(f"queueing share: bench {bench_share:.4f}, panel {prometheus_share:.4f}, "
          f"relative difference {abs(prometheus_share - bench_share) / bench_share:.1%}")  # fmt: skip
    assert bench_share > 0.05, "the load should make requests queue"
    assert abs(prometheus_share - bench_share) <= 0.10 * bench_share
