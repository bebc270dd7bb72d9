"""Router replicas on the real control plane: `router.replicas: 3` gives a router Deployment of
3, its PodDisruptionBudget (which the disruption controller counts 3 pods against) and the
default topology spread, which the real scheduler follows over two KWOK nodes in two zones;
scaling back to 1 prunes the budget without rolling the router's pods.

The router pods run on two extra KWOK nodes of their own (tainted, so no other test's pod lands
there; the router tolerates the taint): KWOK marks them Running, and no router process starts,
because what is under test is what the operator renders and how Kubernetes acts on it. The pools
have no replicas.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client as k8s

from e2e.harness.cluster import kwok_node
from e2e.harness.kube import eventually, gone, zero_pool_cluster
from e2e.harness.podrunner import RunningPod

pytestmark = pytest.mark.e2e

NAMESPACE = "routers"
NAME = "spread"
ROUTER = f"{NAME}-router"
GROUP, VERSION, PLURAL = "tandem.dev", "v1alpha1", "servingclusters"
NODE_LABEL = "tandem.dev/e2e-router-spread"
# Each node's zone and pod addresses, the latter outside 127.0.0.0/8: nothing connects to these pods.
NODES = {"kwok-router-a": ("zone-a", "10.250.0.0/24"), "kwok-router-b": ("zone-b", "10.250.1.0/24")}
ROUTER_PODS = f"tandem.dev/cluster={NAME},tandem.dev/role=router"


def _node(name: str, zone: str, pod_cidr: str) -> dict[str, Any]:
    resources = {"cpu": "32", "memory": "64Gi", "pods": "110"}
    labels = {"topology.kubernetes.io/zone": zone, NODE_LABEL: "true"}
    taint = {"key": NODE_LABEL, "value": "true", "effect": "NoSchedule"}
    return kwok_node(name, pod_cidr, resources, labels, [taint])


def _manifest(router_replicas: int) -> dict[str, Any]:
    toleration = {"key": NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}
    router = {
        "replicas": router_replicas,
        "nodeSelector": {NODE_LABEL: "true"},
        "tolerations": [toleration],
    }
    return zero_pool_cluster(NAME, NAMESPACE, router)


@pytest.fixture(scope="module")
def router_nodes(api: k8s.ApiClient) -> Iterator[list[str]]:
    """Two Ready KWOK nodes in two zones, only for the router pods; deleted afterwards."""
    core = k8s.CoreV1Api(api)
    for name, (zone, pod_cidr) in NODES.items():
        node = _node(name, zone, pod_cidr)
        core.create_node(node)
        core.patch_node_status(name, {"status": node["status"]})

    def ready() -> bool:
        return all(
            any(c.type == "Ready" and c.status == "True" for c in core.read_node(n).status.conditions or [])
            for n in NODES
        )  # fmt: skip

    try:
        eventually(ready, timeout_s=60, what="the router nodes Ready")
        yield list(NODES)
    finally:
        for name in NODES:
            core.delete_node(name)


@pytest.fixture(scope="module")
def serving_cluster(
    tandem_release: RunningPod, router_nodes: list[str], api: k8s.ApiClient
) -> Iterator[k8s.CustomObjectsApi]:
    core, custom = k8s.CoreV1Api(api), k8s.CustomObjectsApi(api)
    core.create_namespace({"metadata": {"name": NAMESPACE}})
    custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, _manifest(3))
    try:
        yield custom
    finally:
        custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, NAME)
        core.delete_namespace(NAMESPACE)


def _budget(policy: k8s.PolicyV1Api) -> k8s.V1PodDisruptionBudget:
    return policy.read_namespaced_pod_disruption_budget(ROUTER, NAMESPACE)


def test_three_router_replicas_get_a_budget_and_spread_over_nodes_and_zones(
    serving_cluster: k8s.CustomObjectsApi, api: k8s.ApiClient
) -> None:
    apps, core, policy = k8s.AppsV1Api(api), k8s.CoreV1Api(api), k8s.PolicyV1Api(api)
    deployment = eventually(
        lambda: next(iter(apps.list_namespaced_deployment(
            NAMESPACE, field_selector=f"metadata.name={ROUTER}").items), None),
        timeout_s=60, what="the router Deployment",
    )  # fmt: skip
    assert deployment.spec.replicas == 3
    spread = deployment.spec.template.spec.topology_spread_constraints
    assert {(c.topology_key, c.when_unsatisfiable, c.max_skew) for c in spread} == {
        ("kubernetes.io/hostname", "ScheduleAnyway", 1),
        ("topology.kubernetes.io/zone", "ScheduleAnyway", 1),
    }

    def counting_three() -> k8s.V1PodDisruptionBudget | None:
        budget = _budget(policy)
        return budget if budget.status and budget.status.expected_pods == 3 else None

    budget = eventually(counting_three, timeout_s=60, what="the router budget counting 3 pods")
    assert budget.spec.max_unavailable == 1
    assert budget.metadata.owner_references[0].kind == "ServingCluster"

    def placed() -> dict[str, int] | None:
        pods = core.list_namespaced_pod(NAMESPACE, label_selector=ROUTER_PODS).items
        nodes = [p.spec.node_name for p in pods if p.spec.node_name]
        return collections.Counter(nodes) if len(nodes) == 3 else None

    per_node = eventually(placed, timeout_s=60, what="3 router pods scheduled")
    # maxSkew 1 over two nodes (and their two zones): 2 and 1, never 3 on one.
    assert sorted(per_node.values()) == [1, 2], per_node
    assert set(per_node) == set(NODES)
    # The scheduler's verdict is real and the budget's too: one eviction allowed at a time.
    eventually(
        lambda: _budget(policy).status.disruptions_allowed == 1,
        timeout_s=60,
        what="the budget allowing one disruption once the pods are ready",
    )


def test_scaling_back_to_one_prunes_the_budget_and_rolls_nothing(
    serving_cluster: k8s.CustomObjectsApi, api: k8s.ApiClient
) -> None:
    apps, policy = k8s.AppsV1Api(api), k8s.PolicyV1Api(api)
    template = apps.read_namespaced_deployment(ROUTER, NAMESPACE).spec.template
    serving_cluster.patch_namespaced_custom_object(
        GROUP, VERSION, NAMESPACE, PLURAL, NAME, {"spec": {"router": {"replicas": 1}}}
    )
    eventually(lambda: gone(lambda: _budget(policy)), timeout_s=60, what="the budget pruned")
    eventually(
        lambda: apps.read_namespaced_deployment(ROUTER, NAMESPACE).spec.replicas == 1,
        timeout_s=30,
        what="the router Deployment at 1",
    )
    assert apps.read_namespaced_deployment(ROUTER, NAMESPACE).spec.template == template
    replica_sets = apps.list_namespaced_replica_set(NAMESPACE, label_selector=ROUTER_PODS).items
    assert len(replica_sets) == 1, "scaling the router rolled its pods"
