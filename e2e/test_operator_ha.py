"""Operator HA on the real control plane: the chart with `operator.replicas=2` runs two peered
operator pods; the active one is killed (SIGKILL, no goodbye in the peering object) and the standby
reconciles a spec change within 30 s, creating no duplicate and re-creating nothing. At every
moment exactly one operator process runs the autoscaler: before the kill the active one, after it
the one that took over.

The autoscaler's Prometheus is unreachable, so each evaluation holds the pools at their one
replica (and counts a MetricsUnavailable decision in that operator's /metrics); what is under test
is the operators, not the engines. The release is set back to one replica afterwards.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from kubernetes import client as k8s
from prometheus_client.parser import text_string_to_metric_families

from e2e.conftest import (
    CHART,
    OPERATOR_METRICS_PORT,
    OPERATOR_NAMESPACE,
    RELEASE,
    wait_for_operator,
)
from e2e.harness.kube import eventually, gone, zero_pool_cluster
from e2e.harness.podrunner import PodRunner, RunningPod
from e2e.harness.tools import Clients
from tandem.observability.names import AUTOSCALER_EVALUATIONS
from tandem.operator.peering import is_active, peer_live

pytestmark = pytest.mark.e2e

NAMESPACE = "ha"
NAME = "ha"
GROUP, VERSION, PLURAL = "tandem.dev", "v1alpha1", "servingclusters"
PEERING = RELEASE  # the chart's fullname (the release name, as it contains the chart's)


def _manifest(annotation: str) -> dict[str, Any]:
    """Pools the autoscaler holds at one replica each: its Prometheus is an address where nothing
    listens, so every evaluation is MetricsUnavailable and keeps the size within [1, 1]."""
    router = {"replicas": 0, "service": {"annotations": {"ha/step": annotation}}}
    autoscaling = {
        "enabled": True,
        "prometheusURL": "http://127.0.0.1:9",
        "intervalSeconds": 1,
        "prefill": {"min": 1, "max": 1},
        "decode": {"min": 1, "max": 1},
    }
    return zero_pool_cluster(
        NAME, NAMESPACE, router, model={"name": "tiny"}, autoscaling=autoscaling
    )


def _live_operators(pod_runner: PodRunner) -> list[RunningPod]:
    return [p for p in pod_runner.by_role("operator", OPERATOR_NAMESPACE) if p.child.alive()]


def _evaluations(operator: RunningPod) -> float | None:
    """Autoscaler evaluations of the test's cluster made by this operator process (its /metrics;
    None when it does not answer)."""
    try:
        url = f"http://{operator.ip}:{OPERATOR_METRICS_PORT}/metrics"
        text = httpx.get(url, timeout=5).text
    except httpx.HTTPError:
        return None
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == AUTOSCALER_EVALUATIONS and sample.labels.get("namespace") == NAMESPACE
    )


def _evaluating(operators: list[RunningPod], over_s: float = 3.0) -> list[RunningPod]:
    """The operator pods whose autoscaler evaluated the test's cluster during `over_s` seconds."""
    before = [_evaluations(operator) for operator in operators]
    time.sleep(over_s)
    after = [_evaluations(operator) for operator in operators]
    return [
        operator
        for operator, old, new in zip(operators, before, after, strict=True)
        if old is not None and new is not None and new > old
    ]


@pytest.fixture(scope="module")
def two_operators(
    tandem_release: RunningPod, clients: Clients, pod_runner: PodRunner
) -> Iterator[list[RunningPod]]:
    """The release upgraded to two operator replicas, both live; one again afterwards."""

    def upgrade(replicas: int) -> None:
        clients.helm(
            "upgrade", RELEASE, str(CHART), "--namespace", OPERATOR_NAMESPACE, "--reuse-values",
            "--set", f"operator.replicas={replicas}", "--wait", "--timeout", "2m",
        )  # fmt: skip

    upgrade(2)

    def both_live() -> list[RunningPod] | None:
        live = _live_operators(pod_runner)
        return live if len(live) == 2 else None

    try:
        operators = eventually(both_live, timeout_s=60, what="two operator pods")
        yield operators
    finally:
        upgrade(1)
        wait_for_operator(pod_runner)


