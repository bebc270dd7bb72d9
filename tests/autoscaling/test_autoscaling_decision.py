"""Rules of the pure scaling decision, one by one, on hand-made signals."""

from __future__ import annotations

import itertools
import random

import pytest

from tandem.operator.autoscaling.decision import ScalingMemory, decide
from tandem.operator.autoscaling.policy import PoolPolicy, pool_policies
from tandem.operator.autoscaling.signals import PoolSignals

PREFILL = PoolPolicy(
    pool="prefill",
    min_replicas=1,
    max_replicas=8,
    target_latency_s=0.8,
    target_waiting_per_replica=4,
    scale_down_stabilization_s=60,
)
DECODE = PoolPolicy(
    pool="decode",
    min_replicas=1,
    max_replicas=16,
    target_latency_s=0.05,
    max_kv_usage=0.85,
    scale_down_stabilization_s=60,
)


def prefill(
    latency: float | None, waiting: float = 0, rate: float = 5.0, engines: int = 16
) -> PoolSignals:
    return PoolSignals(
        pool="prefill",
        engines=engines,
        latency_s=latency,
        waiting=waiting,
        running=1,
        request_rate=rate,
    )


def decode(itl: float | None, kv: float, engines: int = 16) -> PoolSignals:
    return PoolSignals(
        pool="decode", engines=engines, latency_s=itl, kv_usage=kv, running=8, request_rate=3.0
    )


def test_inside_tolerance_band_holds() -> None:
    decision, _ = decide(PREFILL, prefill(0.84), current=2, ready=2, state=ScalingMemory(), now=0)
    assert (decision.desired, decision.reason) == (2, "Steady")
    assert decision.signals["latency"] == 2


def test_latency_breach_scales_up_proportionally_at_once() -> None:
    decision, _ = decide(PREFILL, prefill(1.6), current=2, ready=2, state=ScalingMemory(), now=0)
    assert (decision.desired, decision.reason, decision.limit) == (4, "ScaledUp", None)
    assert "TTFT p90 1.6s vs target 0.8s" in decision.message


def test_queue_per_replica_drives_prefill_when_latency_is_fine() -> None:
    decision, _ = decide(
        PREFILL, prefill(0.8, waiting=20), current=2, ready=2, state=ScalingMemory(), now=0
    )
    # 20 waiting / 4 per replica -> 5 replicas.
    assert decision.desired == 5
    assert decision.signals == {"latency": 2, "queue": 5}


def test_decode_follows_the_worse_of_itl_and_kv_usage() -> None:
    decision, _ = decide(
        DECODE, decode(itl=0.05, kv=0.95), current=2, ready=2, state=ScalingMemory(), now=0
    )
    # ITL on target holds 2, KV 0.95/0.85 = 1.12 -> ceil(2.24) = 3.
    assert decision.signals == {"latency": 2, "kvUsage": 3}
    assert decision.desired == 3
    decision, _ = decide(
        DECODE, decode(itl=0.2, kv=0.5), current=2, ready=2, state=ScalingMemory(), now=0
    )
    assert (decision.desired, decision.recommendation, decision.limit) == (6, 8, "ScaleUpLimit")


def test_one_step_grows_at_most_double_or_plus_four() -> None:
    decision, _ = decide(PREFILL, prefill(8.0), current=1, ready=1, state=ScalingMemory(), now=0)
    assert (decision.desired, decision.limit) == (5, "ScaleUpLimit")
    decision, _ = decide(PREFILL, prefill(8.0), current=5, ready=5, state=ScalingMemory(), now=0)
    assert (decision.desired, decision.limit) == (8, "TooManyReplicas")


def test_capped_at_max_says_so() -> None:
    decision, _ = decide(PREFILL, prefill(2.0), current=8, ready=8, state=ScalingMemory(), now=0)
    assert (decision.desired, decision.reason, decision.limit) == (8, "Steady", "TooManyReplicas")
    assert "at max 8, wanted 20" in decision.message


