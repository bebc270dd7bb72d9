"""The P:D planner: one decision for both pools from the offered load and the engines' capacity.

Each evaluation, with L the mean prompt tokens per request, O the mean output tokens, h the
prefix-hit rate, Lu = L (1 - h) the prompt tokens a prefill engine really computes and
ctx = L + O / 2 the mean context of a decoding sequence:

1. Offered load: the prefill demand sample is the uncached prompt tokens/s, P = prompt tokens/s
   * (1 - h); the decode sample is the output tokens/s, D.
2. Forecast: each series goes through Holt's double exponential smoothing (forecast.py), and the
   planner sizes for F = max(sample, level + trend * horizon + k * sigma), horizon = the time a
   new pod takes to serve (start-up plus one interval), sigma the smoothed standard deviation of
   Holt's one-step errors and k = forecast_sigmas. It anticipates a rising load, keeps headroom
   in proportion to how bursty the load has been, and never shrinks ahead of a falling one. A queue is a backlog on top of the flow: each pool's demand is
   F + waiting * tokens per request / backlog_drain_s (Lu for prefill, O for decode).
3. Capacity per engine (tandem.common.capacity), from the seeded step cost times the learned
   slowdown s of the pool:
     prefill: C_p = b / t_p(b, Lu) tokens/s at full steps of b = max_num_batched_tokens, usable at
              utilisation u_p = min(target_utilization, rho_TTFT), rho_TTFT the utilisation at
              which service + ln(1 / (1 - quantile)) * Kingman's mean wait
              (variability * rho / (1 - rho) * t_p / 2) meets the TTFT target;
     decode:  C_d = B / t_d(B, ctx) tokens/s with B = min(B_ITL, kv_tokens * max_kv_usage / ctx,
              max_num_seqs), usable at u_d = target_utilization, or at 1 when the KV cache
              bounds B (max_kv_usage is then the headroom already; both would count it twice).
4. Replicas: raw = demand / (C * u). Above the current n: ceil(raw) at once, whole (no step
   limit: the size comes from capacity, not from a latency breach). Below n: min(n,
   ceil(raw / (1 - tolerance))), which is then held for scale_down_stabilization_s (the highest
   recommendation of the window wins, as in decision.py rule 5). Clamped to [min, max] per pool.
5. Learning: while a pool runs near its capacity, the measured mean latency updates its
   slowdown s <- (1 - eta) s + eta * measured / predicted, clamped to [0.25, 4], where predicted
   is the seeded model at the observed operating point:
     prefill: per request, (1 + Lu / b) * t_p(b, Lu), learned while steps are full (running per
              engine * Lu >= b);
     decode:  per token, t_d(running per engine, ctx), learned while the measured ITL is at least
              half its target.
   Only there: the model must be right where it sets capacity, and a lightly loaded engine's
   latency says little about its saturated throughput.
   The arrivals' variability (Kingman's c_a^2, 1 for Poisson) is learned the same way from the
   prefill pool's measured mean queue time Wq at its observed utilisation
   rho = P / (prefill engines * C_p), while 0.1 <= rho <= 0.95 and no backlog stands (at most
   one waiting request per engine: a backlog's queue time measures the backlog, not the
   arrivals):
     c_a^2 <- (1 - eta) c_a^2 + eta * Wq / (rho / (1 - rho) * t_p / 2), clamped to [0.25, 25].
   A bursty load thus buys itself headroom measured in its own queueing, not guessed.
6. No metrics: both pools hold their size (MetricsUnavailable); the forecast and the windows
   start again, the learned slowdowns are kept.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from tandem.common.capacity import (
    H200_LLAMA_8B_KV_TOKENS,
    StepCost,
    decode_capacity,
    decode_step_s,
    prefill_capacity,
    prefill_step_s,
    prefill_steps_per_prompt,
    prefill_wait_s,
)
from tandem.common.roles import Role
from tandem.operator.autoscaling.decision import Decision, Limit, Reason, ScalingMemory
from tandem.operator.autoscaling.forecast import Holt
from tandem.operator.autoscaling.planner_signals import PlannerSignals, PoolLoad

SLOWDOWN_BOUNDS = (0.25, 4.0)
VARIABILITY_BOUNDS = (0.25, 25.0)
# Utilisations between which a measured queue says something about the arrivals' variability.
VARIABILITY_RHO = (0.1, 0.95)


class PlannerPolicy(BaseModel):
    """Targets, limits and the engine model of the planner (docs/autoscaling.md, "The planner")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefill_min: int = Field(1, ge=0)
    prefill_max: int = Field(8, ge=1)
    decode_min: int = Field(1, ge=0)
    decode_max: int = Field(16, ge=1)
    target_ttft_s: float = Field(0.8, gt=0)
    target_itl_s: float = Field(0.05, gt=0)
    max_kv_usage: float = Field(0.85, gt=0, le=1)
    quantile: float = Field(0.9, gt=0, lt=1)
    target_utilization: float = Field(0.8, gt=0, le=1)
    step: StepCost = StepCost()
    kv_tokens: int = Field(H200_LLAMA_8B_KV_TOKENS, ge=1)
    max_num_batched_tokens: int = Field(8192, ge=1)
    max_num_seqs: int = Field(256, ge=1)
    horizon_s: float = Field(60.0, ge=0)
    alpha: float = Field(0.3, gt=0, le=1)
    beta: float = Field(0.3, ge=0, le=1)
    learning_rate: float = Field(0.2, ge=0, le=1)
    forecast_sigmas: float = Field(1.28, ge=0)
    backlog_drain_s: float = Field(30.0, gt=0)
    tolerance: float = Field(0.1, ge=0, lt=1)
    scale_down_stabilization_s: float = Field(300.0, ge=0)
    # Before any request finished: the sizes per request the capacity is computed for.
    default_prompt_tokens: float = Field(1024.0, gt=0)
    default_output_tokens: float = Field(128.0, gt=0)

    def bounds(self, pool: Role) -> tuple[int, int]:
        return (
            (self.prefill_min, self.prefill_max)
            if pool == "prefill"
            else (self.decode_min, self.decode_max)
        )


