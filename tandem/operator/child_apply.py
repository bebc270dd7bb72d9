"""Applying a ServingCluster's rendered children with owner references, and pruning stale ones."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tandem.operator.api import ServingCluster
from tandem.operator.cache import ChildUids
from tandem.operator.kinds import CHILD_KINDS
from tandem.operator.kube import Kube, KubeError
from tandem.operator.ownership import foreign_owner
from tandem.operator.reconcile_plan import (
    ObjectKey,
    children_selector,
    stale_children,
    with_owner,
)
from tandem.operator.render import render

# API groups that may be absent from a cluster; their objects are skipped (and not pruned) then.
OPTIONAL_GROUPS = ("monitoring.coreos.com/", "keda.sh/", "inference.networking.k8s.io/")


@dataclass
class ApplyOutcome:
    applied: list[ObjectKey] = field(default_factory=list)
    skipped: list[ObjectKey] = field(
        default_factory=list
    )  # API not served (no Prometheus Operator)
    pruned: list[ObjectKey] = field(default_factory=list)
    # Existing objects of a rendered name that Tandem does not own: left alone, and why.
    conflicts: list[tuple[ObjectKey, str]] = field(default_factory=list)
    # The objects as the API server returned them from the apply (their status is current).
    live: dict[ObjectKey, dict[str, Any]] = field(default_factory=dict)


def _served(kube: Kube, api_version: str, kind: str) -> bool:
    if not api_version.startswith(OPTIONAL_GROUPS):
        return True
    return kube.serves(api_version, kind)


def needs_prune(generation: int | None, observed_generation: int | None) -> bool:
    """Whether a reconcile must look for children the spec no longer renders: only when the spec
    changed since the last applied generation. A first apply of generation 1 has no older spec
    whose children could be stale; the periodic resync prunes regardless (operator upgrades)."""
    if generation == observed_generation:
        return False
    return not (observed_generation is None and generation == 1)


def apply_known(kube: Kube, obj: dict[str, Any], known_uid: str | None) -> dict[str, Any] | None:
    """Apply `obj` over the object of `known_uid` (one this process applied before), with that
    uid as the API server's precondition; None when there is no such uid, or the object is not
    that one any more (deleted, re-created) or the server refused it: the caller then reads it."""
    if known_uid is None:
        return None
    pinned = {**obj, "metadata": {**obj["metadata"], "uid": known_uid}}
    try:
        return kube.apply(pinned, force=True)
    except KubeError as exc:
        if exc.status not in (409, 422):  # uid mismatch / immutable, or two controllers
            raise
        return None


# Kinds applied after the first wave, in this order. A RoleBinding waits for its Role: the API
# server checks that the operator holds every permission of the Role it binds, and refuses the
# binding (404) while that Role does not exist yet. Workloads start or size pods, so they come
# last: a pod never starts without its account, configuration, budget or network policy.
WORKLOAD_KINDS = frozenset({"Deployment", "HorizontalPodAutoscaler", "ScaledObject"})
LATER_WAVES = (frozenset({"RoleBinding"}), WORKLOAD_KINDS)
# Children of one ServingCluster applied at once. A reconcile is a chain of API requests; under
# load each takes 0.1-0.3 s, so a first reconcile of ~15 children (a read and an apply each)
# took seconds one by one, and a burst of clusters queued behind kopf's handler threads.
APPLY_CONCURRENCY = 4


def apply_waves(objects: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The rendered objects in apply order: every kind no later wave names, then each of
    LATER_WAVES in turn. Objects within a wave do not depend on each other."""
    later = frozenset().union(*LATER_WAVES)
    first = [obj for obj in objects if obj["kind"] not in later]
    return [first] + [[obj for obj in objects if obj["kind"] in kinds] for kinds in LATER_WAVES]


def apply_child(
    kube: Kube,
    body: Mapping[str, Any],
    sc: ServingCluster,
    obj: dict[str, Any],
    uids: ChildUids | None,
) -> tuple[dict[str, Any] | None, str | None]:
    """Apply one child: (the object as stored, None), or (None, why it is someone else's).

    A child whose uid `uids` holds is applied at once with that uid as precondition (no read);
    any other is read first, and left alone when someone else owns it."""
    key, cluster = ObjectKey.of(obj), (sc.namespace, sc.name)
    owned = with_owner(obj, body)
    live = apply_known(kube, owned, uids.get(cluster, key) if uids else None)
    if live is None:
        current = kube.get(key.api_version, key.kind, key.namespace, key.name)
        why = foreign_owner(current, body["metadata"]["uid"], sc.name) if current else None
        if why is not None:
            if uids is not None:
                uids.forget(cluster, key)
            return None, why
        # Forced only over an object already ours (taking back fields another manager
        # changed); a create is not forced, so an object someone makes meanwhile is a
        # conflict, not taken.
        live = kube.apply(owned, force=current is not None)
    if uids is not None:
        uids.put(cluster, key, live["metadata"]["uid"])
    return live, None


def apply_children(
    kube: Kube,
    body: Mapping[str, Any],
    sc: ServingCluster,
    prune: bool = True,
    uids: ChildUids | None = None,
) -> ApplyOutcome:
    """Apply every rendered child with an owner reference (`apply_child`, APPLY_CONCURRENCY at
    once, in `apply_waves`), then (when `prune`) delete the ones no longer rendered (one LIST
    per prunable kind)."""
    outcome = ApplyOutcome()
    wanted = []
    cluster = (sc.namespace, sc.name)
    served = []
    for obj in render(sc):
        if _served(kube, obj["apiVersion"], obj["kind"]):
            served.append(obj)
        else:
            outcome.skipped.append(ObjectKey.of(obj))
    with concurrent.futures.ThreadPoolExecutor(APPLY_CONCURRENCY) as pool:
        for wave in apply_waves(served):
            results = pool.map(lambda obj: apply_child(kube, body, sc, obj, uids), wave)
            for obj, (live, why) in zip(wave, list(results), strict=True):
                key = ObjectKey.of(obj)
                if why is not None:
                    outcome.conflicts.append((key, why))
                    continue
                assert live is not None
                outcome.live[key] = live
                wanted.append(obj)
                outcome.applied.append(key)
    if not prune:
        return outcome
    existing: list[dict[str, Any]] = []
    selector = children_selector(sc.name)
    for kind in CHILD_KINDS:
        if not _served(kube, kind.api_version, kind.kind):
            continue
        try:
            existing += kube.list(kind.api_version, kind.kind, sc.namespace, selector)
        except KubeError as exc:
            if exc.status != 403:
                raise
            # A kind the chart's RBAC leaves out (e.g. rbac.externalAutoscalers: false): the
            # operator never made any, so there is nothing of it to prune.
    for key in stale_children(wanted, existing, body["metadata"]["uid"]):
        kube.delete(key.api_version, key.kind, key.namespace, key.name)
        if uids is not None:
            uids.forget(cluster, key)
        outcome.pruned.append(key)
    return outcome
