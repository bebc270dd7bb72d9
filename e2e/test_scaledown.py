"""Cache-aware scale-down on the real control plane: the real ReplicaSet controller removes the pod
the operator ranked cheapest from the routers' removal costs, read through a real Prometheus.

A pool Deployment of engine pods (`vllm serve`, which the pod runner runs as the emulator and
marks Ready once it answers its readiness probe, as a kubelet would: KWOK leaves engine pods
unready, e2e/cluster/kwok.yaml); Prometheus scrapes a stand-in for the router's /metrics that
serves `tandem_router_engine_removal_cost` for those pods (the router computing the gauge from
its index over real sockets is tests/router/test_router_removal_cost.py; here the chain from the
metric onwards is under test); the operator's `rank_pool_for_scale_down` annotates the pods, then
the Deployment shrinks as the autoscaler shrinks it (`scale_deployment`), and the
kube-controller-manager picks the victim. Twice: first the oldest pod is ranked cheapest, the one
the controller's own order (youngest first) would keep longest; then another. Bounded: every
wait has a deadline.
"""

from __future__ import annotations

import asyncio
import datetime
import http.server
import logging
import math
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client as k8s

from e2e.harness.kube import eventually
from e2e.harness.podrunner import PodRunner
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

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

NAMESPACE = "scaledown"
CLUSTER = "sd"
DEPLOYMENT = f"{CLUSTER}-decode"
LABELS = {"tandem.dev/cluster": CLUSTER, "tandem.dev/role": "decode"}
# How long the first pod is Ready before the pool grows, so that it is still Ready over twice as
# long as the others when the pool first shrinks (see `assert_oldest_kept_by_default`).
OLDER_S = 30.0
# The controller's reaction time that precondition allows for, after the test has checked it.
REACTION_S = 5.0


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


ENGINE = {
    "name": "engine",
    "image": "vllm/vllm-openai:v0.32.0",
    "command": ["vllm", "serve"],
    "args": ["scaledown/model", "--served-model-name", "sd", "--port", "8000"],
    "readinessProbe": {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 1},
}


@pytest.fixture(scope="module")
def pool(api: k8s.ApiClient, pod_runner: PodRunner) -> Iterator[k8s.AppsV1Api]:
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
                    "spec": {"containers": [ENGINE], "terminationGracePeriodSeconds": 1},
                },
            },
        },
    )
    try:
        yield apps
    finally:
        core.delete_namespace(NAMESPACE)
        eventually(
            lambda: not pod_runner.by_role("decode", NAMESPACE),
            timeout_s=60,
            what="the pool's engine processes to stop",
            details=pod_runner.report,
        )


def pool_pods(core: k8s.CoreV1Api) -> list[k8s.V1Pod]:
    """The pool's pods that are not being deleted, by name."""
    pods = core.list_namespaced_pod(NAMESPACE, label_selector=f"tandem.dev/cluster={CLUSTER}")
    return sorted(
        (p for p in pods.items if p.metadata.deletion_timestamp is None),
        key=lambda p: p.metadata.name,
    )


def ready_since(pod: k8s.V1Pod) -> datetime.datetime | None:
    """When the pod turned Ready (its Ready condition's transition), None while it is not."""
    for condition in pod.status.conditions or []:
        if condition.type == "Ready" and condition.status == "True":
            return condition.last_transition_time  # type: ignore[no-any-return]
    return None


def pool_at(core: k8s.CoreV1Api, replicas: int, *, ready: bool) -> list[str] | None:
    """The names of the pool's pods (only Ready ones if `ready`) once there are `replicas`."""
    names = [p.metadata.name for p in pool_pods(core) if not ready or ready_since(p)]
    return names if len(names) == replicas else None


def assert_oldest_kept_by_default(core: k8s.CoreV1Api, oldest: str) -> None:
    """Precondition of round one: the controller's own order would remove another pod.

    Among Ready pods of equal deletion cost the ReplicaSet controller removes first the one Ready
    for the shortest time, comparing floor(log2(time Ready)) (LogarithmicScaleDown) and breaking
    ties by UID. `oldest` is kept past both others if it has been Ready at least twice as long
    as each: a ratio that only falls with time, so it is checked as of REACTION_S from now.
    """
    now = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=REACTION_S)
    ages = {p.metadata.name: (now - ready_since(p)).total_seconds() for p in pool_pods(core)}
    younger = [age for name, age in ages.items() if name != oldest]
    assert ages[oldest] >= 2 * max(younger), f"Ready ages as of the scale-down: {ages}"
    assert math.floor(math.log2(ages[oldest])) > max(math.floor(math.log2(a)) for a in younger)


def test_the_controller_manager_removes_the_pod_the_operator_ranked_cheapest(
    pool: k8s.AppsV1Api, api: k8s.ApiClient, pod_runner: PodRunner
) -> None:
    core = k8s.CoreV1Api(api)
    kube = Kube(api.configuration)
    selector = PoolSelector(namespace=NAMESPACE, cluster=CLUSTER, pool="decode")
    log = logging.getLogger("e2e.scaledown")
    router_labels = {"namespace": NAMESPACE, "tandem_dev_cluster": CLUSTER}
    with (
        RouterMetricsStandIn() as router,
        running_prometheus(
            [static_job("routers", [(f"127.0.0.1:{router.port}", router_labels)])]
        ) as prometheus,
    ):
        [oldest] = eventually(
            lambda: pool_at(core, 1, ready=True),
            timeout_s=120,
            what="the first pool pod Ready (its engine answering /health)",
            details=pod_runner.report,
        )
        # Ready OLDER_S before the pool grows: see assert_oldest_kept_by_default.
        [first] = pool_pods(core)
        ready_for = (datetime.datetime.now(datetime.UTC) - ready_since(first)).total_seconds()
        time.sleep(max(0.0, OLDER_S - ready_for))
        scale_deployment(kube, NAMESPACE, DEPLOYMENT, 3)
        # Round one ranks cheapest the pod the controller's own order removes last (the oldest);
        # round two another pod, so the choice follows the ranking each time. Each round ranks
        # the pods as soon as they exist and shrinks the pool as soon as they are all Ready, so
        # that the new pods are as young as they can be in round one.
        for replicas, cheapest in ((2, oldest), (1, None)):
            remaining = eventually(
                lambda: pool_at(core, replicas + 1, ready=False),  # noqa: B023
                timeout_s=60,
                what=f"{replicas + 1} pool pods",
            )
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

            # An unready pod goes before any ranking: all must be Ready for the ranks to decide.
            assert (
                eventually(
                    lambda: pool_at(core, replicas + 1, ready=True),  # noqa: B023
                    timeout_s=120,
                    what=f"{replicas + 1} Ready pool pods",
                    details=pod_runner.report,
                )
                == remaining
            )
            if cheapest == oldest:
                assert_oldest_kept_by_default(core, oldest)
            scale_deployment(kube, NAMESPACE, DEPLOYMENT, replicas)
            left = eventually(
                lambda: pool_at(core, replicas, ready=True),  # noqa: B023
                timeout_s=60,
                what=f"the pool at {replicas}",
            )
            assert cheapest not in left
            assert set(left) == set(remaining) - {cheapest}