class PlannerMemory(BaseModel):
    """What the planner keeps between evaluations (held by the caller)."""

    model_config = ConfigDict(frozen=True)

    prefill_demand: Holt = Holt()
    decode_demand: Holt = Holt()
    prefill_slowdown: float = 1.0
    decode_slowdown: float = 1.0
    arrival_variability: float = 1.0
    prompt_tokens: float | None = None  # last known mean prompt tokens per request
    output_tokens: float | None = None
    pools: dict[Role, ScalingMemory] = Field(default_factory=dict)


class PoolPlan(BaseModel):
    """The planner's inputs and outcome for one pool, for status and the replay."""

    model_config = ConfigDict(frozen=True)

    demand_tokens_per_s: float  # sample of this evaluation (uncached prompt or output tokens/s)
    forecast_tokens_per_s: float  # what the pool is sized for, backlog included
    capacity_tokens_per_s: float  # one engine, saturated, with the learned slowdown
    utilization: float  # the share of capacity it is planned at
    slowdown: float
    replicas: float  # raw replicas before rounding


class Plan(BaseModel):
    """Both pools' decisions and what they were computed from."""

    model_config = ConfigDict(frozen=True)

    decisions: dict[Role, Decision]
    pools: dict[Role, PoolPlan] = Field(default_factory=dict)
    prompt_tokens: float = 0.0
    output_tokens: float = 0.0
    prefix_hit_rate: float = 0.0
    arrival_variability: float = 1.0


def _ceil(value: float) -> int:
    return math.ceil(round(value, 6))


def _learn(
    value: float,
    measured: float | None,
    predicted: float,
    rate: float,
    bounds: tuple[float, float] = SLOWDOWN_BOUNDS,
) -> float:
    """value <- (1 - rate) value + rate * measured / predicted, within bounds."""
    if measured is None or predicted <= 0:
        return value
    learned = (1 - rate) * value + rate * measured / predicted
    return min(max(learned, bounds[0]), bounds[1])


def _per_engine(load: PoolLoad) -> float:
    return load.running / load.engines if load.engines else 0.0


