"""Cache-aware scale-down: before a pool shrinks, rank its pods by the router's removal cost.

The router publishes each engine's removal cost, the cached blocks lost with it
(`tandem_router_engine_removal_cost`, formula in `tandem/router/removal_cost.py`). Before a pool's
Deployment is scaled down, the operator reads the costs from Prometheus,

    cost(pod) = avg by (engine_pod) (tandem_router_engine_removal_cost{namespace, cluster, pool})

(the mean over router replicas and processes: equal on the exact index, each one's sample of the
routes on the approximate one), and writes on every pod of the pool

    controller.kubernetes.io/pod-deletion-cost = rank(pod)
    rank(pod) = 1 + number of distinct costs below cost(pod)    (0 for a pod with no cost read)
    tandem.dev/removal-cost                    = cost(pod)       (what the rank came from)

The autoscaler ranks a pool before it scales it down; a reconcile ranks a pool before it applies
a lower count than its Deployment has (a user lowered spec.<pool>.replicas). Under KEDA or an HPA
the Deployments are resized by them, without a ranking.

The ReplicaSet controller removes pods with a lower deletion cost first, once unscheduled,
pending and unready pods are gone, so the pod whose cache the pool can best spare goes first. A
pod the router does not know (not Ready yet, or not yet discovered) has no cache the router can
use and ranks 0. Ranks rather than costs: the order is what matters, and a rank stays a small
int32 whatever the index size. When no cost can be read, the annotations written earlier are
removed (a stale order must not steer this scale-down) and the controller's own order applies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import kopf

from tandem.common.roles import LABEL_CLUSTER, LABEL_ROLE, ROLES, Role
from tandem.operator.api import ServingCluster, pool_replicas
from tandem.operator.autoscaling.prometheus import PrometheusClient, PrometheusUnavailable
from tandem.operator.autoscaling.queries import PoolSelector
from tandem.operator.common_render import Component, external_scaling
from tandem.operator.kube import FIELD_MANAGER, Kube, NotFound, object_path

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
REMOVAL_COST = "tandem.dev/removal-cost"
METRIC = "tandem_router_engine_removal_cost"
POD_LABEL = "engine_pod"  # the router's label for the engine's pod (`pod` is the router's own)


def removal_cost_query(selector: PoolSelector) -> str:
    """`avg by (engine_pod) (tandem_router_engine_removal_cost{namespace, cluster, pool="<pool>"})`:
    the router's series carry the router pod's namespace and cluster labels, and `pool` names the
    engines' pool."""
    matchers = PoolSelector(
        namespace=selector.namespace, cluster=selector.cluster, pool=selector.pool, role_label=""
    ).matchers()
    return f'avg by ({POD_LABEL}) ({METRIC}{{{matchers[1:-1]},pool="{selector.pool}"}})'


def deletion_ranks(pods: Sequence[str], costs: Mapping[str, float]) -> dict[str, int]:
    """rank(pod) of the module docstring for each of `pods`."""
    distinct = sorted({costs[pod] for pod in pods if pod in costs})
    below = {cost: i for i, cost in enumerate(distinct)}
    return {pod: below[costs[pod]] + 1 if pod in costs else 0 for pod in pods}


def annotation_patches(
    pods: Sequence[Mapping[str, Any]], costs: Mapping[str, float] | None
) -> dict[str, dict[str, str | None]]:
    """Pod name -> the annotations to merge-patch (None removes one), for the pods whose
    annotations differ from what `costs` ranks them at; `costs` None removes Tandem's."""
    names = [pod["metadata"]["name"] for pod in pods]
    ranks = deletion_ranks(names, costs) if costs is not None else {}
    patches: dict[str, dict[str, str | None]] = {}
    for pod, name in zip(pods, names, strict=True):
        current = pod["metadata"].get("annotations") or {}
        wanted: dict[str, str | None]
        if costs is None:
            if REMOVAL_COST not in current:
                continue  # never ranked by Tandem: whatever it carries is someone else's
            wanted = {DELETION_COST: None, REMOVAL_COST: None}
        else:
            cost = costs.get(name)
            wanted = {
                DELETION_COST: str(ranks[name]),
                REMOVAL_COST: None if cost is None else f"{cost:.1f}",
            }
        if any(current.get(key) != value for key, value in wanted.items()):
            patches[name] = wanted
    return patches


