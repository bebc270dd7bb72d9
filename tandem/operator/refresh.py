"""Status refreshes after a child changed, at most one pending or running per ServingCluster."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import kopf

from tandem.operator.api import API_VERSION, KIND
from tandem.operator.cache import Caches
from tandem.operator.kube import Kube, KubeError
from tandem.operator.manifest import ManifestError, parse_manifest
from tandem.operator.reconcile import reconcile_reporting
from tandem.operator.status_report import EventSink, kopf_event, report_status, status_lock

log = logging.getLogger("tandem.operator")


class ReconcileInProgress(Exception):
    """A refresh found the ServingCluster's reconcile running (and did not wait for it)."""


def refresh_owner_status(
    kube: Kube,
    namespace: str,
    cluster_name: str,
    events: EventSink = kopf_event,
    reapply: bool = False,
    caches: Caches | None = None,
    wait: bool = True,
) -> str | None:
    """Recompute a ServingCluster's status after one of its children changed (re-applying the
    children first when one was deleted behind the operator's back). None if it is gone.

    With `caches` (the watches' and our writes' latest bodies) a refresh that changes nothing
    sends no request at all; without, it reads the ServingCluster and LISTs its Deployments.
    Either way under the status lock, so it compares with the latest status this process wrote;
    with `wait` False, ReconcileInProgress when a reconcile holds it (the caller asks again)."""
    lock = status_lock(namespace, cluster_name)
    if not lock.acquire(blocking=wait):
        raise ReconcileInProgress(f"{namespace}/{cluster_name}")
    try:
        return _refresh(kube, namespace, cluster_name, events, reapply, caches)
    finally:
        lock.release()


def _refresh(
    kube: Kube,
    namespace: str,
    cluster_name: str,
    events: EventSink,
    reapply: bool,
    caches: Caches | None,
) -> str | None:
    body = caches.clusters.get(namespace, cluster_name) if caches is not None else None
    if body is None:
        body = kube.get(API_VERSION, KIND, namespace, cluster_name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    if reapply:
        return reconcile_reporting(kube, body, events, caches=caches)
    try:
        sc = parse_manifest(body)
    except ManifestError:
        return None  # the main handlers report invalid specs
    live = caches.cluster_deployments(sc) if caches is not None else None
    return report_status(kube, body, sc, events, live=live, fresh=body, caches=caches)


class CoalescedRefresh:
    """Child-change status refreshes, at most one pending or running per ServingCluster.

    A Deployment rolling out changes its status many times a second; every change asks for a
    refresh here, and the requests that arrive while one is waiting (`delay_s`) or running fold
    into a single next run (re-applying if any of them was a deletion). A refresh that finds the
    cluster's reconcile running (ReconcileInProgress) is asked for again after the next delay,
    holding no thread meanwhile."""

    def __init__(self, refresh: Callable[[str, str, bool], object], delay_s: float = 1.0):
        self.refresh = refresh
        self.delay_s = delay_s
        self.pending: dict[tuple[str, str], bool] = {}
        self.tasks: dict[tuple[str, str], asyncio.Task[None]] = {}

    def request(self, namespace: str, name: str, reapply: bool = False) -> None:
        key = (namespace, name)
        self.pending[key] = self.pending.get(key, False) or reapply
        if key not in self.tasks:
            self.tasks[key] = asyncio.get_running_loop().create_task(self._drain(key))

    async def _drain(self, key: tuple[str, str]) -> None:
        try:
            while key in self.pending:
                await asyncio.sleep(self.delay_s)
                reapply = self.pending.pop(key)
                try:
                    await asyncio.to_thread(self.refresh, key[0], key[1], reapply)
                except ReconcileInProgress:
                    self.pending[key] = self.pending.get(key, False) or reapply
                except (KubeError, kopf.TemporaryError, kopf.PermanentError) as exc:
                    log.warning("%s/%s: status refresh failed: %s", key[0], key[1], exc)
        finally:
            self.tasks.pop(key, None)

    async def stop(self) -> None:
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
