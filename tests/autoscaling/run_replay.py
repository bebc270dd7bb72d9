"""Replays a recorded autoscaler run (status.autoscaling of every evaluation) through `decide`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from tandem.common.roles import Role
from tandem.operator.autoscaling.decision import Decision, ScalingMemory, decide
from tandem.operator.autoscaling.policy import PoolPolicy
from tandem.operator.autoscaling.signals import PoolSignals


def recorded_signals(pool: Role, status: Mapping[str, Any]) -> PoolSignals | None:
    observed = status.get("observed")
    if status.get("decision") == "MetricsUnavailable" or not observed:
        return None
    return PoolSignals(
        pool=pool,
        engines=observed["engines"],
        latency_s=observed.get("latencySeconds"),
        waiting=observed.get("waiting") or 0.0,
        running=observed.get("running") or 0.0,
        kv_usage=observed.get("kvUsage"),
        request_rate=observed.get("requestRate"),
    )


def replay(
    policy: PoolPolicy, rows: list[Mapping[str, Any]]
) -> Iterator[tuple[Mapping[str, Any], Decision]]:
    """(recorded status, replayed decision) per evaluation, from the first metrics gap on (where
    the recorded autoscaler's state was empty too), or from the first row."""
    pool = policy.pool
    start = next(
        (i for i, row in enumerate(rows) if row[pool].get("decision") == "MetricsUnavailable"), 0
    )
    state = ScalingMemory()
    for row in rows[start:]:
        status = row[pool]
        decision, state = decide(
            policy,
            recorded_signals(pool, status),
            status["current"],
            status["ready"],
            state,
            row["t"],
        )
        yield status, decision
