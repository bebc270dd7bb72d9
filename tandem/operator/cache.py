"""The latest known body of objects the operator watches or writes, so that a status refresh after
a child changed reads nothing from the API server; and the uids of the children it applied, so
that a later reconcile applies over them without reading each one first (`ChildUids`).

Bodies come from two places: the watch streams kopf already holds open (ServingClusters and the
operator's Deployments) and the replies to the operator's own writes (apply, status patch). A body
replaces the one held only when it is at least as new, by resourceVersion: a watch event that
arrives after our own write's reply must not roll the status back. resourceVersion is formally
opaque, but the API server's (etcd's revision) is an integer; a non-integer one is always taken.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tandem.common.roles import LABEL_CLUSTER
from tandem.operator.api import ServingCluster
from tandem.operator.common_render import LABEL_MANAGED_BY, MANAGED_BY
from tandem.operator.reconcile_plan import ObjectKey

Key = tuple[str, str]  # (namespace, name)


def _version(body: Mapping[str, Any]) -> int | None:
    try:
        return int(body.get("metadata", {}).get("resourceVersion", ""))
    except ValueError:
        return None


def newer_or_same(candidate: Mapping[str, Any], held: Mapping[str, Any] | None) -> bool:
    """Whether `candidate` may replace `held`: held is absent, either version is unreadable, or
    candidate's resourceVersion is not older."""
    if held is None:
        return True
    mine, theirs = _version(candidate), _version(held)
    return mine is None or theirs is None or mine >= theirs


class ObjectCache:
    """Latest bodies of one kind by (namespace, name); thread-safe (handler threads and the
    event loop both write)."""

    def __init__(self) -> None:
        self._items: dict[Key, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def put(self, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata", {})
        key = (meta.get("namespace", ""), meta.get("name", ""))
        with self._lock:
            if newer_or_same(body, self._items.get(key)):
                self._items[key] = dict(body)

    def drop(self, namespace: str, name: str) -> None:
        with self._lock:
            self._items.pop((namespace, name), None)

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            return self._items.get((namespace, name))

    def labelled(self, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        """Bodies in `namespace` carrying every one of `labels`."""
        with self._lock:
            return [
                body
                for (ns, _), body in self._items.items()
                if ns == namespace
                and labels.items() <= (body.get("metadata", {}).get("labels") or {}).items()
            ]


class ChildUids:
    """The uid of every child this process applied, by ServingCluster (namespace, name).

    A later apply carries the uid in its metadata, which the API server takes as a precondition:
    the apply succeeds only on that very object (an object deleted meanwhile: 409 uid mismatch;
    one re-created under the name, by anyone: 422 uid immutable). So an object this process
    applied needs no read to tell it is still ours. Thread-safe."""

    def __init__(self) -> None:
        self._by_cluster: dict[Key, dict[Any, str]] = {}
        self._lock = threading.Lock()

    def get(self, cluster: Key, child: Any) -> str | None:
        with self._lock:
            return self._by_cluster.get(cluster, {}).get(child)

    def put(self, cluster: Key, child: Any, uid: str) -> None:
        with self._lock:
            self._by_cluster.setdefault(cluster, {})[child] = uid

    def forget(self, cluster: Key, child: Any | None = None) -> None:
        """Forget one child's uid, or (child None) every child of the cluster."""
        with self._lock:
            if child is None:
                self._by_cluster.pop(cluster, None)
            else:
                self._by_cluster.get(cluster, {}).pop(child, None)


@dataclass
class Caches:
    """Latest bodies from the watches and from the operator's own writes."""

    clusters: ObjectCache = field(default_factory=ObjectCache)
    deployments: ObjectCache = field(default_factory=ObjectCache)
    children: ChildUids = field(default_factory=ChildUids)

    def cluster_deployments(self, sc: ServingCluster) -> dict[ObjectKey, dict[str, Any]]:
        labels = {LABEL_CLUSTER: sc.name, LABEL_MANAGED_BY: MANAGED_BY}
        return {
            ObjectKey("apps/v1", "Deployment", sc.namespace, body["metadata"]["name"]): body
            for body in self.deployments.labelled(sc.namespace, labels)
        }