def _hold(
    policy: PlannerPolicy, current: dict[Role, int], memory: PlannerMemory, why: str
) -> tuple[Plan, PlannerMemory]:
    """Rule 6."""
    decisions = {}
    for pool, n in current.items():
        low, high = policy.bounds(pool)
        desired = min(max(n, low), high)
        decisions[pool] = Decision(
            pool=pool,
            current=n,
            desired=desired,
            recommendation=desired,
            reason="MetricsUnavailable",
            message=f"{pool}: holding {desired} replicas, {why}",
        )
    kept = PlannerMemory(
        prefill_slowdown=memory.prefill_slowdown,
        decode_slowdown=memory.decode_slowdown,
        arrival_variability=memory.arrival_variability,
        prompt_tokens=memory.prompt_tokens,
        output_tokens=memory.output_tokens,
    )
    return Plan(decisions=decisions), kept


def _settle(
    policy: PlannerPolicy,
    pool: Role,
    raw: float,
    current: int,
    state: ScalingMemory,
    now: float,
    why: str,
) -> tuple[Decision, ScalingMemory]:
    """Rule 4: round, clamp, grow at once, shrink after the stabilization window."""
    low, high = policy.bounds(pool)
    grow = raw > current
    wanted = _ceil(raw) if grow else min(current, _ceil(raw / (1 - policy.tolerance)))
    limit: Limit | None = None
    recommendation = wanted
    if wanted > high:
        recommendation, limit = high, "TooManyReplicas"
    elif wanted < low:
        recommendation, limit = low, "TooFewReplicas"
    observed_since = state.observed_since if state.observed_since is not None else now
    kept = tuple(
        (t, n) for t, n in state.recommendations if t >= now - policy.scale_down_stabilization_s
    )
    history = (*kept, (now, recommendation))
    new_state = ScalingMemory(observed_since=observed_since, recommendations=history)
    reason: Reason
    if current > high or current < low:
        desired = min(max(current, low), high)
    elif recommendation >= current:
        desired = recommendation
    elif now - observed_since < policy.scale_down_stabilization_s:
        desired = current
    else:
        desired = min(current, max(n for _, n in history))
    if desired > current:
        reason, message = "ScaledUp", f"{pool}: {current} -> {desired}: {why}"
    elif desired < current:
        reason, message = "ScaledDown", f"{pool}: {current} -> {desired}: {why}"
    elif recommendation < current:
        reason = "Stabilizing"
        message = (
            f"{pool}: holding {current} (plans {recommendation}; scale-down waits for "
            f"{policy.scale_down_stabilization_s:g}s of lower plans): {why}"
        )
    else:
        reason, message = "Steady", f"{pool}: steady at {current}: {why}"
    if limit == "TooManyReplicas":
        message += f" (capped at max {high}, wanted {wanted})"
    decision = Decision(
        pool=pool,
        current=current,
        desired=desired,
        recommendation=recommendation,
        reason=reason,
        message=message,
        limit=limit,
        signals={"planner": wanted},
    )
    return decision, new_state


