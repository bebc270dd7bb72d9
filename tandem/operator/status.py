"""Pure status aggregation: child Deployments → per-pool counts, phase and conditions."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

from tandem.operator.api import ServingCluster, pool_replicas
from tandem.operator.api_status import (
    AutoscalingStatus,
    Condition,
    PoolStatus,
    ServingClusterStatus,
)
from tandem.operator.common_render import Component, endpoint, rendered_roles
from tandem.operator.tokenizer import router_tokenizer

Phase = Literal["Pending", "Progressing", "Ready", "Degraded"]
CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "ExactTokenization", "ScalingLimited")
# Conditions the autoscaler writes; dropped here once autoscaling is turned off.
AUTOSCALER_CONDITION_TYPES = ("ScalingLimited", "MetricsUnavailable", "ScalingActive")
# Reasons of a Degraded condition found while reconciling rather than read from the children:
# a status refresh after a child changed keeps them until the next reconcile decides again.
BLOCKER_REASONS = ("Conflict", "DependencyMissing", "ReconcileFailed")
# Reasons on a Deployment's Progressing condition while its newest ReplicaSet is still rolling out.
_ROLLING_REASONS = {"NewReplicaSetCreated", "FoundNewReplicaSet", "ReplicaSetUpdated"}


class DeploymentState(StrEnum):
    """Where one component's Deployment stands."""

    MISSING = "missing"  # not created yet
    FAILED = "failed"  # rollout deadline exceeded, or pods cannot be created
    ROLLING = "rolling"  # a new template still rolling out
    SCALING = "scaling"  # on the current template, pods still starting (scale-up, a replaced pod)
    SHORT = "short"  # rolled out, but below minimum availability (crashes, evictions)
    READY = "ready"


@dataclass(frozen=True)
class PoolHealth:
    role: Component
    state: DeploymentState
    status: PoolStatus
    detail: str = ""