def _peers(custom: k8s.CustomObjectsApi) -> dict[str, Any]:
    peering = custom.get_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", PEERING)
    peers: dict[str, Any] = peering.get("status") or {}
    return peers


def _pod_of(identity: str, operators: list[RunningPod]) -> RunningPod | None:
    """The operator pod whose process holds the peer id `identity` (ids end in the process id)."""
    pid = int(identity.rsplit("-", 1)[1])
    for operator in operators:
        try:
            if os.getpgid(pid) == operator.child.pid:  # the pod's process group
                return operator
        except ProcessLookupError:
            continue
    return None


def _active(custom: k8s.CustomObjectsApi, operators: list[RunningPod]) -> RunningPod | None:
    """The active operator pod, once every pod is a live peer; None before. A pod that has not
    written its first keep-alive yet is not a standby: killing the other one then would test a
    start-up, not a take-over."""
    peers = _peers(custom)
    now = datetime.datetime.now(datetime.UTC)
    live = {}
    for identity, info in peers.items():
        pod = _pod_of(identity, operators)
        if pod is not None and peer_live(info, now):
            live[identity] = pod
    if len(live) < len(operators):
        return None
    active = [
        pod
        for identity, pod in live.items()
        if is_active(peers, identity, int(peers[identity].get("priority", 0)), now)
    ]
    return active[0] if len(active) == 1 else None


def test_the_standby_takes_over_within_30_s(
    two_operators: list[RunningPod], api: k8s.ApiClient, pod_runner: PodRunner
) -> None:
    core, custom = k8s.CoreV1Api(api), k8s.CustomObjectsApi(api)
    core.create_namespace({"metadata": {"name": NAMESPACE}})
    custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, _manifest("one"))

    def router_annotation() -> str | None:
        try:
            service = core.read_namespaced_service(f"{NAME}-router", NAMESPACE)
        except k8s.ApiException:
            return None
        return (service.metadata.annotations or {}).get("ha/step")

    def observed() -> int | None:
        body = custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, NAME)
        return body.get("status", {}).get("observedGeneration")  # type: ignore[no-any-return]

    eventually(lambda: router_annotation() == "one", timeout_s=30, what="the first reconcile")
    # The status is written after every child of the generation is applied: then all exist.
    eventually(lambda: observed() == 1, timeout_s=30, what="status.observedGeneration 1")
    active = eventually(
        lambda: _active(custom, two_operators), timeout_s=30, what="two live peers, one active"
    )
    [standby] = [p for p in two_operators if p is not active]
    # One autoscaler, the active replica's (its leadership gate follows the peering within 2 s).
    eventually(lambda: _evaluating(two_operators) == [active], timeout_s=20,
               what="the active operator alone evaluating the autoscaler")  # fmt: skip
    uids = {s.metadata.name: s.metadata.uid for s in core.list_namespaced_service(NAMESPACE).items}

    os.killpg(active.child.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    custom.patch_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, NAME, _manifest("two"))
    eventually(lambda: router_annotation() == "two", timeout_s=30, what="the standby's reconcile")
    took_s = time.monotonic() - killed_at
    assert took_s < 30
    assert standby.child.alive()
    after = {s.metadata.name: s.metadata.uid for s in core.list_namespaced_service(NAMESPACE).items}
    assert after == uids, "the take-over created or re-created children"

    # The status follows the children it reports on (the Service above is applied first).
    eventually(lambda: observed() == 2, timeout_s=10, what="status.observedGeneration 2")
    print(f"standby reconciled {took_s:.1f} s after the active operator was killed")
    # Our own loops (resync, autoscaler) follow the same peering: the standby now leads them.
    eventually(
        lambda: "this replica is now active" in standby.child.log.read_text(errors="replace"),
        timeout_s=10,
        what="the standby's leadership gate to open",
    )
    # Still one autoscaler among the live operator processes: the standby's.
    survivors = _live_operators(pod_runner)
    eventually(lambda: [p.name for p in _evaluating(survivors)] == [standby.name], timeout_s=20,
               what="the standby alone evaluating the autoscaler")  # fmt: skip

    custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, NAME)
    eventually(
        lambda: gone(
            lambda: custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, NAME)
        ),
        timeout_s=30,
        what="the ServingCluster to go",
    )
