"""The kopf handlers: thin glue that renders, applies, prunes and reports status.

Every step is idempotent (server-side apply with one field manager), so create, update, resume
after a restart and the periodic resync all run the same `reconcile_body`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import kopf

from tandem.common.roles import LABEL_CLUSTER
from tandem.operator import metrics
from tandem.operator.api import API_VERSION, GROUP, KIND, PLURAL, VERSION
from tandem.operator.cache import Caches
from tandem.operator.common_render import LABEL_MANAGED_BY, MANAGED_BY
from tandem.operator.gateway_apply import apply_gateway
from tandem.operator.kube import Kube, KubeError
from tandem.operator.peering import Leadership
from tandem.operator.reconcile import reconcile_reporting
from tandem.operator.refresh import CoalescedRefresh, refresh_owner_status
from tandem.operator.resync import DEFAULT_RESYNC_CONCURRENCY, resync_forever
from tandem.operator.status_report import kopf_event

log = logging.getLogger("tandem.operator")


def leave_gateway(kube: Kube, meta: Mapping[str, Any], gateway: str) -> None:
    """A deleted member's shared gateway drops its model now, not at the others' next reconcile
    (its owner reference goes with it; the last member's takes the gateway away)."""
    try:
        apply_gateway(kube, meta.get("namespace", ""), gateway, meta.get("name"))
    except KubeError as exc:
        log.warning("gateway %s not updated after a member left: %s", gateway, exc)


_kube: Kube | None = None


def kube() -> Kube:
    """The process-wide client, created on first use (after kopf has logged in)."""
    global _kube
    if _kube is None:
        _kube = Kube()
    return _kube


def register(
    registry: kopf.OperatorRegistry,
    resync_seconds: float = 300.0,
    client: Callable[[], Kube] = kube,
    namespaces: Sequence[str] = (),
    leadership: Leadership | None = None,
    resync_concurrency: int = DEFAULT_RESYNC_CONCURRENCY,
) -> None:
    """Register the ServingCluster handlers, the child-Deployment watch and the periodic resync
    into `registry`. The resync is a plain background loop rather than a kopf timer, because a
    timer puts a finalizer on every object (deleting one would then need a running operator);
    kopf's peering pause does not reach it, so it follows `leadership` (standalone: always)."""
    leader = leadership or Leadership("standalone", 0)
    caches = Caches()
    refresher = CoalescedRefresh(
        lambda namespace, name, reapply: refresh_owner_status(
            client(), namespace, name, reapply=reapply, caches=caches, wait=False
        )
    )

    @kopf.on.resume(GROUP, VERSION, PLURAL, id="reconcile", registry=registry)
    @kopf.on.create(GROUP, VERSION, PLURAL, id="reconcile", registry=registry)
    @kopf.on.update(GROUP, VERSION, PLURAL, field="spec", id="reconcile", registry=registry)
    def reconcile(body: kopf.Body, retry: int, **_: Any) -> None:
        reconcile_reporting(client(), body, caches=caches, retry=retry)

    @kopf.on.event(GROUP, VERSION, PLURAL, id="cluster_seen", registry=registry)
    async def cluster_seen(event: kopf.RawEvent, body: kopf.Body, **_: Any) -> None:
        meta = body.get("metadata", {})
        if event.get("type") == "DELETED":
            caches.clusters.drop(meta.get("namespace", ""), meta.get("name", ""))
            caches.children.forget((meta.get("namespace", ""), meta.get("name", "")))
            gateway = (body.get("spec", {}).get("gateway") or {}).get("name")
            if gateway:
                await asyncio.to_thread(leave_gateway, client(), meta, gateway)
        else:
            caches.clusters.put({"apiVersion": API_VERSION, "kind": KIND, **body})

    @kopf.on.startup(id="resync", registry=registry)
    async def start_resync(memo: kopf.Memo, **_: Any) -> None:
        memo["resync"] = asyncio.create_task(
            resync_forever(client, resync_seconds, namespaces, leader, resync_concurrency, caches)
        )
        memo["leadership"] = asyncio.create_task(leader.follow(client))

    @kopf.on.cleanup(id="stop_resync", registry=registry)
    async def stop_resync(memo: kopf.Memo, **_: Any) -> None:
        for name in ("resync", "leadership"):
            task = memo.get(name)
            if isinstance(task, asyncio.Task):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await refresher.stop()

    @kopf.on.delete(GROUP, VERSION, PLURAL, optional=True, id="deleted", registry=registry)
    def deleted(body: kopf.Body, **_: Any) -> None:
        metrics.forget_cluster(body.metadata.namespace or "", body.metadata.name or "")
        kopf_event(body, type="Normal", reason="Deleting",
                   message="children are garbage-collected through their owner references; PVCs and Secrets are kept")  # fmt: skip

    @kopf.on.event(
        "apps",
        "v1",
        "deployments",
        labels={LABEL_MANAGED_BY: MANAGED_BY},
        id="child_changed",
        registry=registry,
    )
    async def child_changed(event: kopf.RawEvent, body: kopf.Body, **_: Any) -> None:
        owner = body.get("metadata", {}).get("labels", {}).get(LABEL_CLUSTER)
        namespace = body.get("metadata", {}).get("namespace")
        if event.get("type") == "DELETED":
            caches.deployments.drop(namespace or "", body.get("metadata", {}).get("name", ""))
        else:
            caches.deployments.put(body)
        if owner and namespace:
            refresher.request(namespace, owner, reapply=event.get("type") == "DELETED")
