"""A real `tandem up` scraped by a real Prometheus with the chart's rules, under `tandem bench` load.

Prometheus (Debian's server) scrapes the router and the engines with the target labels the
chart's PodMonitor/ServiceMonitor give pods on Kubernetes (namespace, pod, tandem_dev_cluster,
tandem_dev_role) and loads the chart's rule file. The operator's series come from this process's
own `tandem.operator.metrics` server, fed by the autoscaler's real queries and decision reading
this Prometheus, and by the operator's status aggregation of the pools' Deployments (shaped as the
API server returns them; ready replicas are the engines the router finds healthy). What cannot
run here is the Kubernetes side itself: the kopf daemon loop and the API server.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_process import PrometheusProcess, running_prometheus, static_job
from shipped import ROOT, RULES

from tandem.common.ports import free_port
from tandem.common.roles import ROLES, Role
from tandem.observability import names
from tandem.operator import metrics as operator_metrics
from tandem.operator.api import ServingCluster
from tandem.operator.autoscaling.decision import ScalingMemory, decide
from tandem.operator.autoscaling.policy import pool_policies
from tandem.operator.autoscaling.prometheus import PrometheusClient
from tandem.operator.autoscaling.queries import PoolSelector, read_pool_signals
from tandem.operator.manifest import load_manifest
from tandem.operator.status import aggregate_status, component_roles

EXAMPLE = ROOT / "examples" / "llama-8b-pd.yaml"
NAMESPACE, CLUSTER = "default", "llama-8b"


@dataclass
class Live:
    prometheus: PrometheusProcess
    bench: dict[str, Any]  # the bench record (JSON)
    pods: dict[str, str]  # pod name -> engine URL
    exposition: str  # every component's /metrics text, concatenated
    started: float  # unix time the load began


@dataclass
class OperatorFeed:
    """The operator's series for this cluster, refreshed as its autoscaler and status would be.

    The pools' sizes are the engines `tandem up` runs (the router's /engines); ready ones are
    those passing the router's health checks.
    """

    prometheus_url: str
    router_url: str
    states: dict[Role, ScalingMemory] = field(default_factory=dict)

    def __call__(self) -> None:
        engines = httpx.get(f"{self.router_url}/engines", timeout=5).json()
        sizes = {pool: sum(pool in e["roles"] for e in engines) for pool in ROLES}
        ready = {pool: sum(e["healthy"] and pool in e["roles"] for e in engines) for pool in ROLES}
        sc = load_manifest(str(EXAMPLE))
        for pool in ROLES:
            getattr(sc.spec, pool).replicas = sizes[pool]
        asyncio.run(self.autoscale(sc, sizes, ready))
        deployments = {
            role: deployment(1, 1) if role == "router" else deployment(sizes[role], ready[role])
            for role in component_roles(sc)
        }
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        status = aggregate_status(sc, deployments, now, None, 1)
        operator_metrics.record_pools(NAMESPACE, CLUSTER, status)

    async def autoscale(
        self, sc: ServingCluster, sizes: dict[Role, int], ready: dict[Role, int]
    ) -> None:
        policies = pool_policies(sc.spec.autoscaling)
        async with PrometheusClient(self.prometheus_url) as client:
            for pool in ROLES:
                selector = PoolSelector(namespace=NAMESPACE, cluster=CLUSTER, pool=pool)
                signals = await read_pool_signals(client, selector, policies[pool])
                decision, self.states[pool] = decide(
                    policies[pool],
                    signals,
                    sizes[pool],
                    ready[pool],
                    self.states.get(pool, ScalingMemory()),
                    time.monotonic(),
                )
                operator_metrics.record_decision(
                    NAMESPACE, CLUSTER, policies[pool], decision, signals, ready[pool]
                )


def forget_every_cluster() -> None:
    """This process's operator series start empty, as a fresh operator's do: tests that ran
    before in the same process (a pytest-xdist worker runs many modules) recorded clusters of
    their own, and an alert on one of them (a pool desired with none ready) would read as this
    cluster's."""
    recorded = {
        (sample.labels[names.NAMESPACE], sample.labels[names.CLUSTER])
        for family in operator_metrics.REGISTRY.collect()
        for sample in family.samples
        if names.CLUSTER in sample.labels
    }
    for namespace, cluster in recorded:
        operator_metrics.forget_cluster(namespace, cluster)


def pod_labels(role: str, pod: str) -> dict[str, str]:
    """The target labels the chart's monitors give a pod's series on Kubernetes."""
    return {names.NAMESPACE: NAMESPACE, names.CLUSTER: CLUSTER, names.ROLE: role, names.POD: pod}


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


