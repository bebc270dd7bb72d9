"""Pure reconcile planning: owner references, object identity and which stale children to prune."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tandem.operator.render import LABEL_CLUSTER, LABEL_MANAGED_BY, MANAGED_BY

# Kinds the renderer may produce, and so the only kinds the operator ever prunes. PVCs and
# Secrets are deliberately absent: users own them (model cache, HF token) and they must survive.
PRUNABLE_KINDS: tuple[tuple[str, str], ...] = (
    ("v1", "ServiceAccount"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("v1", "ConfigMap"),
    ("v1", "Service"),
    ("apps/v1", "Deployment"),
    ("policy/v1", "PodDisruptionBudget"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("autoscaling/v2", "HorizontalPodAutoscaler"),
    ("keda.sh/v1alpha1", "ScaledObject"),
)
NEVER_PRUNED_KINDS = frozenset({"PersistentVolumeClaim", "Secret"})


@dataclass(frozen=True, order=True)
class ObjectKey:
    """Identity of a namespaced object."""

    api_version: str
    kind: str
    namespace: str
    name: str

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> ObjectKey:
        meta = obj["metadata"]
        return cls(obj["apiVersion"], obj["kind"], meta.get("namespace", ""), meta["name"])

    def __str__(self) -> str:
        return f"{self.kind}/{self.name}"


def owner_reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    """A controller reference to the ServingCluster, so deleting it garbage-collects the child."""
    meta = owner["metadata"]
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def with_owner(obj: dict[str, Any], owner: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `obj` whose only owner reference is the ServingCluster."""
    meta = {**obj["metadata"], "ownerReferences": [owner_reference(owner)]}
    return {**obj, "metadata": meta}


def children_selector(cluster_name: str) -> str:
    """Label selector of every object the operator created for one ServingCluster."""
    return f"{LABEL_CLUSTER}={cluster_name},{LABEL_MANAGED_BY}={MANAGED_BY}"


def owned_by(obj: Mapping[str, Any], owner_uid: str) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("uid") == owner_uid and ref.get("controller") for ref in refs)


def stale_children(
    rendered: Iterable[Mapping[str, Any]], existing: Iterable[Mapping[str, Any]], owner_uid: str
) -> list[ObjectKey]:
    """Existing children that the current spec no longer renders.

    Only objects controlled by this very ServingCluster (owner uid) and of a prunable kind are
    returned, so a labelled object someone else made, a PVC or a Secret is never touched.
    """
    wanted = {ObjectKey.of(obj) for obj in rendered}
    prunable = {kind for _, kind in PRUNABLE_KINDS}
    stale = [
        ObjectKey.of(obj)
        for obj in existing
        if obj["kind"] in prunable
        and obj["kind"] not in NEVER_PRUNED_KINDS
        and owned_by(obj, owner_uid)
        and ObjectKey.of(obj) not in wanted
    ]
    return sorted(set(stale))
