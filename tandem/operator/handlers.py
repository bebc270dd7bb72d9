"""The kopf handlers: thin glue that renders, applies, prunes and reports status.

Every step is idempotent (server-side apply with one field manager), so create, update, resume
after a restart and the periodic resync all run the same `reconcile_body`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime
import fnmatch
import logging
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import kopf

from tandem.common.roles import LABEL_CLUSTER
from tandem.operator import metrics
from tandem.operator.api import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    GeneratedSecret,
    ManifestError,
    ServingCluster,
    ServingClusterStatus,
    parse_manifest,
)
from tandem.operator.autoscaling.deletion_cost import rank_before_reconcile
from tandem.operator.cache import ChildUids, ObjectCache
from tandem.operator.gateway_apply import apply_gateway
from tandem.operator.kinds import CHILD_KINDS
from tandem.operator.kube import Kube, KubeError
from tandem.operator.ownership import Dependency, dependencies, foreign_owner
from tandem.operator.peering import Leadership
from tandem.operator.reconcile_plan import (
    ObjectKey,
    children_selector,
    stale_children,
    with_owner,
)
from tandem.operator.render import (
    LABEL_MANAGED_BY,
    MANAGED_BY,
    Component,
    child_name,
    engine_key_secret,
    engine_key_secret_name,
    render,
)
from tandem.operator.status import (
    Blocker,
    aggregate_status,
    component_roles,
    kept_blockers,
    phase_event,
    status_changes,
    status_patch,
)
from tandem.operator.tokenizer import router_tokenizer

log = logging.getLogger("tandem.operator")

# API groups that may be absent from a cluster; their objects are skipped (and not pruned) then.
OPTIONAL_GROUPS = ("monitoring.coreos.com/", "keda.sh/", "inference.networking.k8s.io/")
FIRST_RETRY_DELAY_S = 1.0
RETRY_DELAY_S = 30.0
# ServingClusters a resync pass reconciles at once.
DEFAULT_RESYNC_CONCURRENCY = 8


class EventSink(Protocol):
    def __call__(
        self, body: Mapping[str, Any], *, type: str, reason: str, message: str
    ) -> None: ...


def retry_delay_s(retry: int) -> float:
    """Seconds before retrying a reconcile that failed `retry` times before this failure:
    min(RETRY_DELAY_S, FIRST_RETRY_DELAY_S x 2^retry), i.e. 1, 2, 4, ... 30 s.

    A first failure is usually a race (an object the API server has not caught up with, another
    replica's write) that is gone a second later; a long first delay would also hold back the
    replica that takes over, since kopf keeps the delay in the object for whichever replica is
    active."""
    return min(RETRY_DELAY_S, FIRST_RETRY_DELAY_S * 2.0 ** min(retry, 16))


def kopf_event(body: Mapping[str, Any], *, type: str, reason: str, message: str) -> None:
    """Post a Kubernetes Event about the ServingCluster through kopf's event poster."""
    kopf.event(body, type=type, reason=reason, message=message)  # type: ignore[arg-type]


def current_status(body: Mapping[str, Any]) -> ServingClusterStatus:
    """The status as stored (an unreadable one counts as empty)."""
    try:
        return ServingClusterStatus.model_validate(body.get("status") or {})
    except ValueError:
        return ServingClusterStatus()


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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


def ensure_engine_key(
    kube: Kube, body: Mapping[str, Any], sc: ServingCluster
) -> tuple[ServingCluster, Blocker | None]:
    """Create the engine key Secret once, with a random key, and record its uid in status
    (returned in `sc` too, so the pods rendered next carry it and never roll for it later).

    The Secret is only ever created, never read: a name already taken is ours when status
    recorded it (the API server refuses a second create either way), else a conflict."""
    if not sc.spec.router.auth.engine_key:
        return sc, None
    name = engine_key_secret_name(sc)
    recorded = sc.status.engine_key_secret
    secret = with_owner(engine_key_secret(sc, secrets.token_urlsafe(32)), body)
    created = kube.create(secret)
    if created is not None:
        generated = GeneratedSecret(name=name, uid=created["metadata"]["uid"])
        kube.patch_status(
            API_VERSION, KIND, sc.namespace, sc.name,
            {"engineKeySecret": generated.model_dump()},
        )  # fmt: skip
        status = sc.status.model_copy(update={"engine_key_secret": generated})
        return sc.model_copy(update={"status": status}), None
    if recorded is not None and recorded.name == name:
        return sc, None
    return sc, Blocker(
        "Conflict",
        f"Secret/{name} exists but was not generated by Tandem for this ServingCluster; it is "
        "left alone (delete it, and Tandem generates the engine key)",
    )


def missing_dependencies(kube: Kube, sc: ServingCluster) -> list[Dependency]:
    """The referenced Secrets and PVCs that do not exist. A Secret is probed with a dry-run
    create (AlreadyExists means it is there), so the operator needs no right to read Secrets."""
    missing = []
    for dependency in dependencies(sc):
        if dependency.kind == "Secret":
            probe = {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": dependency.name, "namespace": sc.namespace},
            }
            exists = kube.create(probe, dry_run=True) is None
        else:
            exists = kube.get("v1", dependency.kind, sc.namespace, dependency.name) is not None
        if not exists:
            missing.append(dependency)
    return missing


def reconcile_blockers(
    kube: Kube, sc: ServingCluster, outcome: ApplyOutcome, engine_key: Blocker | None
) -> list[Blocker]:
    """Conflicts and missing dependencies of this reconcile, as Degraded reasons."""
    blockers = [
        Blocker("Conflict", f"{key} exists and is {why}; Tandem leaves it alone")
        for key, why in outcome.conflicts
    ]
    if engine_key is not None:
        blockers.append(engine_key)
    blockers += [
        Blocker("DependencyMissing", d.missing_message(sc.namespace))
        for d in missing_dependencies(kube, sc)
    ]
    return blockers


@dataclass
class Caches:
    """Latest bodies from the watches and from the operator's own writes (cache.py)."""

    clusters: ObjectCache = field(default_factory=ObjectCache)
    deployments: ObjectCache = field(default_factory=ObjectCache)
    children: ChildUids = field(default_factory=ChildUids)

    def cluster_deployments(self, sc: ServingCluster) -> dict[ObjectKey, dict[str, Any]]:
        labels = {LABEL_CLUSTER: sc.name, LABEL_MANAGED_BY: MANAGED_BY}
        return {
            ObjectKey("apps/v1", "Deployment", sc.namespace, body["metadata"]["name"]): body
            for body in self.deployments.labelled(sc.namespace, labels)
        }


def read_deployments(
    kube: Kube, sc: ServingCluster, live: Mapping[ObjectKey, dict[str, Any]] | None = None
) -> dict[Component, dict[str, Any] | None]:
    """The pool Deployments by role: from `live` (apply replies, the watch cache) when it holds
    every one, else from one LIST by the children's label selector."""
    keys = {
        role: ObjectKey("apps/v1", "Deployment", sc.namespace, child_name(sc, role))
        for role in component_roles(sc)
    }
    if live is None or not all(key in live for key in keys.values()):
        listed = kube.list("apps/v1", "Deployment", sc.namespace, children_selector(sc.name))
        live = {ObjectKey.of(obj): obj for obj in listed}
    return {role: live.get(key) for role, key in keys.items()}


_status_locks: dict[tuple[str, str], threading.RLock] = {}
_status_locks_guard = threading.Lock()


def status_lock(namespace: str, name: str) -> threading.RLock:
    """One lock per ServingCluster: handler threads and the child watch write its status in turn,
    so each compares with the status the previous writer left and announces a change once."""
    with _status_locks_guard:
        return _status_locks.setdefault((namespace, name), threading.RLock())


def report_status(
    kube: Kube,
    body: Mapping[str, Any],
    sc: ServingCluster,
    events: EventSink,
    apply_error: str | None = None,
    observed_generation: int | None = None,
    applied: int | None = None,
    blockers: list[Blocker] | None = None,
    live: Mapping[ObjectKey, dict[str, Any]] | None = None,
    fresh: Mapping[str, Any] | None = None,
    caches: Caches | None = None,
) -> str | None:
    """Aggregate children into status, patch it when it changed, and post Events for a newly
    applied generation and for a phase change. None when the object is gone.

    `fresh` is the ServingCluster just read (else it is read here, under the lock); `live` the
    children the apply returned (else the Deployments are listed). The patch's reply goes into
    `caches`, so a refresh never compares with a status older than this one."""
    with status_lock(sc.namespace, sc.name):
        if fresh is None:
            fresh = kube.get(API_VERSION, KIND, sc.namespace, sc.name)
        if fresh is None:
            return None
        current = sc.model_copy(update={"status": current_status(fresh)})
        status = aggregate_status(
            current,
            read_deployments(kube, sc, live),
            now_rfc3339(),
            apply_error,
            observed_generation,
            blockers,
        )
        metrics.record_pools(sc.namespace, sc.name, status)
        patch = status_patch(status)
        if status_changes(fresh.get("status") or {}, patch):
            stored = kube.patch_status(API_VERSION, KIND, sc.namespace, sc.name, patch)
            if caches is not None and stored is not None:
                caches.clusters.put(stored)
        before = " ".join(b.message for b in kept_blockers(current.status.conditions))
        for blocker in blockers or []:
            if blocker.message not in before:
                events(body, type="Warning", reason=blocker.reason, message=blocker.message)
        if applied is not None and observed_generation != current.status.observed_generation:
            events(
                body,
                type="Normal",
                reason="Applied",
                message=f"generation {observed_generation}: applied {applied} objects",
            )
            tokenizer = router_tokenizer(sc)
            if not tokenizer.exact:
                events(body, type="Warning", reason="ApproximateRouting", message=tokenizer.message)
        assert status.phase is not None
        transition = phase_event(current.status.phase, status.phase, status.conditions)
        if transition:
            type_, reason, message = transition
            events(body, type=type_, reason=reason, message=message)
        return status.phase


def invalid_spec_status(problems: list[str], generation: int | None) -> dict[str, Any]:
    """Status of an object the API server accepted but the operator cannot render."""
    message = "; ".join(problems)
    return {
        "observedGeneration": generation,
        "phase": "Degraded",
        "conditions": [
            {"type": "Ready", "status": "False", "reason": "InvalidSpec", "message": message,
             "lastTransitionTime": now_rfc3339(), "observedGeneration": generation},
            {"type": "Degraded", "status": "True", "reason": "InvalidSpec", "message": message,
             "lastTransitionTime": now_rfc3339(), "observedGeneration": generation},
        ],
    }  # fmt: skip


@metrics.observe_reconcile
def reconcile_body(
    kube: Kube,
    body: Mapping[str, Any],
    events: EventSink = kopf_event,
    full: bool = False,
    caches: Caches | None = None,
    retry: int = 0,
) -> str | None:
    """Render, apply, prune and report one ServingCluster; returns its phase (None if it is gone).

    Stale children are looked for when the spec changed (`needs_prune`) or when `full` (resync).

    Raises kopf.PermanentError for a spec that cannot be rendered (retrying will not help) and
    kopf.TemporaryError when the API server refused or failed an apply (retried after
    `retry_delay_s(retry)`, `retry` being the failures before this one).
    """
    meta = body["metadata"]
    # Held for the whole reconcile: a child-change refresh meanwhile would report the children
    # half applied (and LIST the ones not applied yet); it waits for this one's report instead.
    with status_lock(meta["namespace"], meta["name"]):
        return _reconcile(kube, body, events, full, caches, retry)


def _reconcile(
    kube: Kube,
    body: Mapping[str, Any],
    events: EventSink,
    full: bool,
    caches: Caches | None,
    retry: int,
) -> str | None:
    generation = body.get("metadata", {}).get("generation")
    try:
        sc = parse_manifest(dict(body))
    except ManifestError as exc:
        events(body, type="Warning", reason="InvalidSpec", message=str(exc))
        meta = body["metadata"]
        kube.patch_status(
            API_VERSION,
            KIND,
            meta["namespace"],
            meta["name"],
            invalid_spec_status(exc.problems, generation),
        )
        raise kopf.PermanentError(f"invalid ServingCluster: {exc}") from None
    try:
        sc, engine_key = ensure_engine_key(kube, body, sc)
        spec_changed = needs_prune(generation, sc.status.observed_generation)
        if spec_changed:  # an edit may lower a pool: rank its pods by cache first
            cached = caches.cluster_deployments(sc) if caches else None
            rank_before_reconcile(kube, sc, read_deployments(kube, sc, cached))
        prune = full or spec_changed
        outcome = apply_children(kube, body, sc, prune, caches.children if caches else None)
        if sc.spec.gateway is not None:
            apply_gateway(kube, sc.namespace, sc.spec.gateway.name)
    except KubeError as exc:
        message = f"applying children failed: {exc}"
        events(body, type="Warning", reason="ApplyFailed", message=message)
        report_status(
            kube,
            body,
            sc,
            events,
            apply_error=message,
            observed_generation=sc.status.observed_generation,
        )
        raise kopf.TemporaryError(message, delay=retry_delay_s(retry)) from None
    blockers = reconcile_blockers(kube, sc, outcome, engine_key)
    live: Mapping[ObjectKey, dict[str, Any]] = outcome.live
    fresh = None
    if caches is not None:
        # The ServingCluster as last seen (its watch and our own status patches), as a refresh
        # reads it; absent, report_status reads it.
        fresh = caches.clusters.get(sc.namespace, sc.name)
        for key, obj in outcome.live.items():
            if key.kind == "Deployment":
                caches.deployments.put(obj)
        # The newer of each apply reply and what the watch delivered since (a status change
        # whose refresh waited for this reconcile).
        live = caches.cluster_deployments(sc)
    if outcome.pruned:
        pruned = ", ".join(map(str, outcome.pruned))
        events(
            body,
            type="Normal",
            reason="Pruned",
            message=f"deleted objects the spec no longer asks for: {pruned}",
        )
    if outcome.skipped:
        log.info(
            "%s/%s: skipped %s (API not served)",
            sc.namespace,
            sc.name,
            ", ".join(map(str, outcome.skipped)),
        )
    return report_status(
        kube,
        body,
        sc,
        events,
        observed_generation=generation,
        applied=len(outcome.applied),
        blockers=blockers,
        live=live,
        fresh=fresh,
        caches=caches,
    )


def report_failure(
    kube: Kube, body: Mapping[str, Any], exc: BaseException, events: EventSink
) -> str:
    """An unexpected reconcile failure as a Warning Event and a Degraded condition (never only a
    log line); returns the message. Reporting that fails too is logged, not raised."""
    meta = body.get("metadata", {})
    message = f"reconcile failed: {exc.__class__.__name__}: {exc}"
    log.error("%s/%s: %s", meta.get("namespace"), meta.get("name"), message, exc_info=exc)
    try:
        events(body, type="Warning", reason="ReconcileFailed", message=message)
        sc = parse_manifest(dict(body))
        report_status(kube, body, sc, events, blockers=[Blocker("ReconcileFailed", message)])
    except Exception as report_exc:  # the API server may be what failed
        log.warning("%s/%s: cannot report the failure: %s", meta.get("namespace"),
                    meta.get("name"), report_exc)  # fmt: skip
    return message


def reconcile_reporting(
    kube: Kube,
    body: Mapping[str, Any],
    events: EventSink = kopf_event,
    full: bool = False,
    caches: Caches | None = None,
    retry: int = 0,
) -> str | None:
    """`reconcile_body`, with any unexpected exception reported (report_failure) and turned
    into a kopf.TemporaryError, so kopf retries it after `retry_delay_s(retry)`."""
    try:
        return reconcile_body(kube, body, events, full, caches, retry)
    except (kopf.TemporaryError, kopf.PermanentError):
        raise
    except Exception as exc:
        message = report_failure(kube, body, exc, events)
        raise kopf.TemporaryError(message, delay=retry_delay_s(retry)) from exc


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


# --- registration ------------------------------------------------------------------------------


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
