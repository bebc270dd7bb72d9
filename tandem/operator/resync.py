"""The periodic resync: every ServingCluster reconciled again (drift repair, autoscaling)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import fnmatch
import logging
from collections.abc import Callable, Sequence
from typing import Any

import kopf

from tandem.operator.api import API_VERSION, KIND, PLURAL
from tandem.operator.cache import Caches
from tandem.operator.kube import Kube
from tandem.operator.peering import Leadership
from tandem.operator.reconcile import reconcile_reporting
from tandem.operator.status_report import EventSink, kopf_event

log = logging.getLogger("tandem.operator")

# ServingClusters a resync pass reconciles at once.
DEFAULT_RESYNC_CONCURRENCY = 8


def list_serving_clusters(kube: Kube, namespaces: Sequence[str]) -> list[dict[str, Any]]:
    """ServingClusters in the watched namespaces (every namespace when none; glob patterns allowed)."""
    if not namespaces or any(set(ns) & set("*?[") for ns in namespaces):
        listing = kube.request("GET", f"/apis/{API_VERSION}/{PLURAL}")
        items = listing.get("items", []) if listing else []
        if namespaces:
            items = [
                i
                for i in items
                if any(fnmatch.fnmatchcase(i["metadata"]["namespace"], ns) for ns in namespaces)
            ]
    else:
        items = []
        for namespace in namespaces:
            listing = kube.request("GET", f"/apis/{API_VERSION}/namespaces/{namespace}/{PLURAL}")
            items += listing.get("items", []) if listing else []
    return [{**item, "apiVersion": API_VERSION, "kind": KIND} for item in items]


def resync_once(
    kube: Kube,
    namespaces: Sequence[str],
    events: EventSink = kopf_event,
    concurrency: int = DEFAULT_RESYNC_CONCURRENCY,
    caches: Caches | None = None,
) -> int:
    """Reconcile every ServingCluster once (drift repair, autoscaler decisions), `concurrency`
    of them at a time; returns how many were reconciled.

    Each reconcile mostly waits on the API server, so a pass over N clusters takes about
    N x (one reconcile) / concurrency; the bound keeps a pass from queueing hundreds of requests
    at once in front of the API server (and of kopf's own handlers, which share it)."""

    def one(body: dict[str, Any]) -> bool:
        try:
            reconcile_reporting(kube, body, events, full=True, caches=caches)
        except (kopf.TemporaryError, kopf.PermanentError) as exc:
            meta = body["metadata"]
            log.warning("%s/%s: resync failed: %s", meta["namespace"], meta["name"], exc)
            return False
        return True

    bodies = [
        body
        for body in list_serving_clusters(kube, namespaces)
        if not body["metadata"].get("deletionTimestamp")
    ]
    with concurrent.futures.ThreadPoolExecutor(
        max_workers=max(1, concurrency), thread_name_prefix="resync"
    ) as pool:
        return sum(pool.map(one, bodies))


async def resync_forever(
    client: Callable[[], Kube],
    period_s: float,
    namespaces: Sequence[str],
    leadership: Leadership,
    concurrency: int = DEFAULT_RESYNC_CONCURRENCY,
    caches: Caches | None = None,
) -> None:
    """Resync every `period_s` on the active replica (a standby skips its turn); a failed pass
    is logged and the loop goes on (each object's own failure is already reported on it by
    `resync_once`)."""
    while True:
        await asyncio.sleep(period_s)
        if not leadership.active:
            continue
        try:
            await asyncio.to_thread(
                resync_once, client(), namespaces, kopf_event, concurrency, caches
            )
        except Exception as exc:
            log.error("resync: pass failed: %s: %s", exc.__class__.__name__, exc, exc_info=exc)
