"""The P:D planner's rules, its capacity model and forecast, on hand-made signals."""

from __future__ import annotations

import math

import pytest

from tandem.common.capacity import (
    H200_LLAMA_8B,
    H200_LLAMA_8B_KV_TOKENS,
    StepCost,
    decode_capacity,
    decode_step_s,
    prefill_capacity,
    prefill_step_s,
    prefill_utilization_at_ttft,
    prefill_wait_s,
)
from tandem.emulator.profile import load_profile
from tandem.operator.api import AutoscalingSpec
from tandem.operator.autoscaling.forecast import Holt
from tandem.operator.autoscaling.planner import PlannerMemory, PlannerPolicy, plan
from tandem.operator.autoscaling.planner_loop import planner_policy, planner_status
from tandem.operator.autoscaling.planner_signals import PlannerSignals, PoolLoad

POLICY = PlannerPolicy(
    prefill_max=16,
    decode_max=8,
    target_ttft_s=0.75,
    target_itl_s=0.05,
    horizon_s=45,
    scale_down_stabilization_s=60,
    forecast_sigmas=0.0,
)


def signals(
    prompt_tps: float,
    output_tps: float,
    prompt: float = 2048,
    output: float = 128,
    prefill: PoolLoad | None = None,
    decode: PoolLoad | None = None,
    hit: float | None = None,
) -> PlannerSignals:
    return PlannerSignals(
        prompt_tokens_per_s=prompt_tps,
        output_tokens_per_s=output_tps,
        prompt_tokens_per_request=prompt,
        output_tokens_per_request=output,
        prefix_hit_rate=hit,
        prefill=prefill or PoolLoad(engines=1),
        decode=decode or PoolLoad(engines=1),
    )


def test_seed_is_the_emulators_h200_profile() -> None:
    """The operator cannot import the emulator: its seed copies the profile, and this keeps them equal."""
    profile = load_profile("h200-llama-3.1-8b")
    assert StepCost.model_validate(profile.step.model_dump()) == H200_LLAMA_8B
    assert profile.num_gpu_blocks(16, 0.9, 8192) * 16 == H200_LLAMA_8B_KV_TOKENS


def test_prefill_capacity_is_full_steps_of_the_profile() -> None:
    tokens_per_s, rho = prefill_capacity(H200_LLAMA_8B, 2048, 8192, target_ttft_s=0.75)
    step = prefill_step_s(H200_LLAMA_8B, 8192, 2048)
    assert tokens_per_s == pytest.approx(8192 / step)
    assert 35_000 < tokens_per_s < 45_000  # an H200 prefills ~40k tokens/s of 2k-token prompts
    # rho solves service + ln(10) * Kingman wait = target
    service = 1.25 * step
    wait = prefill_wait_s(rho, step, 1.0)
    assert service + math.log(10) * wait == pytest.approx(0.75)


def test_prefill_utilization_falls_with_burstier_arrivals_and_tighter_targets() -> None:
    poisson = prefill_utilization_at_ttft(0.25, 0.2, 0.75, 1.0, 2.3)
    bursty = prefill_utilization_at_ttft(0.25, 0.2, 0.75, 9.0, 2.3)
    tight = prefill_utilization_at_ttft(0.25, 0.2, 0.4, 1.0, 2.3)
    assert 0 < bursty < tight < poisson < 1
    assert prefill_utilization_at_ttft(0.3, 0.2, 0.25, 1.0, 2.3) == 0.0  # unreachable target


def test_decode_capacity_bound_by_itl_kv_or_max_num_seqs() -> None:
    # Short contexts: max_num_seqs binds.
    tps, batch = decode_capacity(H200_LLAMA_8B, 1000, 0.05, 700_000, 256)
    assert batch == 256
    assert tps == pytest.approx(256 / decode_step_s(H200_LLAMA_8B, 256, 1000))
    # Long contexts: the KV cache binds.
    _, batch = decode_capacity(H200_LLAMA_8B, 20_000, 0.05, 700_000, 256)
    assert batch == pytest.approx(35)
    # A tight ITL target: the step time binds, and the step at that batch meets the target.
    _, batch = decode_capacity(H200_LLAMA_8B, 4000, 0.02, 700_000, 1024)
    assert decode_step_s(H200_LLAMA_8B, batch, 4000) == pytest.approx(0.02)


def test_holt_follows_a_ramp_and_measures_its_errors() -> None:
    holt = Holt()
    for t in range(0, 300, 15):
        holt = holt.update(100.0 + 2.0 * t, float(t), alpha=0.5, beta=0.3)
    assert holt.trend == pytest.approx(2.0, rel=0.05)
    assert holt.forecast(60) == pytest.approx(100 + 2 * 345, rel=0.02)
    assert holt.variance < 100  # a clean ramp leaves little error
    noisy = Holt()
    for i, t in enumerate(range(0, 300, 15)):
        noisy = noisy.update(100.0 + (50 if i % 2 else -50), float(t), alpha=0.5, beta=0.3)
    assert noisy.upper(0, 1.28) > noisy.forecast(0) + 30