def _condition(deployment: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    for condition in deployment.get("status", {}).get("conditions") or []:
        if condition.get("type") == kind:
            return condition  # type: ignore[no-any-return]
    return None


def pool_status(deployment: Mapping[str, Any] | None, desired: int | None = None) -> PoolStatus:
    """Counts of one Deployment; `desired` defaults to its spec.replicas."""
    if deployment is None:
        want = desired or 0
        return PoolStatus(desired=want, ready=0, updated=0, summary=f"0/{want}")
    want = deployment.get("spec", {}).get("replicas", 1) if desired is None else desired
    observed = deployment.get("status", {})
    ready = int(observed.get("readyReplicas") or 0)
    return PoolStatus(
        desired=want,
        ready=ready,
        updated=int(observed.get("updatedReplicas") or 0),
        summary=f"{ready}/{want}",
    )


def pool_health(
    role: Component, deployment: Mapping[str, Any] | None, desired: int = 0
) -> PoolHealth:
    """Classify one Deployment (see DeploymentState); `desired` counts a Deployment not created yet."""
    status = pool_status(deployment, desired if deployment is None else None)
    if deployment is None:
        return PoolHealth(
            role, DeploymentState.MISSING, status, f"{role} Deployment not created yet"
        )
    observed = deployment.get("status", {})
    progressing = _condition(deployment, "Progressing")
    failure = _condition(deployment, "ReplicaFailure")
    stuck = None
    if progressing and progressing.get("reason") == "ProgressDeadlineExceeded":
        stuck = progressing.get("message", "rollout stuck")
    elif failure and failure.get("status") == "True":
        stuck = failure.get("message", "pods cannot be created")
    if stuck is not None:
        return PoolHealth(role, DeploymentState.FAILED, status, f"{role}: {stuck}")
    generation = deployment.get("metadata", {}).get("generation", 0)
    total = int(observed.get("replicas") or 0)
    rolling = (
        int(observed.get("observedGeneration") or 0) < generation
        or status.updated < status.desired
        or total > status.updated
        or (progressing is not None and progressing.get("reason") in _ROLLING_REASONS)
    )
    if status.ready >= status.desired and not rolling:
        return PoolHealth(role, DeploymentState.READY, status)
    if rolling:
        return PoolHealth(
            role, DeploymentState.ROLLING, status, f"{role} {status.summary} ready, rolling out"
        )
    available = _condition(deployment, "Available")
    if available is not None and available.get("status") == "False":
        return PoolHealth(
            role,
            DeploymentState.SHORT,
            status,
            f"{role} {status.summary} ready, below minimum availability",
        )
    return PoolHealth(
        role, DeploymentState.SCALING, status, f"{role} {status.summary} ready, pods starting"
    )


def component_roles(sc: ServingCluster) -> tuple[Component, ...]:
    return (*rendered_roles(sc), "router")


def desired_replicas(sc: ServingCluster, role: Component) -> int:
    return sc.spec.router.replicas if role == "router" else pool_replicas(sc, role)


@dataclass(frozen=True)
class Blocker:
    """A reconcile finding that degrades the cluster: reason (one of BLOCKER_REASONS), message."""

    reason: str
    message: str


def kept_blockers(previous: list[Condition]) -> list[Blocker]:
    """The blockers a previous reconcile recorded in the Degraded condition."""
    return [
        Blocker(c.reason, c.message)
        for c in previous
        if c.type == "Degraded" and c.status == "True" and c.reason in BLOCKER_REASONS
    ]


def phase_of(healths: list[PoolHealth], apply_error: str | None) -> Phase:
    """Degraded: an apply failed, a rollout failed, or a rolled-out pool fell below its minimum
    availability (the Deployment's Available condition is False).
    Ready: every component has all desired pods ready on the current template.
    Pending: no pod ready anywhere yet (children missing or engines still loading the model).
    Progressing: otherwise (rolling out or scaling)."""
    states = {h.state for h in healths}
    if apply_error or DeploymentState.FAILED in states or DeploymentState.SHORT in states:
        return "Degraded"
    if states <= {DeploymentState.READY}:
        return "Ready"
    if all(h.status.ready == 0 for h in healths):
        return "Pending"
    return "Progressing"


def _scaling_limited_when_disabled(sc: ServingCluster) -> tuple[str, str, str] | None:
    """ScalingLimited while autoscaling is off; when it is on, the autoscaler owns the condition
    (it knows whether a pool wanted more than its maximum)."""
    if sc.spec.autoscaling.enabled:
        return None
    return "False", "AutoscalingDisabled", "autoscaling is off; pools run spec replicas"


def conditions_for(
    sc: ServingCluster,
    healths: list[PoolHealth],
    phase: Phase,
    apply_error: str | None,
    blockers: list[Blocker] | None = None,
) -> dict[str, tuple[str, str, str]]:
    """type → (status, reason, message) of the conditions this module owns: Ready, Progressing,
    Degraded, ExactTokenization, and ScalingLimited while autoscaling is off."""
    summary = ", ".join(f"{h.role} {h.status.summary}" for h in healths)
    failed = [h.detail for h in healths if h.state == DeploymentState.FAILED]
    short = [h.detail for h in healths if h.state == DeploymentState.SHORT]
    rolling = [h for h in healths if h.state in {DeploymentState.ROLLING, DeploymentState.MISSING}]
    scaling = [h for h in healths if h.state == DeploymentState.SCALING]
    out: dict[str, tuple[str, str, str]] = {}
    if phase == "Ready":
        out["Ready"] = ("True", "AllPodsReady", f"all pools ready: {summary}")
    elif phase == "Pending":
        out["Ready"] = (
            "False",
            "PodsStarting",
            f"waiting for pods (engines load the model first): {summary}",
        )
    else:
        out["Ready"] = ("False", "PodsNotReady", f"not every pod is ready: {summary}")
    if apply_error:
        out["Degraded"] = ("True", "ApplyFailed", apply_error)
    elif blockers:
        out["Degraded"] = ("True", blockers[0].reason, "; ".join(b.message for b in blockers))
    elif failed:
        out["Degraded"] = ("True", "RolloutFailed", "; ".join(failed))
    elif short:
        out["Degraded"] = ("True", "PodsUnavailable", "; ".join(short))
    else:
        out["Degraded"] = ("False", "AsExpected", "no failures")
    if rolling:
        roles = ", ".join(f"{h.role} {h.status.summary}" for h in rolling)
        out["Progressing"] = ("True", "RollingOut", f"rolling out: {roles}")
    elif scaling:
        roles = ", ".join(f"{h.role} {h.status.summary}" for h in scaling)
        out["Progressing"] = ("True", "PodsStarting", f"pods starting: {roles}")
    elif failed:
        out["Progressing"] = ("False", "ProgressDeadlineExceeded", "; ".join(failed))
    else:
        out["Progressing"] = ("False", "RolloutComplete", "every pool runs the current spec")
    out["ExactTokenization"] = exact_tokenization(sc)
    scaling_limited = _scaling_limited_when_disabled(sc)
    if scaling_limited:
        out["ScalingLimited"] = scaling_limited
    return out


def exact_tokenization(sc: ServingCluster) -> tuple[str, str, str]:
    """Whether the router has the model's tokenizer (prefix keys equal to the engines' blocks)."""
    source = router_tokenizer(sc)
    if source.exact:
        reason = {"configured": "RouterTokenizer", "hub": "FetchedFromHub", "volume": "ModelVolume"}
        return "True", reason[source.kind], source.message
    if source.path is not None:
        return "False", "ChatTemplateUnreadable", source.message
    return "False", "NoTokenizerSource", source.message


def merge_conditions(
    previous: list[Condition],
    wanted: Mapping[str, tuple[str, str, str]],
    generation: int | None,
    now: str,
    drop: tuple[str, ...] = (),
) -> list[Condition]:
    """`wanted` conditions first, then the other previous ones (another writer's, such as the
    autoscaler's) unchanged unless listed in `drop`. lastTransitionTime is kept while a
    condition's status does not change."""
    before = {c.type: c for c in previous}
    merged: list[Condition] = []
    for kind in [k for k in CONDITION_TYPES if k in wanted] + [
        k for k in wanted if k not in CONDITION_TYPES
    ]:
        status, reason, message = wanted[kind]
        old = before.get(kind)
        since = old.last_transition_time if old is not None and old.status == status else now
        merged.append(
            Condition(
                type=kind,
                status=status,
                reason=reason,
                message=message,
                last_transition_time=since,
                observed_generation=generation,
            )
        )
    merged += [c for c in previous if c.type not in wanted and c.type not in drop]
    return merged


def aggregate_status(
    sc: ServingCluster,
    deployments: Mapping[Component, Mapping[str, Any] | None],
    now: str,
    apply_error: str | None = None,
    observed_generation: int | None = None,
    blockers: list[Blocker] | None = None,
) -> ServingClusterStatus:
    """The ServingCluster's status from its child Deployments (keyed by role).

    `observed_generation` is the generation the operator last applied (kept from the previous
    status when this is only a refresh after a child changed). `blockers` (conflicts, missing
    dependencies, failures) make it Degraded; None keeps the ones recorded last time."""
    if blockers is None:
        blockers = kept_blockers(sc.status.conditions)
    healths = [
        pool_health(role, deployments.get(role), desired_replicas(sc, role))
        for role in component_roles(sc)
    ]
    generation = (
        observed_generation if observed_generation is not None else sc.status.observed_generation
    )
    phase = "Degraded" if blockers else phase_of(healths, apply_error)
    wanted = conditions_for(sc, healths, phase, apply_error, blockers)
    latest = sc.metadata.generation
    if latest is not None and generation != latest and not apply_error and not blockers:
        # The children reflect an older spec (or none yet): not Ready until this one is applied.
        phase = "Pending" if phase == "Pending" else "Progressing"
        wanted["Ready"] = ("False", "SpecNotApplied", f"generation {latest} is being applied")
        wanted["Progressing"] = ("True", "Applying", f"applying generation {latest}")
    by_role = {h.role: h.status for h in healths}
    return ServingClusterStatus(
        observed_generation=generation,
        phase=phase,
        endpoint=endpoint(sc),
        prefill=by_role.get("prefill"),
        decode=by_role.get("decode"),
        router=by_role.get("router"),
        conditions=merge_conditions(
            sc.status.conditions,
            wanted,
            generation,
            now,
            drop=() if sc.spec.autoscaling.enabled else AUTOSCALER_CONDITION_TYPES,
        ),
        autoscaling=sc.status.autoscaling or AutoscalingStatus(),
        engine_key_secret=sc.status.engine_key_secret,
    )


def status_patch(status: ServingClusterStatus) -> dict[str, Any]:
    """The status as a merge patch; the autoscaler's own section is left to the autoscaler."""
    patch = status.model_dump(
        mode="json", by_alias=True, exclude_none=True, exclude={"autoscaling"}
    )
    for role in ("prefill", "decode", "router"):
        patch.setdefault(role, None)  # a pool that is no longer rendered disappears from status
    return patch


def status_changes(stored: Mapping[str, Any], patch: Mapping[str, Any]) -> bool:
    """Whether merging `patch` into the `stored` status would change it: some key differs, where
    a None in the patch (a deletion) differs only from a key that is present."""
    return any(
        key in stored if value is None else stored.get(key) != value for key, value in patch.items()
    )


def phase_event(
    old: str | None, new: Phase, conditions: list[Condition]
) -> tuple[str, str, str] | None:
    """(type, reason, message) of the Event announcing a phase change, or None when unchanged."""
    if old == new:
        return None
    by_type = {c.type: c for c in conditions}
    if new == "Degraded":
        return "Warning", "Degraded", by_type["Degraded"].message
    if new == "Ready":
        return "Normal", "Ready", by_type["Ready"].message
    source = by_type["Progressing"] if new == "Progressing" else by_type["Ready"]
    return "Normal", new, source.message
