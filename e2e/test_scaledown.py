"""Cache-aware scale-down on the real control plane: the real ReplicaSet controller removes the pod
the operator ranked cheapest from the routers' removal costs, read through a real Prometheus.

A pool Deployment of 3 pods (KWOK runs them); Prometheus scrapes a stand-in for the router's
/metrics that serves `tandem_router_engine_removal_cost` for those pods (the router computing the
gauge from its index over real sockets is tests/router/test_router_removal_cost.py; here the
chain from the metric onwards is under test); the operator's `rank_pool_for_scale_down` annotates
the pods, then the Deployment shrinks as the autoscaler shrinks it (`scale_deployment`), and the
kube-controller-manager picks the victim. Twice: first the oldest pod is ranked cheapest, the one
the controller's own order (youngest first) would keep longest; then another. Bounded: every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import http.server
import logging
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client as k8s

from e2e.harness.cluster import ControlPlane
from e2e.harness.kube import eventually
from tandem.common.ports import free_port
from tandem.operator.autoscaling.deletion_cost import (
    DELETION_COST,
    REMOVAL_COST,
    rank_pool_for_scale_down,
)
from tandem.operator.autoscaling.handlers import scale_deployment
from tandem.operator.autoscaling.queries import PoolSelector
from tandem.operator.kube import Kube

# The autoscaling suite's Prometheus helper.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "autoscaling"))
from prometheus_process import running_prometheus, static_job

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

NAMESPACE = "scaledown"
CLUSTER = "sd"
DEPLOYMENT = f"{CLUSTER}-decode"
OLDER_S = 20.0
LABELS = {"tandem.dev/cluster": CLUSTER, "tandem.dev/role": "decode"}


class RouterMetricsStandIn:
    """Serves the router's removal-cost gauge for whatever costs the test sets, as two router
    processes would (the `process` label): the operator must average them per pod."""

    def __init__(self) -> None:
        self.costs: dict[str, float] = {}
        self.port = free_port()
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                lines = ["# TYPE tandem_router_engine_removal_cost gauge"]
                for pod, cost in sorted(stand_in.costs.items()):
                    for process, share in (("0", 0.5), ("1", 1.5)):
                        labels = (
                            f'pool="decode",endpoint="http://{pod}:8000",'
                            f'engine_pod="{pod}",process="{process}"'
                        )
                        lines.append(
                            f"tandem_router_engine_removal_cost{{{labels}}} {cost * share}"
                        )
                body = ("\n".join(lines) + "\n").encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> RouterMetricsStandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def pool(control_plane: ControlPlane, api: k8s.ApiClient) -> Iterator[k8s.AppsV1Api]:
    core, apps = k8s.CoreV1Api(api), k8s.AppsV1Api(api)
    core.create_namespace({"metadata": {"name": NAMESPACE}})
    apps.create_namespaced_deployment(
        NAMESPACE,
        {
            "metadata": {"name": DEPLOYMENT, "labels": LABELS},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": LABELS},
                "template": {
                    "metadata": {"labels": LABELS},
                    "spec": {
                        "containers": [
                            {"name": "engine", "image": "busybox", "command": ["sleep", "inf"]}
                        ],
                        "terminationGracePeriodSeconds": 0,
                    },
                },
            },
        },
    )
    try:
        yield apps
    finally:
        core.delete_namespace(NAMESPACE)


def ready_pods(core: k8s.CoreV1Api) -> list[str]:
    pods = core.list_namespaced_pod(NAMESPACE, label_selector="tandem.dev/cluster=sd").items
    return sorted(
        p.metadata.name
        for p in pods
        if p.metadata.deletion_timestamp is None
        and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
    )


def pool_at(core: k8s.CoreV1Api, replicas: int) -> list[str] | None:
    names = ready_pods(core)
    return names if len(names) == replicas else None


def test_the_controller_manager_removes_the_pod_the_operator_ranked_cheapest(
    pool: k8s.AppsV1Api, api: k8s.ApiClient
) -> None:
    core = k8s.CoreV1Api(api)
    kube = Kube(api.configuration)
    selector = PoolSelector(namespace=NAMESPACE, cluster=CLUSTER, pool="decode")
    log = logging.getLogger("e2e.scaledown")
    started = time.monotonic()
    [oldest] = eventually(lambda: pool_at(core, 1), timeout_s=60, what="the first pool pod")
    router_labels = {"namespace": NAMESPACE, "tandem_dev_cluster": CLUSTER}
    with (
        RouterMetricsStandIn() as router,
        running_prometheus(
            [static_job("routers", [(f"127.0.0.1:{router.port}", router_labels)])]
        ) as prometheus,
    ):
        # The controller compares ready times in log2 buckets (LogarithmicScaleDown) and breaks
        # ties by uid: the first pod must be ready over twice as long as the others when round
        # one shrinks the pool (within OLDER_S of their start), so that only the ranking can
        # make the controller remove it.
        time.sleep(max(0.0, OLDER_S - (time.monotonic() - started)))
        scale_deployment(kube, NAMESPACE, DEPLOYMENT, 3)
        eventually(lambda: pool_at(core, 3), timeout_s=60, what="3 ready pool pods")
        # Round one ranks cheapest the pod the controller's own order removes last (the oldest);
        # round two another pod, so the choice follows the ranking each time.
        for replicas, cheapest in ((2, oldest), (1, None)):
            remaining = ready_pods(core)
            cheapest = cheapest or remaining[-1]
            router.costs = {
                pod: 5.0 if pod == cheapest else 50.0 + i for i, pod in enumerate(remaining)
            }

            def read() -> dict[str, int] | None:
                ranks = asyncio.run(rank_pool_for_scale_down(kube, prometheus.url, selector, log))
                # Prometheus answers with its last scrape: wait for the one of these costs.
                fresh = ranks and set(ranks) == set(remaining) and ranks[cheapest] == 1  # noqa: B023
                return ranks if fresh else None

            ranks = eventually(read, timeout_s=30, what="this round's costs through Prometheus")
            assert all(rank > 1 for pod, rank in ranks.items() if pod != cheapest)
            annotated = core.read_namespaced_pod(cheapest, NAMESPACE).metadata.annotations
            assert annotated[DELETION_COST] == "1"
            assert float(annotated[REMOVAL_COST]) == 5.0  # the mean over the two processes

            scale_deployment(kube, NAMESPACE, DEPLOYMENT, replicas)
            left = eventually(
                lambda: pool_at(core, replicas),  # noqa: B023 - called before the next round
                timeout_s=60,
                what=f"the pool at {replicas}",
            )
            assert cheapest not in left
            assert set(left) == set(remaining) - {cheapest}
