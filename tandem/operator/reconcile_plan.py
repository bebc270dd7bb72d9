"""The reconcile's plan, pure: owner references, object identity and which stale children to prune.

The reconcile itself (apply, prune, status) is `reconcile.reconcile_body`, which carries this out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tandem.common.roles import LABEL_CLUSTER
from tandem.operator.common_render import LABEL_MANAGED_BY, MANAGED_BY
from tandem.operator.kinds import CHILD_KINDS, NEVER_PRUNED_KINDS


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
    prunable = {k.kind for k in CHILD_KINDS}
    stale = [
        ObjectKey.of(obj)
        for obj in existing
        if obj["kind"] in prunable
        and obj["kind"] not in NEVER_PRUNED_KINDS
        and owned_by(obj, owner_uid)
        and ObjectKey.of(obj) not in wanted
    ]
    return sorted(set(stale))
