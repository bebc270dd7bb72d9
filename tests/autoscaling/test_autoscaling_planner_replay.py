"""The day-replay simulation (benchmarks/pd_sim.py, planner_replay.py) on a small synthetic day:
its invariants hold, and it drives the real decision functions."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from pd_sim import Request, SimConfig, Simulation
from planner_replay import day_requests, independent, planner

from tandem.bench.traces import TraceRow
from tandem.common.capacity import StepCost
from tandem.emulator.profile import load_profile
from tandem.operator.api import AutoscalingSpec
from tandem.operator.autoscaling.planner import PlannerPolicy

PROFILE = load_profile("h200-llama-3.1-8b")
CONFIG = SimConfig(profile=PROFILE, startup_s=10, interval_s=5, metrics_window_s=10)
DAY_S = 240.0


def synthetic_rows(count: int = 400, seed: int = 7) -> list[TraceRow]:
    rng = random.Random(seed)
    at = 0.0
    rows = []
    for _ in range(count):
        at += rng.expovariate(2.0)
        rows.append(
            TraceRow(
                at_s=at, input_tokens=rng.randint(200, 6000), output_tokens=rng.randint(1, 200)
            )
        )
    return rows


def requests(peak_rps: float = 30.0) -> list[Request]:
    return day_requests(synthetic_rows(), DAY_S, peak_rps, trough=0.2)


def check_invariants(result_requests: list[Request]) -> None:
    for r in result_requests:
        if r.dropped:
            assert r.done < 0
            continue
        assert r.done >= 0, "every request is served or dropped once the simulation ends"
        assert r.arrival <= r.prefill_start <= r.prefill_done <= r.first_token <= r.done
        # No request is faster than its own prefill alone, its KV pull and one decode step.
        floor = (
            PROFILE.step_seconds([(min(r.prompt, 8192), 0)], 0, 0)
            + PROFILE.transfer_seconds(r.prompt)
            + PROFILE.step_seconds([], 1, r.prompt)
        )
        assert r.ttft >= floor * 0.999
        assert r.computed == r.prompt


def test_day_shape_follows_the_curve() -> None:
    day = requests()
    arrivals = [r.arrival for r in day]
    assert arrivals == sorted(arrivals)
    assert arrivals[0] >= 0
    assert arrivals[-1] <= DAY_S
    night = sum(1 for t in arrivals if t < DAY_S / 12)  # 00:00-02:00
    afternoon = sum(1 for t in arrivals if DAY_S * 14 / 24 <= t < DAY_S * 16 / 24)
    assert afternoon > 3 * night
    assert len(day) == pytest.approx(30.0 * DAY_S * (0.2 + 0.8 / 2), rel=0.01)


def test_fixed_split_serves_everything_and_counts_gpu_seconds() -> None:
    day = requests()
    result = Simulation(CONFIG, day, {"prefill": 3, "decode": 1}, None).run()
    check_invariants(result.requests)
    assert result.failed == 0
    assert result.gpu_seconds == pytest.approx(4 * day[-1].arrival)
    assert result.attainment(ttft_s=1e9, tpot_s=1e9) == 1.0


def test_an_overloaded_fixed_split_drops_after_the_queue_bound() -> None:
    config = SimConfig(profile=PROFILE, queue_timeout_s=5)
    day = requests(peak_rps=120)
    result = Simulation(config, day, {"prefill": 1, "decode": 1}, None).run()
    check_invariants(result.requests)
    assert 0 < result.failed < len(day)
    for r in result.requests:
        if not r.dropped:
            assert r.prefill_start - r.arrival <= 5 + 2 * PROFILE.step_seconds([(8192, 0)], 0, 0)


@pytest.mark.parametrize("mode", ["independent", "planner"])
def test_autoscaled_replay_stays_in_bounds_and_serves_all(mode: str) -> None:
    spec = AutoscalingSpec.model_validate(
        {
            "enabled": True,
            "intervalSeconds": CONFIG.interval_s,
            "metricsWindowSeconds": CONFIG.metrics_window_s,
            "scaleDownStabilizationSeconds": 30,
            "prefill": {"min": 1, "max": 6, "targetTTFTSeconds": 0.75},
            "decode": {"min": 1, "max": 3, "targetITLSeconds": 0.05},
        }
    )
    policy = (
        independent(spec)
        if mode == "independent"
        else planner(
            PlannerPolicy(
                prefill_max=6,
                decode_max=3,
                target_ttft_s=0.75,
                step=StepCost.model_validate(PROFILE.step.model_dump()),
                horizon_s=CONFIG.startup_s + CONFIG.interval_s,
                scale_down_stabilization_s=30,
            )
        )
    )
    day = requests()
    result = Simulation(CONFIG, day, {"prefill": 1, "decode": 1}, policy).run()
    check_invariants(result.requests)
    assert result.failed == 0
    assert len(result.sizes) >= DAY_S / CONFIG.interval_s - 2
    assert all(1 <= p <= 6 and 1 <= d <= 3 for _, p, d in result.sizes)
    assert max(p for _, p, _ in result.sizes) > 1, "the afternoon peak needs more prefill"
    # Pods cost from their order to their exit: never less than the smallest pool, never more
    # than the largest the policy ever asked for.
    assert 2 * day[-1].arrival <= result.gpu_seconds <= 9 * day[-1].arrival
