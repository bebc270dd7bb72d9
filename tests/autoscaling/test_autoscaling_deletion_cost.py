"""Cache-aware scale-down: the pod ranking, the annotations it writes and the PromQL it reads
(the whole chain on the real control plane is still to be tested in e2e)."""

from __future__ import annotations

from typing import Any

from tandem.operator.api import ServingCluster
from tandem.operator.autoscaling.deletion_cost import (
    DELETION_COST,
    REMOVAL_COST,
    annotation_patches,
    deletion_ranks,
    removal_cost_query,
    shrinking_pools,
)
from tandem.operator.autoscaling.queries import PoolSelector
from tandem.operator.manifest import parse_manifest


def pod(name: str, **annotations: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "annotations": annotations}}


def test_ranks_follow_the_costs_and_unknown_pods_go_first() -> None:
    ranks = deletion_ranks(["a", "b", "c", "new"], {"a": 30.0, "b": 2.5, "c": 30.0, "gone": 1.0})
    assert ranks == {"b": 1, "a": 2, "c": 2, "new": 0}


def test_patches_write_rank_and_cost_and_skip_pods_already_right() -> None:
    pods = [pod("a"), pod("b", **{DELETION_COST: "1", REMOVAL_COST: "2.5"}), pod("c")]
    patches = annotation_patches(pods, {"a": 30.04, "b": 2.5})
    assert patches == {
        "a": {DELETION_COST: "2", REMOVAL_COST: "30.0"},
        "c": {DELETION_COST: "0", REMOVAL_COST: None},
    }


def test_without_costs_only_tandems_own_rankings_are_removed() -> None:
    pods = [
        pod("ours", **{DELETION_COST: "3", REMOVAL_COST: "9.0"}),
        pod("theirs", **{DELETION_COST: "7"}),
    ]
    assert annotation_patches(pods, None) == {"ours": {DELETION_COST: None, REMOVAL_COST: None}}


def test_query_averages_the_routers_over_the_pool() -> None:
    query = removal_cost_query(PoolSelector(namespace="serving", cluster="llama", pool="prefill"))
    assert query == (
        "avg by (engine_pod) (tandem_router_engine_removal_cost"
        '{namespace="serving",tandem_dev_cluster="llama",pool="prefill"})'
    )


def cluster(**spec: Any) -> ServingCluster:
    return parse_manifest(
        {
            "apiVersion": "tandem.dev/v1alpha1",
            "kind": "ServingCluster",
            "metadata": {"name": "m", "namespace": "ns"},
            "spec": {"model": {"name": "m"}, **spec},
        }
    )


def deployment(replicas: int) -> dict[str, Any]:
    return {"spec": {"replicas": replicas}}


def test_a_reconcile_ranks_the_pools_it_lowers() -> None:
    sc = cluster(prefill={"replicas": 2}, decode={"replicas": 3})
    live = {"prefill": deployment(2), "decode": deployment(5), "router": deployment(9)}
    assert shrinking_pools(sc, live) == ["decode"]
    assert shrinking_pools(sc, {"prefill": None, "decode": deployment(1)}) == []


def test_no_ranking_while_keda_or_an_hpa_sizes_the_pools() -> None:
    sc = cluster(decode={"replicas": 1}, autoscaling={"enabled": True, "provider": "hpa"})
    assert shrinking_pools(sc, {"decode": deployment(4)}) == []
