"""The planner mode of the autoscaler: its policy from the spec, one evaluation, its status."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tandem.common.roles import Role
from tandem.operator.api import AutoscalingSpec
from tandem.operator.api_engine import PoolSpec
from tandem.operator.autoscaling.planner import Plan, PlannerMemory, PlannerPolicy, plan
from tandem.operator.autoscaling.planner_queries import read_planner_signals
from tandem.operator.autoscaling.planner_signals import PlannerSignals
from tandem.operator.autoscaling.prometheus import PrometheusClient, PrometheusUnavailable
from tandem.operator.autoscaling.queries import PoolSelector

# vLLM's --max-num-seqs when a pool does not set it.
VLLM_MAX_NUM_SEQS = 256


@dataclass
class PlannerState:
    """What one ServingCluster's autoscaler loop keeps for the planner between evaluations."""

    memory: PlannerMemory = field(default_factory=PlannerMemory)


def planner_policy(
    autoscaling: AutoscalingSpec, prefill: Mapping[str, Any], decode: Mapping[str, Any]
) -> PlannerPolicy:
    """The planner's policy from `spec.autoscaling` and the two pools' engine settings."""
    prefill_pool = PoolSpec.model_validate(prefill)
    decode_pool = PoolSpec.model_validate(decode)
    planner = autoscaling.planner
    return PlannerPolicy(
        prefill_min=autoscaling.prefill.min,
        prefill_max=autoscaling.prefill.max,
        decode_min=autoscaling.decode.min,
        decode_max=autoscaling.decode.max,
        target_ttft_s=autoscaling.prefill.target_ttft_seconds or PlannerPolicy().target_ttft_s,
        target_itl_s=autoscaling.decode.target_itl_seconds or PlannerPolicy().target_itl_s,
        max_kv_usage=autoscaling.decode.max_kv_usage or 1.0,
        quantile=autoscaling.quantile,
        target_utilization=planner.target_utilization,
        step=planner.step,
        kv_tokens=planner.kv_cache_tokens,
        max_num_batched_tokens=prefill_pool.max_num_batched_tokens,
        max_num_seqs=decode_pool.max_num_seqs or VLLM_MAX_NUM_SEQS,
        horizon_s=planner.startup_seconds + autoscaling.interval_seconds,
        forecast_sigmas=planner.forecast_sigmas,
        tolerance=autoscaling.tolerance,
        scale_down_stabilization_s=autoscaling.scale_down_stabilization_seconds,
    )


async def evaluate_planner(
    prometheus: PrometheusClient,
    namespace: str,
    cluster: str,
    policy: PlannerPolicy,
    window_s: float,
    current: dict[Role, int],
    state: PlannerState,
    now: float,
) -> tuple[Plan, PlannerSignals | None]:
    """Read the planner's inputs and plan both pools; a Prometheus failure holds them."""
    selectors = {
        pool: PoolSelector(namespace=namespace, cluster=cluster, pool=pool)
        for pool in ("prefill", "decode")
    }
    signals: PlannerSignals | None = None
    why = "no metrics"
    try:
        signals = await read_planner_signals(
            prometheus, selectors["prefill"], selectors["decode"], window_s
        )
    except PrometheusUnavailable as exc:
        why = str(exc)
    if signals is not None and (signals.prefill.engines == 0 or signals.decode.engines == 0):
        why = f"Prometheus at {prometheus.base_url} has no engine metrics of both pools"
    result, state.memory = plan(policy, signals, current, state.memory, now, why)
    return result, signals


def planner_status(result: Plan, pool: Role) -> dict[str, Any] | None:
    """`status.autoscaling.<pool>.planner`: what the pool's plan was computed from."""
    inputs = result.pools.get(pool)
    if inputs is None:
        return None
    return {
        "demandTokensPerSecond": round(inputs.demand_tokens_per_s, 3),
        "forecastTokensPerSecond": round(inputs.forecast_tokens_per_s, 3),
        "capacityTokensPerSecond": round(inputs.capacity_tokens_per_s, 3),
        "utilization": round(inputs.utilization, 3),
        "slowdown": round(inputs.slowdown, 3),
        "replicas": round(inputs.replicas, 3),
        "promptTokensPerRequest": round(result.prompt_tokens, 1),
        "outputTokensPerRequest": round(result.output_tokens, 1),
        "prefixHitRate": round(result.prefix_hit_rate, 4),
        "arrivalVariability": round(result.arrival_variability, 3),
    }