def test_recommendation_uses_ready_pods_so_pending_pods_are_not_counted_twice() -> None:
    # 4 desired, 2 ready: the latency was produced by 2 pods, 1.5x target needs 3 < 4: no more growth.
    decision, _ = decide(PREFILL, prefill(1.2), current=4, ready=2, state=ScalingMemory(), now=0)
    assert (decision.desired, decision.reason) == (4, "Stabilizing")
    assert decision.signals == {"latency": 3}


def test_pods_ready_but_not_yet_scraped_are_not_counted_either() -> None:
    # 3 pods Ready, but Prometheus sees 1 engine: 2x the target from 1 engine means 2 < 3, hold.
    decision, _ = decide(
        PREFILL, prefill(1.6, engines=1), current=3, ready=3, state=ScalingMemory(), now=0
    )
    assert (decision.desired, decision.signals) == (3, {"latency": 2})


def test_scale_down_waits_for_a_full_window_of_lower_recommendations() -> None:
    state = ScalingMemory()
    decision, state = decide(PREFILL, prefill(0.8), current=4, ready=4, state=state, now=0)
    assert decision.reason == "Steady"
    for now in range(10, 60, 10):
        decision, state = decide(PREFILL, prefill(0.2), current=4, ready=4, state=state, now=now)
        assert (decision.desired, decision.reason) == (4, "Stabilizing")
    # At t=61 the steady recommendation of t=0 has left the window; the lows all say
    # ceil(4 x 0.25 / 0.5) = 2: latency is convex in load, so the pool halves rather than quarters.
    decision, state = decide(PREFILL, prefill(0.2), current=4, ready=4, state=state, now=61)
    assert (decision.desired, decision.reason) == (2, "ScaledDown")


def test_scale_down_goes_to_the_highest_recommendation_of_the_window() -> None:
    state = ScalingMemory(observed_since=-100)
    _, state = decide(
        PREFILL, prefill(0.2), current=6, ready=6, state=state, now=0
    )  # 6 x 0.25 / 0.5 -> 3
    decision, state = decide(PREFILL, prefill(0.1), current=6, ready=6, state=state, now=10)  # -> 2
    assert (decision.desired, decision.recommendation) == (3, 2)


def test_oscillating_load_never_flaps() -> None:
    """Load swinging every 15 s: the pool grows once, then never shrinks while the swings go on."""
    state, current, sizes = ScalingMemory(), 2, []
    for step in range(40):
        latency = 1.6 if step % 2 == 0 else 0.3
        decision, state = decide(
            PREFILL, prefill(latency), current=current, ready=current, state=state, now=step * 15
        )
        current = decision.desired
        sizes.append(current)
    changes = sum(1 for a, b in itertools.pairwise(sizes) if a != b)
    assert changes <= 2, sizes
    assert all(b >= a for a, b in itertools.pairwise(sizes)), sizes


def p90_latency(replicas: int, rate: float, service_s: float = 0.23) -> float:
    """A queueing model of one pool: M/D/1 per replica, p90 about service + 2.3 x mean wait."""
    rho = rate * service_s / replicas
    if rho >= 0.98:
        return 10.0
    return service_s + 2.3 * rho * service_s / (2 * (1 - rho))


@pytest.mark.parametrize("rate", [2.0, 6.0, 12.0, 20.0])
def test_steady_load_converges_without_oscillation(rate: float) -> None:
    """Closed loop against the queueing model: grow until latency is under target, then hold."""
    policy = PREFILL.model_copy(update={"target_waiting_per_replica": None})
    state, current, sizes = ScalingMemory(), 1, []
    for step in range(120):
        signals = prefill(p90_latency(current, rate), rate=rate)
        decision, state = decide(
            policy, signals, current=current, ready=current, state=state, now=step * 5.0
        )
        current = decision.desired
        sizes.append(current)
    settled = sizes[40:]
    assert len(set(settled)) == 1, sizes
    assert p90_latency(settled[0], rate) <= policy.target_latency_s * 1.1
    changes = sum(1 for a, b in itertools.pairwise(sizes) if a != b)
    assert changes <= 3, sizes