def test_sizes_both_pools_from_load_and_capacity() -> None:
    capacity_p, rho = prefill_capacity(H200_LLAMA_8B, 2048, 8192, 0.75)
    capacity_d, _ = decode_capacity(
        H200_LLAMA_8B, 2048 + 64, 0.05, H200_LLAMA_8B_KV_TOKENS * 0.85, 256
    )
    result, memory = plan(
        POLICY, signals(200_000, 20_000), {"prefill": 1, "decode": 1}, PlannerMemory(), now=0
    )
    prefill, decode = result.decisions["prefill"], result.decisions["decode"]
    assert prefill.desired == math.ceil(200_000 / (capacity_p * min(rho, 0.8)))
    assert decode.desired == math.ceil(20_000 / (capacity_d * 0.8))
    assert (prefill.reason, decode.reason) == ("ScaledUp", "ScaledUp")
    assert "uncached prompt tokens/s" in prefill.message
    assert result.pools["prefill"].capacity_tokens_per_s == pytest.approx(capacity_p)
    assert memory.prefill_demand.level == 200_000
    status = planner_status(result, "prefill")
    assert status is not None
    assert status["demandTokensPerSecond"] == 200_000


def test_the_split_follows_the_mix() -> None:
    """The same request rate, prompt-heavy then output-heavy: the ratio turns around."""
    heavy_prompts, _ = plan(
        POLICY,
        signals(20 * 6000, 20 * 20, prompt=6000, output=20),
        {"prefill": 1, "decode": 1},
        PlannerMemory(),
        now=0,
    )
    long_answers, _ = plan(
        POLICY,
        signals(20 * 300, 20 * 1500, prompt=300, output=1500),
        {"prefill": 1, "decode": 1},
        PlannerMemory(),
        now=0,
    )
    p1, d1 = (heavy_prompts.decisions[p].desired for p in ("prefill", "decode"))
    p2, d2 = (long_answers.decisions[p].desired for p in ("prefill", "decode"))
    assert p1 > d1
    assert p2 <= d2
    assert p2 < p1


def test_prefix_hits_shrink_prefill_demand() -> None:
    cold, _ = plan(POLICY, signals(300_000, 1000), {"prefill": 1, "decode": 1}, PlannerMemory(), 0)
    warm, _ = plan(
        POLICY, signals(300_000, 1000, hit=0.75), {"prefill": 1, "decode": 1}, PlannerMemory(), 0
    )
    assert warm.pools["prefill"].demand_tokens_per_s == pytest.approx(75_000)
    assert warm.decisions["prefill"].desired < cold.decisions["prefill"].desired


def test_a_rising_load_is_met_ahead_of_time() -> None:
    """On a ramp the plan is sized for the load one horizon ahead, above today's need."""
    memory = PlannerMemory()
    current = {"prefill": 1, "decode": 1}
    for t in range(0, 180, 15):
        result, memory = plan(POLICY, signals(20_000 + 500.0 * t, 1000), current, memory, float(t))
        current = {pool: d.desired for pool, d in result.decisions.items()}
    now_need = result.pools["prefill"].demand_tokens_per_s
    assert result.pools["prefill"].forecast_tokens_per_s > now_need + 500 * 30


def test_scale_down_waits_for_the_window_and_respects_min() -> None:
    memory = PlannerMemory()
    result, memory = plan(POLICY, signals(300_000, 1000), {"prefill": 1, "decode": 1}, memory, 0)
    big = result.decisions["prefill"].desired
    assert big > 4
    current = {"prefill": big, "decode": 1}
    for t in (15, 30, 45):
        result, memory = plan(POLICY, signals(1000, 100), current, memory, float(t))
        assert result.decisions["prefill"].reason == "Stabilizing"
        assert result.decisions["prefill"].desired == big
    result, memory = plan(POLICY, signals(1000, 100), current, memory, 75.0)
    assert result.decisions["prefill"].reason == "ScaledDown"
    assert result.decisions["prefill"].desired < big
    for t in range(90, 600, 15):
        current = {pool: d.desired for pool, d in result.decisions.items()}
        result, memory = plan(POLICY, signals(1000, 100), current, memory, float(t))
        window = [n for at, n in memory.pools["prefill"].recommendations if at >= t - 60]
        assert result.decisions["prefill"].desired >= min(current["prefill"], max(window))
    assert {p: d.desired for p, d in result.decisions.items()} == {"prefill": 1, "decode": 1}