def wait_until_serving(
    up: subprocess.Popen[bytes], router: str, log: Path, timeout_s: float
) -> None:
    """Until the router lists its engines and every one passes its health checks."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if up.poll() is not None:
            raise AssertionError(f"tandem up exited:\n{log.read_text()}")
        with contextlib.suppress(httpx.HTTPError):
            engines = httpx.get(f"{router}/engines", timeout=1).json()
            if engines and all(engine["healthy"] for engine in engines):
                return
        time.sleep(0.3)
    raise AssertionError(f"tandem up not serving after {timeout_s}s:\n{log.read_text()}")


def run_bench(
    command: list[str], log: Path, feed: OperatorFeed, feed_every_s: float, timeout_s: float
) -> None:
    """Run `tandem bench` to the end, refreshing the operator's series every `feed_every_s`."""
    with log.open("w") as out:
        bench = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        next_feed = time.monotonic() + feed_every_s
        while bench.poll() is None and time.monotonic() < deadline:
            if time.monotonic() >= next_feed:
                feed()
                next_feed += feed_every_s
            time.sleep(0.2)
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 0, log.read_text()


@contextlib.contextmanager
def live_cluster(
    workdir: Path,
    up_args: Sequence[str],
    bench_args: Sequence[str],
    feed_every_s: float = 15.0,
    bench_timeout_s: float = 150.0,
) -> Iterator[Live]:
    port = free_port()
    router = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "tandem.cli", "up", str(EXAMPLE), *up_args,
               "--port", str(port), "--run-dir", str(workdir / "run")]  # fmt: skip
    up_log = workdir / "up.log"
    with up_log.open("wb") as out:
        up = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    server = None
    try:
        wait_until_serving(up, router, up_log, 90)
        config = yaml.safe_load((workdir / "run" / "router.yaml").read_text())
        pods = {
            f"{CLUSTER}-{role}-{i}": entry["url"]
            for role in ("prefill", "decode")
            for i, entry in enumerate(config["static"][role])
        }
        operator_port = free_port()
        forget_every_cluster()
        server = operator_metrics.serve(operator_port, "127.0.0.1")
        jobs = [
            static_job(
                "router", [(f"127.0.0.1:{port}", pod_labels("router", f"{CLUSTER}-router"))]
            ),
            static_job(
                "engines",
                [
                    (url.removeprefix("http://"), pod_labels(pod.split("-")[-2], pod))
                    for pod, url in pods.items()
                ],
            ),
            # honor_labels, as the chart's operator ServiceMonitor: the series name their cluster.
            static_job("operator", [(f"127.0.0.1:{operator_port}", {})]) | {"honor_labels": True},
        ]
        metrics = [f"--metrics=router={router}/metrics"] + [
            f"--metrics={pod}={url}/metrics" for pod, url in pods.items()
        ]

        def bench(out: str, *extra: str) -> list[str]:
            return [sys.executable, "-m", "tandem.cli", "bench", router, *bench_args, *extra,
                    *metrics, "--out", str(workdir / out), "--no-plots", "--quiet"]  # fmt: skip

        # A few requests before Prometheus starts: every series the run touches exists by its
        # first scrape, so no counter is born inside the rate windows (rate() cannot count a
        # counter's first sample, which would bias the ratios of a run this short).
        warmup = subprocess.run(bench("warmup", "--num-requests", "6"), capture_output=True,
                                text=True, timeout=60, check=False)  # fmt: skip
        assert warmup.returncode == 0, warmup.stdout + warmup.stderr
        # Scrapes every 0.5 s: rate() extrapolates each target's series to the window's edges
        # from its own scrape times, a bias of up to an interval over a run of well under a minute.
        with running_prometheus(jobs, "500ms", rule_files=[RULES]) as prometheus:
            prometheus.wait_for_targets(len(pods) + 2)
            feed = OperatorFeed(prometheus.url, router)
            started = time.time()
            run_bench(bench("bench"), workdir / "bench.log", feed, feed_every_s, bench_timeout_s)
            feed()
            time.sleep(2)  # a few scrapes and rule evaluations after the last request
            urls = [router, *pods.values(), f"http://127.0.0.1:{operator_port}"]
            exposition = "\n".join(httpx.get(f"{u}/metrics", timeout=5).text for u in urls)
            record = json.loads((workdir / "bench" / "A.json").read_text())
            yield Live(prometheus, record, pods, exposition, started)
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
