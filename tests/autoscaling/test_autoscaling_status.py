"""The autoscaler's status section and its two conditions."""

from __future__ import annotations

from tandem.operator.autoscaling.decision import ScalingMemory, decide
from tandem.operator.autoscaling.policy import PoolPolicy
from tandem.operator.autoscaling.signals import PoolSignals
from tandem.operator.autoscaling.status import autoscaling_conditions, pool_status

POLICY = PoolPolicy(pool="prefill", min_replicas=1, max_replicas=4, target_latency_s=0.5)
HOT = PoolSignals(pool="prefill", engines=2, latency_s=2.0, waiting=3, running=2, request_rate=4.0)
CALM = PoolSignals(pool="prefill", engines=2, latency_s=0.5, waiting=0, running=2, request_rate=4.0)


def test_pool_status_records_replicas_reason_and_observations() -> None:
    decision, _ = decide(POLICY, HOT, current=2, ready=2, state=ScalingMemory(), now=0)
    status = pool_status(
        decision, HOT, 2, {"lastScaleTime": "2026-01-01T00:00:00Z"}, "2026-11-30T08:00:00Z"
    )
    assert status["replicas"] == 4
    assert status["lastScaleTime"] == "2026-11-30T08:00:00Z"
    assert status["decision"] == "ScaledUp"
    assert status["limit"] == "TooManyReplicas"
    assert "TTFT p90 2s vs target 0.5s" in status["reason"]
    assert status["observed"]["latencySeconds"] == 2.0
    assert (status["current"], status["ready"]) == (2, 2)
    steady, _ = decide(POLICY, CALM, current=2, ready=2, state=ScalingMemory(), now=0)
    assert pool_status(steady, CALM, 2, status, "later")["lastScaleTime"] == "2026-11-30T08:00:00Z"


def test_conditions_flip_with_transition_time_and_keep_other_types() -> None:
    hot, _ = decide(POLICY, HOT, current=2, ready=2, state=ScalingMemory(), now=0)
    ready = {
        "type": "Ready",
        "status": "True",
        "reason": "AllReady",
        "message": "",
        "lastTransitionTime": "t0",
    }
    conditions = autoscaling_conditions([hot], [ready], "t1")
    by_type = {c["type"]: c for c in conditions}
    assert by_type["Ready"] == ready
    assert by_type["ScalingLimited"]["status"] == "True"
    assert by_type["ScalingLimited"]["reason"] == "TooManyReplicas"
    assert by_type["MetricsUnavailable"]["status"] == "False"
    again = {c["type"]: c for c in autoscaling_conditions([hot], conditions, "t2")}
    assert again["ScalingLimited"]["lastTransitionTime"] == "t1"
    blind, _ = decide(
        POLICY,
        None,
        current=4,
        ready=4,
        state=ScalingMemory(),
        now=0,
        unavailable_reason="timed out",
    )
    after = {c["type"]: c for c in autoscaling_conditions([blind], conditions, "t3")}
    assert after["ScalingLimited"]["status"] == "False"
    assert after["MetricsUnavailable"]["status"] == "True"
    assert after["MetricsUnavailable"]["lastTransitionTime"] == "t3"
    assert "timed out" in after["MetricsUnavailable"]["message"]
    assert [c["type"] for c in autoscaling_conditions([blind], conditions, "t3")] == [
        "Ready",
        "ScalingLimited",
        "MetricsUnavailable",
        "ScalingActive",
    ]