def test_idle_pool_recommends_min_and_shrinks_after_the_window() -> None:
    idle = PoolSignals(
        pool="prefill", engines=3, latency_s=None, waiting=0, running=0, request_rate=0.0
    )
    state = ScalingMemory()
    decision, state = decide(PREFILL, idle, current=3, ready=3, state=state, now=0)
    assert (decision.reason, decision.signals) == ("Stabilizing", {"idle": 1})
    decision, state = decide(PREFILL, idle, current=3, ready=3, state=state, now=60)
    assert (decision.desired, decision.reason) == (1, "ScaledDown")


def test_missing_metrics_hold_and_restart_the_window() -> None:
    state = ScalingMemory(observed_since=-1000, recommendations=((-5.0, 1),))
    decision, state = decide(
        PREFILL,
        None,
        current=3,
        ready=3,
        state=state,
        now=0,
        unavailable_reason="connection refused",
    )
    assert (decision.desired, decision.reason) == (3, "MetricsUnavailable")
    assert "connection refused" in decision.message
    assert state == ScalingMemory()
    # Metrics back and low: no scale-down until a full window has been seen again.
    decision, state = decide(PREFILL, prefill(0.1), current=3, ready=3, state=state, now=10)
    assert decision.reason == "Stabilizing"
    decision, _ = decide(PREFILL, prefill(0.1, engines=0), current=3, ready=3, state=state, now=20)
    assert decision.reason == "MetricsUnavailable"


def test_size_outside_limits_is_corrected_at_once() -> None:
    decision, _ = decide(PREFILL, prefill(0.8), current=12, ready=12, state=ScalingMemory(), now=0)
    assert (decision.desired, decision.reason) == (8, "ScaledDown")
    decision, _ = decide(PREFILL, None, current=0, ready=0, state=ScalingMemory(), now=0)
    assert decision.desired == 1


def test_never_beyond_max_nor_below_min_on_random_signals() -> None:
    rng = random.Random(7)
    state, current = ScalingMemory(), 1
    for step in range(2000):
        signals = (
            None
            if rng.random() < 0.05
            else decode(itl=rng.uniform(0.001, 0.5), kv=rng.uniform(0, 1), engines=current)
        )
        ready = rng.randint(0, current)
        decision, state = decide(
            DECODE, signals, current=current, ready=ready, state=state, now=step * 5.0
        )
        assert DECODE.min_replicas <= decision.desired <= DECODE.max_replicas
        if decision.desired < current:
            assert decision.reason == "ScaledDown"
        current = decision.desired


def test_policies_from_the_spec_dict() -> None:
    policies = pool_policies(
        {
            "enabled": True,
            "prometheusURL": "http://prometheus:9090",
            "prefill": {"min": 1, "max": 8, "targetTTFTSeconds": 0.8},
            "decode": {
                "min": 2,
                "max": 16,
                "targetITLSeconds": 0.05,
                "maxKVUsage": 0.85,
                "targetWaitingPerReplica": 2,
            },
            "tolerance": 0.2,
            "scaleDownStabilizationSeconds": 120,
        }
    )
    assert policies["prefill"].target_latency_s == 0.8
    assert policies["prefill"].max_kv_usage is None
    assert policies["decode"].min_replicas == 2
    assert policies["decode"].max_kv_usage == 0.85
    assert policies["decode"].target_waiting_per_replica == 2
    assert policies["prefill"].target_waiting_per_replica is None
    assert policies["prefill"].tolerance == policies["decode"].tolerance == 0.2
    assert policies["prefill"].scale_down_stabilization_s == 120
    with pytest.raises(ValueError, match="min"):
        pool_policies({"enabled": True, "prefill": {"min": 4, "max": 2}})
