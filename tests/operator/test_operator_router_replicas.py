"""Router replicas and processes as rendered: the router's disruption budget, the spread of its
pods, its processes in the ConfigMap and the CPU they are given."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml
from sc_manifests import cluster

from tandem.operator.api import ServingCluster
from tandem.operator.reconcile_plan import ObjectKey, stale_children
from tandem.operator.render import render
from tandem.operator.router_render import router_config_map, router_deployment
from tandem.router.config import RouterConfig

K8S_VERSION = "1.34.0"


def router_budgets(sc: ServingCluster) -> list[dict[str, Any]]:
    return [
        o
        for o in render(sc)
        if o["kind"] == "PodDisruptionBudget" and o["metadata"]["name"] == "m-router"
    ]


def pod_spec(sc: ServingCluster) -> dict[str, Any]:
    spec: dict[str, Any] = router_deployment(sc)["spec"]["template"]["spec"]
    return spec


@pytest.mark.parametrize("replicas", [0, 1])
def test_no_router_budget_for_one_replica_or_none(replicas: int) -> None:
    assert router_budgets(cluster(router={"replicas": replicas})) == []


def test_several_replicas_get_a_budget_of_one_unavailable() -> None:
    sc = cluster(router={"replicas": 3})
    [budget] = router_budgets(sc)
    assert budget["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": router_deployment(sc)["spec"]["selector"]["matchLabels"]},
    }
    assert router_deployment(sc)["spec"]["replicas"] == 3
    kubernetes_validate.validate(budget, K8S_VERSION, strict=True)


def test_dropping_back_to_one_replica_prunes_the_budget() -> None:
    """The budget rendered at 3 replicas is stale once the spec says 1 (the reconcile deletes it)."""
    three, one = cluster(router={"replicas": 3}), cluster(router={"replicas": 1})
    uid = "uid-1"
    existing = [
        {**o, "metadata": {**o["metadata"], "ownerReferences": [{"uid": uid, "controller": True}]}}
        for o in render(three)
    ]
    assert stale_children(render(one), existing, uid) == [
        ObjectKey("policy/v1", "PodDisruptionBudget", "ns", "m-router")
    ]


@pytest.mark.parametrize("replicas", [1, 3])
def test_router_pods_spread_over_nodes_and_zones_by_default(replicas: int) -> None:
    """The same constraints whatever the replica count: scaling never rolls the router's pods."""
    sc = cluster(router={"replicas": replicas})
    selector = router_deployment(sc)["spec"]["selector"]["matchLabels"]
    assert pod_spec(sc)["topologySpreadConstraints"] == [
        {
            "maxSkew": 1,
            "topologyKey": key,
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": selector},
            "matchLabelKeys": ["pod-template-hash"],
        }
        for key in ("kubernetes.io/hostname", "topology.kubernetes.io/zone")
    ]
    kubernetes_validate.validate(router_deployment(sc), K8S_VERSION, strict=True)


def test_scaling_the_router_keeps_its_pod_template() -> None:
    one, three = cluster(router={"replicas": 1}), cluster(router={"replicas": 3})
    assert (
        router_deployment(one)["spec"]["template"] == router_deployment(three)["spec"]["template"]
    )


def test_spread_constraints_are_overridable_and_can_be_turned_off() -> None:
    mine = [{"maxSkew": 2, "topologyKey": "rack", "whenUnsatisfiable": "DoNotSchedule",
             "labelSelector": {"matchLabels": {"app": "x"}}}]  # fmt: skip
    assert (
        pod_spec(cluster(router={"replicas": 3, "topologySpreadConstraints": mine}))[
            "topologySpreadConstraints"
        ]
        == mine
    )
    assert "topologySpreadConstraints" not in pod_spec(
        cluster(router={"replicas": 3, "topologySpreadConstraints": []})
    )


def configured(sc: ServingCluster) -> RouterConfig:
    text = router_config_map(sc)["data"]["router.yaml"]
    return RouterConfig.model_validate(yaml.safe_load(text))


def test_processes_reach_the_router_config() -> None:
    assert configured(cluster()).processes == 1
    assert configured(cluster(router={"processes": 4})).processes == 4


def container_resources(sc: ServingCluster) -> dict[str, Any]:
    resources: dict[str, Any] = pod_spec(sc)["containers"][0]["resources"]
    return resources


def test_default_resources_give_each_process_a_core() -> None:
    assert container_resources(cluster()) == {
        "requests": {"cpu": "500m", "memory": "512Mi"},
        "limits": {"memory": "2Gi"},
    }
    assert container_resources(cluster(router={"processes": 4})) == {
        "requests": {"cpu": "4", "memory": "2048Mi"},
        "limits": {"memory": "8Gi"},
    }


def test_explicit_resources_win_over_the_processes_default() -> None:
    mine = {"requests": {"cpu": "3"}, "limits": {"cpu": "3", "memory": "4Gi"}}
    assert container_resources(cluster(router={"processes": 4, "resources": mine})) == mine


@pytest.mark.parametrize("processes", [0, 65])
def test_processes_out_of_range_are_refused(processes: int) -> None:
    with pytest.raises(ValueError, match="processes"):
        cluster(router={"processes": processes})