def plan(
    policy: PlannerPolicy,
    signals: PlannerSignals | None,
    current: dict[Role, int],
    memory: PlannerMemory,
    now: float,
    unavailable_reason: str = "Prometheus returned no metrics for the pools",
) -> tuple[Plan, PlannerMemory]:
    """One evaluation of rules 1-6 for the pools in `current`; returns the plan and the memory
    to pass next time."""
    if signals is None or signals.prefill.engines == 0 or signals.decode.engines == 0:
        return _hold(policy, current, memory, unavailable_reason)

    prompt = signals.prompt_tokens_per_request or memory.prompt_tokens
    output = signals.output_tokens_per_request or memory.output_tokens
    prompt = prompt or policy.default_prompt_tokens
    output = output or policy.default_output_tokens
    hit = signals.prefix_hit_rate or 0.0
    uncached = max(prompt * (1 - hit), 1.0)
    context = prompt + output / 2
    budget = policy.max_num_batched_tokens

    # Rule 5, on the seeded model at the observed operating point.
    prefill_slowdown, decode_slowdown = memory.prefill_slowdown, memory.decode_slowdown
    if _per_engine(signals.prefill) * uncached >= budget:
        predicted = prefill_steps_per_prompt(uncached, budget) * prefill_step_s(
            policy.step, budget, uncached
        )
        prefill_slowdown = _learn(
            prefill_slowdown, signals.prefill.latency_s, predicted, policy.learning_rate
        )
    itl = signals.decode.latency_s
    if itl is not None and itl >= policy.target_itl_s / 2 and signals.decode.running:
        predicted = decode_step_s(policy.step, _per_engine(signals.decode), context)
        decode_slowdown = _learn(decode_slowdown, itl, predicted, policy.learning_rate)

    # Rules 1-2.
    samples: dict[Role, float] = {
        "prefill": signals.prompt_tokens_per_s * (1 - hit),
        "decode": signals.output_tokens_per_s,
    }
    holts: dict[Role, Holt] = {
        "prefill": memory.prefill_demand.update(samples["prefill"], now, policy.alpha, policy.beta),
        "decode": memory.decode_demand.update(samples["decode"], now, policy.alpha, policy.beta),
    }
    backlog: dict[Role, float] = {
        "prefill": signals.prefill.waiting * uncached / policy.backlog_drain_s,
        "decode": signals.decode.waiting * output / policy.backlog_drain_s,
    }

    # Rule 5, the arrivals' variability, at the observed utilisation.
    variability = memory.arrival_variability
    prefill_cost = policy.step.scaled(prefill_slowdown)
    capacity_p, _ = prefill_capacity(prefill_cost, uncached, budget, policy.target_ttft_s)
    observed_rho = samples["prefill"] / (signals.prefill.engines * capacity_p)
    backlog_free = signals.prefill.waiting <= signals.prefill.engines
    if backlog_free and VARIABILITY_RHO[0] <= observed_rho <= VARIABILITY_RHO[1]:
        variability = _learn(
            variability,
            signals.prefill.queue_s,
            prefill_wait_s(observed_rho, prefill_step_s(prefill_cost, budget, uncached), 1.0),
            policy.learning_rate,
            VARIABILITY_BOUNDS,
        )

    # Rule 3.
    capacity_p, rho = prefill_capacity(
        prefill_cost,
        uncached,
        budget,
        policy.target_ttft_s,
        variability,
        math.log(1 / (1 - policy.quantile)),
    )
    usable_kv = policy.kv_tokens * policy.max_kv_usage
    capacity_d, batch_d = decode_capacity(
        policy.step.scaled(decode_slowdown),
        context,
        policy.target_itl_s,
        usable_kv,
        policy.max_num_seqs,
    )
    kv_bound = batch_d >= usable_kv / context * (1 - 1e-9)
    capacities: dict[Role, tuple[float, float, float]] = {
        # An unreachable TTFT target (rho 0) plans at the target utilisation: best effort.
        "prefill": (
            capacity_p,
            min(rho or policy.target_utilization, policy.target_utilization),
            prefill_slowdown,
        ),
        "decode": (capacity_d, 1.0 if kv_bound else policy.target_utilization, decode_slowdown),
    }

    decisions: dict[Role, Decision] = {}
    pools: dict[Role, PoolPlan] = {}
    states = dict(memory.pools)
    for pool, n in current.items():
        capacity, utilization, slowdown = capacities[pool]
        forecast = holts[pool].upper(policy.horizon_s, policy.forecast_sigmas) + backlog[pool]
        raw = forecast / (capacity * utilization)
        unit = "uncached prompt" if pool == "prefill" else "output"
        why = (
            f"forecast {forecast:.4g} {unit} tokens/s over {capacity:.4g}/engine "
            f"x {utilization:.2f} = {raw:.2f} engines"
        )
        decisions[pool], states[pool] = _settle(
            policy, pool, raw, n, states.get(pool, ScalingMemory()), now, why
        )
        pools[pool] = PoolPlan(
            demand_tokens_per_s=samples[pool],
            forecast_tokens_per_s=forecast,
            capacity_tokens_per_s=capacity,
            utilization=utilization,
            slowdown=slowdown,
            replicas=raw,
        )
    new_memory = PlannerMemory(
        prefill_demand=holts["prefill"],
        decode_demand=holts["decode"],
        prefill_slowdown=prefill_slowdown,
        decode_slowdown=decode_slowdown,
        arrival_variability=variability,
        prompt_tokens=prompt,
        output_tokens=output,
        pools=states,
    )
    result = Plan(
        decisions=decisions,
        pools=pools,
        prompt_tokens=prompt,
        output_tokens=output,
        prefix_hit_rate=hit,
        arrival_variability=variability,
    )
    return result, new_memory