def test_bounds_cap_the_plan() -> None:
    result, _ = plan(
        POLICY, signals(5_000_000, 1000), {"prefill": 2, "decode": 1}, PlannerMemory(), 0
    )
    assert result.decisions["prefill"].desired == 16
    assert result.decisions["prefill"].limit == "TooManyReplicas"


def test_learns_a_slower_engine_than_seeded() -> None:
    """Decode steps twice as slow as the profile says: the slowdown converges to 2 and the
    decode pool grows for the same load."""
    memory = PlannerMemory()
    context = 2048 + 64
    running = 200.0
    measured = 2 * decode_step_s(H200_LLAMA_8B, running, context)
    first = None
    for t in range(0, 600, 15):
        result, memory = plan(
            POLICY,
            signals(
                10_000, 40_000, decode=PoolLoad(engines=1, running=running, latency_s=measured)
            ),
            {"prefill": 1, "decode": 1},
            memory,
            float(t),
        )
        first = first or result.decisions["decode"].recommendation
    assert memory.decode_slowdown == pytest.approx(2.0, rel=0.02)
    assert result.decisions["decode"].recommendation > first


def test_learns_bursty_arrivals_from_the_prefill_queue() -> None:
    """A queue nine times Kingman's Poisson wait: the variability goes to 9 and the planned
    prefill utilisation drops."""
    capacity, _ = prefill_capacity(H200_LLAMA_8B, 2048, 8192, 0.75)
    demand = 0.5 * capacity  # rho 0.5 on one engine
    step = prefill_step_s(H200_LLAMA_8B, 8192, 2048)
    queue = 9 * prefill_wait_s(0.5, step, 1.0)
    memory = PlannerMemory()
    for t in range(0, 600, 15):
        result, memory = plan(
            POLICY,
            signals(demand, 1000, prefill=PoolLoad(engines=1, queue_s=queue)),
            {"prefill": 1, "decode": 1},
            memory,
            float(t),
        )
    assert memory.arrival_variability == pytest.approx(9.0, rel=0.02)
    _, poisson_rho = prefill_capacity(H200_LLAMA_8B, 2048, 8192, 0.75)
    assert result.pools["prefill"].utilization < poisson_rho / 2


def test_no_metrics_holds_and_keeps_what_was_learned() -> None:
    memory = PlannerMemory(decode_slowdown=1.7, arrival_variability=4.0)
    result, kept = plan(POLICY, None, {"prefill": 3, "decode": 2}, memory, 0, "Prometheus down")
    assert {p: d.desired for p, d in result.decisions.items()} == {"prefill": 3, "decode": 2}
    assert all(d.reason == "MetricsUnavailable" for d in result.decisions.values())
    assert "Prometheus down" in result.decisions["prefill"].message
    assert (kept.decode_slowdown, kept.arrival_variability) == (1.7, 4.0)
    assert kept.prefill_demand.level is None


def test_policy_from_the_spec() -> None:
    spec = AutoscalingSpec.model_validate(
        {
            "enabled": True,
            "mode": "planner",
            "intervalSeconds": 10,
            "prefill": {"min": 2, "max": 6, "targetTTFTSeconds": 0.5},
            "decode": {"min": 1, "max": 4, "targetITLSeconds": 0.04, "maxKVUsage": 0.9},
            "planner": {"startupSeconds": 90, "step": {"baseSeconds": 0.01}, "kvCacheTokens": 1000},
        }
    )
    policy = planner_policy(spec, {"maxNumBatchedTokens": 4096}, {"maxNumSeqs": 64})
    assert (policy.prefill_min, policy.prefill_max, policy.decode_max) == (2, 6, 4)
    assert (policy.target_ttft_s, policy.target_itl_s, policy.max_kv_usage) == (0.5, 0.04, 0.9)
    assert policy.horizon_s == 100
    assert policy.step.base_s == 0.01
    assert policy.step.per_token_s == H200_LLAMA_8B.per_token_s
    assert (policy.kv_tokens, policy.max_num_batched_tokens, policy.max_num_seqs) == (
        1000,
        4096,
        64,
    )


def test_kv_bound_decode_takes_its_headroom_from_max_kv_usage_alone() -> None:
    """Long contexts fill the KV cache before the ITL target binds: maxKVUsage is the margin,
    and targetUtilization is not applied on top of it."""
    result, _ = plan(
        POLICY,
        signals(10_000, 1000, prompt=12_000, output=400),
        {"prefill": 1, "decode": 1},
        PlannerMemory(),
        0,
    )
    assert result.pools["decode"].utilization == 1.0
    short, _ = plan(POLICY, signals(10_000, 1000), {"prefill": 1, "decode": 1}, PlannerMemory(), 0)
    assert short.pools["decode"].utilization == POLICY.target_utilization