async def read_removal_costs(
    prometheus: PrometheusClient, selector: PoolSelector
) -> dict[str, float]:
    """engine pod name -> removal cost; empty when Prometheus holds no router series of the pool."""
    samples = await prometheus.query(removal_cost_query(selector))
    return {
        sample.labels[POD_LABEL]: sample.value
        for sample in samples
        if sample.labels.get(POD_LABEL) and sample.value == sample.value  # NaN: no reading
    }


def pool_pods(kube: Kube, namespace: str, cluster: str, pool: Role) -> list[dict[str, Any]]:
    """The pool's pods that are not being deleted."""
    pods = kube.list("v1", "Pod", namespace, f"{LABEL_CLUSTER}={cluster},{LABEL_ROLE}={pool}")
    return [pod for pod in pods if not pod["metadata"].get("deletionTimestamp")]


def annotate_pods(
    kube: Kube, namespace: str, patches: Mapping[str, Mapping[str, str | None]]
) -> None:
    """Merge-patch each pod's annotations (a pod gone meanwhile is no longer a candidate)."""
    for name, patch in patches.items():
        with contextlib.suppress(NotFound):
            kube.request(
                "PATCH",
                object_path("v1", "Pod", namespace, name),
                [("fieldManager", FIELD_MANAGER)],
                {"metadata": {"annotations": dict(patch)}},
                "application/merge-patch+json",
            )


async def rank_pool_for_scale_down(
    kube: Kube,
    prometheus_url: str,
    selector: PoolSelector,
    logger: logging.Logger | kopf.Logger,
) -> dict[str, int] | None:
    """Annotate the pool's pods with their deletion ranks before it shrinks; the ranks written,
    or None when no cost could be read (the controller's default order then applies). Never
    raises for Prometheus or the API server: a scale-down goes ahead without the ranking."""
    try:
        async with PrometheusClient(prometheus_url) as prometheus:
            costs: dict[str, float] | None = await read_removal_costs(prometheus, selector)
    except PrometheusUnavailable as exc:
        logger.warning(f"cache-aware scale-down of {selector.pool}: {exc}")
        costs = None
    if not costs:
        costs = None
        logger.warning(
            f"cache-aware scale-down of {selector.pool}: no {METRIC} series for "
            f"{selector.namespace}/{selector.cluster}; the ReplicaSet controller picks the pods"
        )
    namespace, cluster = selector.namespace, selector.cluster
    try:
        pods = await asyncio.to_thread(pool_pods, kube, namespace, cluster, selector.pool)
        patches = annotation_patches(pods, costs)
        await asyncio.to_thread(annotate_pods, kube, namespace, patches)
    except Exception as exc:  # the scale-down must not wait on its ranking
        logger.warning(f"cache-aware scale-down of {selector.pool}: annotating pods failed: {exc}")
        return None
    if costs is None:
        return None
    ranks = deletion_ranks([pod["metadata"]["name"] for pod in pods], costs)
    logger.info(f"cache-aware scale-down of {selector.pool}: pod-deletion-cost ranks {ranks}")
    return ranks


def shrinking_pools(
    sc: ServingCluster, deployments: Mapping[Component, Mapping[str, Any] | None]
) -> list[Role]:
    """The pools a reconcile of `sc` would shrink: rendered replicas below the replicas of the
    pool's live Deployment in `deployments` (by role); none while KEDA or an HPA sizes them."""
    if external_scaling(sc):
        return []
    shrinking: list[Role] = []
    for pool in ROLES:
        live = deployments.get(pool)
        if live is not None and pool_replicas(sc, pool) < int(
            live.get("spec", {}).get("replicas", 1)
        ):
            shrinking.append(pool)
    return shrinking


def rank_before_reconcile(
    kube: Kube, sc: ServingCluster, deployments: Mapping[Component, Mapping[str, Any] | None]
) -> None:
    """`rank_pool_for_scale_down` of every pool the coming apply shrinks (from a handler thread)."""
    logger = logging.getLogger("tandem.operator.scale_down")
    for pool in shrinking_pools(sc, deployments):
        selector = PoolSelector(namespace=sc.namespace, cluster=sc.name, pool=pool)
        asyncio.run(
            rank_pool_for_scale_down(kube, sc.spec.autoscaling.prometheus_url, selector, logger)
        )
