"""The pure scaling decision of one pool: signals + policy + recent history -> desired replicas.

Rules (n = current replicas; r = the pods that produced the observed metrics: the smaller of the
ready replicas and the engines Prometheus scrapes, at most n, and n when that is 0;
tol = tolerance; h = latency_scale_down_ratio):

1. Per signal, with ratio q = observed / target:
   - latency (prefill TTFT pQ, decode ITL pQ), q = latency / target_latency_s:
       q > 1 + tol  -> ceil(r * q)                   (grow in proportion to the breach)
       q < h        -> min(n, ceil(r * q / h))       (shrink only as far as latency stays under
                                                      h of its target: latency is convex in load)
       otherwise    -> n
   - queue, q = (waiting / r) / target_waiting_per_replica:
       q > 1 + tol  -> ceil(r * q), otherwise no vote (a short queue says nothing about how few
                                                      pods would do, so it only ever grows a pool)
   - KV usage (decode), q = mean kv_usage / max_kv_usage (linear in running sequences):
       |q - 1| <= tol -> n, otherwise ceil(r * q)
   A latency quantile is absent when no request finished in the window; it then recommends nothing.
2. The pool's recommendation is the largest signal recommendation (like HPA with several metrics);
   an idle pool (no finished, running or waiting request) recommends min; no signal -> n.
3. The recommendation is clamped to [min, max] (ScalingLimited: TooFewReplicas / TooManyReplicas).
4. Scale-up is immediate but one step grows the pool to at most
   max(ceil(n * scale_up_max_factor), n + scale_up_max_pods) (ScalingLimited: ScaleUpLimit).
5. Scale-down goes to the highest clamped recommendation of the last `scale_down_stabilization_s`
   seconds (HPA's stabilization window): it happens only if every recommendation in the window is
   lower than n, and only once the window has been observed in full without a metrics gap.
6. Missing metrics (Prometheus unreachable, or no engine of the pool scraped) hold n and restart
   the observation window. A current size outside [min, max] is brought inside at once.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.common.roles import Role
from tandem.operator.autoscaling.policy import PoolPolicy
from tandem.operator.autoscaling.signals import PoolSignals

Reason = Literal[
    "ScaledUp",
    "ScaledDown",
    "Steady",
    "Stabilizing",
    "MetricsUnavailable",
    "Asleep",
]
Limit = Literal["TooManyReplicas", "TooFewReplicas", "ScaleUpLimit"]


class ScalingMemory(BaseModel):
    """What one pool's decision remembers between evaluations (kept by the caller)."""

    model_config = ConfigDict(frozen=True)

    # Start of the current gap-free observation; None after a metrics gap or at start.
    observed_since: float | None = None
    # (time, clamped recommendation) pairs of the last stabilization window, oldest first.
    recommendations: tuple[tuple[float, int], ...] = ()


class Decision(BaseModel):
    """The outcome of one evaluation: the size to run and why, in words a person reads."""

    model_config = ConfigDict(frozen=True)

    pool: Role
    current: int
    desired: int
    recommendation: int  # clamped recommendation of this evaluation, before stabilization
    reason: Reason
    message: str
    limit: Limit | None = None
    # Each signal's own recommendation (latency, queue, kvUsage, idle), for status and tests.
    signals: dict[str, int] = Field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return self.desired != self.current


def _ceil(value: float) -> int:
    # Round first so float noise (e.g. 2.0000000001) never adds a pod.
    return math.ceil(round(value, 6))


def latency_recommendation(
    ratio: float, current: int, base: int, tolerance: float, scale_down_ratio: float
) -> int:
    """Rule 1, latency: grow with the breach, shrink only while latency stays under h of target."""
    if ratio > 1.0 + tolerance:
        return _ceil(base * ratio)
    if ratio < scale_down_ratio:
        return min(current, _ceil(base * ratio / scale_down_ratio))
    return current


def queue_recommendation(ratio: float, base: int, tolerance: float) -> int | None:
    """Rule 1, queue: votes only to grow a pool."""
    return _ceil(base * ratio) if ratio > 1.0 + tolerance else None


def proportional_recommendation(ratio: float, current: int, base: int, tolerance: float) -> int:
    """Rule 1, KV usage: n inside the tolerance band, ceil(base * ratio) outside it."""
    return current if abs(ratio - 1.0) <= tolerance else _ceil(base * ratio)


