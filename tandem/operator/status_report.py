"""Reporting a ServingCluster's state: its status from the children, and its Events."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Mapping
from typing import Any, Protocol

import kopf

from tandem.operator import metrics
from tandem.operator.api import API_VERSION, KIND, ServingCluster
from tandem.operator.api_status import ServingClusterStatus
from tandem.operator.cache import Caches
from tandem.operator.common_render import Component, child_name
from tandem.operator.kube import Kube
from tandem.operator.reconcile_plan import ObjectKey, children_selector
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


class EventSink(Protocol):
    def __call__(
        self, body: Mapping[str, Any], *, type: str, reason: str, message: str
    ) -> None: ...


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
