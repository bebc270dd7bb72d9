"""Pure status of the autoscaler: `status.autoscaling.<pool>` and the ScalingLimited / MetricsUnavailable conditions."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tandem.operator.autoscaling.decision import Decision
from tandem.operator.autoscaling.signals import PoolSignals

SCALING_LIMITED = "ScalingLimited"
METRICS_UNAVAILABLE = "MetricsUnavailable"
SCALING_ACTIVE = "ScalingActive"
# Limits a user acts on (raise max, or the step); sitting at min while idle is not a limitation.
USER_LIMITS = ("TooManyReplicas", "ScaleUpLimit")


def pool_status(
    decision: Decision,
    signals: PoolSignals | None,
    ready: int,
    previous: Mapping[str, Any] | None,
    now: str,
) -> dict[str, Any]:
    """`status.autoscaling.<pool>`: replicas chosen, when they last changed, why, and every input
    of the decision (current and ready replicas, observed signals), so it can be replayed."""
    previous = previous or {}
    status: dict[str, Any] = {
        "replicas": decision.desired,
        "lastScaleTime": now if decision.changed else previous.get("lastScaleTime"),
        "reason": decision.message,
        "decision": decision.reason,
        "recommendation": decision.recommendation,
        "limit": decision.limit,
        "current": decision.current,
        "ready": ready,
        "lastEvaluationTime": now,
    }
    if signals is not None:
        status["observed"] = {
            "engines": signals.engines,
            "latencySeconds": signals.latency_s,
            "waiting": signals.waiting,
            "running": signals.running,
            "kvUsage": signals.kv_usage,
            "requestRate": signals.request_rate,
        }
    return status


def condition(
    type_: str, holds: bool, reason: str, message: str, previous: Mapping[str, Any] | None, now: str
) -> dict[str, Any]:
    status = "True" if holds else "False"
    unchanged = previous is not None and previous.get("status") == status
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": previous.get("lastTransitionTime") if unchanged and previous else now,
    }


def autoscaling_conditions(
    decisions: Iterable[Decision], existing: Sequence[Mapping[str, Any]], now: str
) -> list[dict[str, Any]]:
    """`status.conditions` with ScalingLimited, MetricsUnavailable and ScalingActive (True: this
    evaluation completed) set from this evaluation.

    Conditions of other types are kept as they are; a transition time moves only when the
    condition's status flips.
    """
    decisions = list(decisions)
    by_type = {c.get("type"): c for c in existing}
    limited = [d for d in decisions if d.limit in USER_LIMITS]
    unavailable = [d for d in decisions if d.reason == METRICS_UNAVAILABLE]
    scaling_limited = condition(
        SCALING_LIMITED,
        bool(limited),
        (limited[0].limit or "") if limited else "WithinLimits",
        "; ".join(d.message for d in limited)
        if limited
        else "every pool is inside its replica range",
        by_type.get(SCALING_LIMITED),
        now,
    )
    metrics_unavailable = condition(
        METRICS_UNAVAILABLE,
        bool(unavailable),
        "NoMetrics" if unavailable else "MetricsRead",
        "; ".join(d.message for d in unavailable)
        if unavailable
        else "Prometheus answered for every pool",
        by_type.get(METRICS_UNAVAILABLE),
        now,
    )
    scaling_active = condition(
        SCALING_ACTIVE,
        True,
        "Evaluated",
        "the autoscaler evaluated every pool",
        by_type.get(SCALING_ACTIVE),
        now,
    )
    replaced = {
        SCALING_LIMITED: scaling_limited,
        METRICS_UNAVAILABLE: metrics_unavailable,
        SCALING_ACTIVE: scaling_active,
    }
    conditions = [
        replaced.pop(c["type"]) if c.get("type") in replaced else dict(c) for c in existing
    ]
    return conditions + list(replaced.values())