def signal_recommendations(
    policy: PoolPolicy, signals: PoolSignals, current: int, ready: int
) -> tuple[dict[str, int], list[str]]:
    """Rules 1-2 per signal: a recommendation per signal name, and a phrase describing each."""
    observed = min(ready, signals.engines)
    base = observed if 0 < observed <= current else current
    recommendations: dict[str, int] = {}
    phrases: list[str] = []
    if signals.idle:
        recommendations["idle"] = policy.min_replicas
        phrases.append("no requests in the window")
        return recommendations, phrases
    latency_name = "TTFT" if policy.pool == "prefill" else "ITL"
    quantile = f"p{round(policy.quantile * 100):d}"
    if policy.target_latency_s is not None and signals.latency_s is not None:
        rec = latency_recommendation(
            signals.latency_s / policy.target_latency_s,
            current,
            base,
            policy.tolerance,
            policy.latency_scale_down_ratio,
        )
        recommendations["latency"] = rec
        phrases.append(
            f"{latency_name} {quantile} {signals.latency_s:.3g}s vs target {policy.target_latency_s:.3g}s -> {rec}"
        )
    if policy.target_waiting_per_replica is not None:
        per_replica = signals.waiting / max(base, 1)
        vote = queue_recommendation(
            per_replica / policy.target_waiting_per_replica, base, policy.tolerance
        )
        if vote is not None:
            recommendations["queue"] = vote
            phrases.append(
                f"waiting {per_replica:.3g}/replica vs target {policy.target_waiting_per_replica:.3g} -> {vote}"
            )
    if policy.max_kv_usage is not None and signals.kv_usage is not None:
        rec = proportional_recommendation(
            signals.kv_usage / policy.max_kv_usage, current, base, policy.tolerance
        )
        recommendations["kvUsage"] = rec
        phrases.append(f"KV usage {signals.kv_usage:.0%} vs max {policy.max_kv_usage:.0%} -> {rec}")
    return recommendations, phrases


def _unavailable(policy: PoolPolicy, current: int, why: str) -> tuple[Decision, ScalingMemory]:
    """Rule 6: hold the size (inside [min, max]) and forget the window."""
    desired = min(max(current, policy.min_replicas), policy.max_replicas)
    decision = Decision(
        pool=policy.pool,
        current=current,
        desired=desired,
        recommendation=desired,
        reason="MetricsUnavailable",
        message=f"{policy.pool}: holding {desired} replicas, {why}",
    )
    return decision, ScalingMemory()


def decide(
    policy: PoolPolicy,
    signals: PoolSignals | None,
    current: int,
    ready: int,
    state: ScalingMemory,
    now: float,
    unavailable_reason: str = "Prometheus returned no metrics for the pool",
) -> tuple[Decision, ScalingMemory]:
    """One evaluation of rules 1-6; returns the decision and the state to pass next time."""
    if signals is None or signals.engines == 0:
        return _unavailable(policy, current, unavailable_reason)

    per_signal, phrases = signal_recommendations(policy, signals, current, ready)
    raw = max(per_signal.values()) if per_signal else current

    # Rule 3.
    limit: Limit | None = None
    recommendation = raw
    if raw > policy.max_replicas:
        recommendation, limit = policy.max_replicas, "TooManyReplicas"
    elif raw < policy.min_replicas:
        recommendation, limit = policy.min_replicas, "TooFewReplicas"

    observed_since = state.observed_since if state.observed_since is not None else now
    window_start = now - policy.scale_down_stabilization_s
    kept = tuple((t, n) for t, n in state.recommendations if t >= window_start)
    history = (*kept, (now, recommendation))
    new_state = ScalingMemory(observed_since=observed_since, recommendations=history)

    why = "; ".join(phrases) if phrases else "no signal configured"
    pool = policy.pool
    reason: Reason
    if current > policy.max_replicas or current < policy.min_replicas:
        # Rule 6, second half: a size outside the limits is corrected at once.
        desired = min(max(current, policy.min_replicas), policy.max_replicas)
        reason = "ScaledUp" if desired > current else "ScaledDown"
        message = f"{pool}: {current} -> {desired}, outside [min {policy.min_replicas}, max {policy.max_replicas}]"
    elif recommendation > current:
        # Rule 4.
        step_cap = max(
            math.ceil(current * policy.scale_up_max_factor), current + policy.scale_up_max_pods
        )
        desired, reason = min(recommendation, step_cap), "ScaledUp"
        if desired < recommendation:
            limit = "ScaleUpLimit"
        message = f"{pool}: {current} -> {desired}: {why}"
        if limit == "TooManyReplicas":
            message += f" (capped at max {policy.max_replicas}, wanted {raw})"
        elif limit == "ScaleUpLimit":
            message += f" (step limited, wanted {recommendation})"
    elif recommendation < current:
        # Rule 5.
        if now - observed_since < policy.scale_down_stabilization_s:
            desired = current
        else:
            desired = min(current, max(n for _, n in history))
        if desired < current:
            message, reason = f"{pool}: {current} -> {desired}: {why}", "ScaledDown"
        else:
            message = (
                f"{pool}: holding {current} (recommends {recommendation}; scale-down waits for "
                f"{policy.scale_down_stabilization_s:g}s of lower recommendations): {why}"
            )
            reason = "Stabilizing"
        if limit == "TooFewReplicas":
            message += f" (floored at min {policy.min_replicas}, wanted {raw})"
    else:
        desired, reason = current, "Steady"
        message = f"{pool}: steady at {current}: {why}"
        if limit == "TooManyReplicas":
            message += f" (at max {policy.max_replicas}, wanted {raw})"
        elif limit == "TooFewReplicas":
            message += f" (at min {policy.min_replicas})"
    decision = Decision(
        pool=pool,
        current=current,
        desired=desired,
        recommendation=recommendation,
        reason=reason,
        message=message,
        limit=limit,
        signals=per_signal,
    )
    return decision, new_state
