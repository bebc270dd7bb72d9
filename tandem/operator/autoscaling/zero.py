"""Scale to zero and back, both pools together: the pure rule, and the router demand it reads.

Rules (`spec.autoscaling.scaleToZero`; d, p = current decode and prefill replicas; the router's
demand as Prometheus holds it: held = requests waiting for a decode engine now, arrived =
requests that arrived in the window, in flight = requests open on engines now, wanted = requests in
the window that P/D would have taken had a prefill engine been ready):

1. Activity. The cluster is active at an evaluation where held + arrived + in flight > 0; the
   idle clock starts at the first evaluation and restarts at every active one.
2. Wake decode first. d = 0 and held > 0 -> decode to max(decode.min, 1). Only held requests
   wake a pool: they stay held (and counted) until an engine is ready or the router's wait bound
   passes, so a pool asleep never misses one, and requests that arrived in the window before a
   sleep never wake it again.
3. Wake prefill when P/D pays. A prefill pool at 0 goes to prefill.min when decode wakes and the
   disaggregation mode is `always` or the autoscaler is in planner mode (`together`: the planner
   sizes both pools from one plan, which needs both pools' metrics, so they sleep and wake
   together), or, decode awake, once wanted > 0 (`auto`: a prompt with at
   least minUncachedTokens uncached tokens was served locally for want of a prefill engine).
4. A pool at 0 that rule 2 or 3 does not wake stays at 0, whatever its own signals or `min` say
   (they are read only for a pool that runs).
5. Sleep. Router metrics present, nothing active now, and the idle clock at idleSeconds or more ->
   every running pool to 0 at once.
6. No router metrics: nothing wakes and nothing sleeps (a pool at 0 stays there, a running pool
   follows its own rules).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tandem.common.roles import Role
from tandem.operator.autoscaling.decision import Decision, Reason
from tandem.operator.autoscaling.prometheus import PrometheusClient, PrometheusUnavailable
from tandem.operator.autoscaling.queries import CLUSTER_LABEL, NAMESPACE_LABEL, ROLE_LABEL


class RouterDemand(BaseModel):
    """What the cluster's routers report, summed over them (see the module docstring)."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    routers: int = Field(ge=0)
    held: float = Field(0.0, ge=0)
    arrived: float = Field(0.0, ge=0)
    in_flight: float = Field(0.0, ge=0)
    prefill_wanted: float = Field(0.0, ge=0)

    @property
    def active(self) -> bool:
        return self.held > 0 or self.arrived > 0 or self.in_flight > 0


class ZeroPolicy(BaseModel):
    """The scale-to-zero settings of one cluster, with the pools' floors when awake."""

    model_config = ConfigDict(frozen=True)

    idle_s: float = Field(ge=0)
    mode: str  # the router's disaggregation mode: auto, always or never
    decode_min: int = Field(ge=1)
    prefill_min: int = Field(ge=1)
    together: bool = False  # planner mode: prefill wakes with decode (rule 3)


class ZeroMemory(BaseModel):
    """When the cluster was last active (rule 1); kept by the caller between evaluations."""

    model_config = ConfigDict(frozen=True)

    last_active: float | None = None


class ZeroStep(BaseModel):
    """A pool's size set by the scale-to-zero rules, in place of its own rules' decision."""

    model_config = ConfigDict(frozen=True)

    pool: Role
    desired: int
    message: str


def zero_steps(
    policy: ZeroPolicy,
    demand: RouterDemand | None,
    sizes: Mapping[Role, int],
    memory: ZeroMemory,
    now: float,
) -> tuple[dict[Role, ZeroStep], ZeroMemory]:
    """Rules 1-6: the pools whose size these rules set (the others follow their own rules), and
    the memory for the next evaluation. `sizes` holds the pools that exist."""
    seen = demand is not None and demand.routers > 0
    active = seen and demand is not None and demand.active
    last_active = now if memory.last_active is None or active else memory.last_active
    new_memory = ZeroMemory(last_active=last_active)
    steps: dict[Role, ZeroStep] = {}
    decode, prefill = sizes.get("decode", 0), sizes.get("prefill")
    held = demand.held if demand is not None else 0.0
    wanted = demand.prefill_wanted if demand is not None else 0.0
    idle_for = now - last_active

    if seen and not active and idle_for >= policy.idle_s and (decode or prefill):
        for pool, size in sizes.items():
            if size:
                steps[pool] = ZeroStep(
                    pool=pool,
                    desired=0,
                    message=f"{pool}: {size} -> 0: no request for {idle_for:.0f}s "
                    f"(idleSeconds {policy.idle_s:g})",
                )
        return steps, new_memory

    wakes_decode = decode == 0 and held > 0
    if decode == 0:
        if wakes_decode:
            steps["decode"] = ZeroStep(
                pool="decode",
                desired=policy.decode_min,
                message=f"decode: 0 -> {policy.decode_min}: {held:g} request(s) held by the router",
            )
        else:
            steps["decode"] = ZeroStep(pool="decode", desired=0, message=_asleep("decode", seen))
    if prefill == 0:
        decode_awake = decode > 0 or wakes_decode
        if decode_awake and policy.together:
            why = "decode wakes and the planner sizes both pools"
            steps["prefill"] = _wake_prefill(policy, why)
        elif decode_awake and policy.mode == "always":
            why = "decode wakes and disaggregation mode is always"
            steps["prefill"] = _wake_prefill(policy, why)
        elif decode > 0 and policy.mode == "auto" and wanted > 0:
            why = f"{wanted:g} request(s) in the window would have gone P/D"
            steps["prefill"] = _wake_prefill(policy, why)
        else:
            why = "P/D not wanted yet" if decode_awake else _asleep("prefill", seen)
            steps["prefill"] = ZeroStep(pool="prefill", desired=0, message=f"prefill: at 0, {why}")
    return steps, new_memory


def _wake_prefill(policy: ZeroPolicy, why: str) -> ZeroStep:
    return ZeroStep(
        pool="prefill",
        desired=policy.prefill_min,
        message=f"prefill: 0 -> {policy.prefill_min}: {why}",
    )


def _asleep(pool: str, seen: bool) -> str:
    if not seen:
        return f"{pool}: at 0, no router metrics (nothing wakes it)"
    return f"{pool}: at 0, no request held"


def router_matchers(namespace: str, cluster: str) -> str:
    """The label matchers of one cluster's router series, e.g.
    `{namespace="serving",tandem_dev_cluster="llama",tandem_dev_role="router"}` (the router pods'
    labels as the rendered ServiceMonitor copies them)."""
    pairs = ((NAMESPACE_LABEL, namespace), (CLUSTER_LABEL, cluster), (ROLE_LABEL, "router"))
    # A JSON string is a valid PromQL string literal: the same escapes for \\, " and newlines.
    return "{" + ",".join(f"{name}={json.dumps(value)}" for name, value in pairs) + "}"


def demand_queries(namespace: str, cluster: str, window_s: float) -> dict[str, str]:
    """One PromQL expression per field of RouterDemand (`w` the window, `sel` router_matchers):

    - routers:        count(tandem_router_queue_waiting{sel})
    - held:           sum(tandem_router_engine_wait_requests{sel})
    - arrived:       sum(increase(tandem_router_arrivals_total{sel}[w]))
    - in_flight:      sum(tandem_router_engine_in_flight{sel})
    - prefill_wanted: sum(increase(tandem_router_prefill_wanted_total{sel}[w]))
    """
    sel = router_matchers(namespace, cluster)
    window = f"{max(1, round(window_s))}s"
    return {
        "routers": f"count(tandem_router_queue_waiting{sel})",
        "held": f"sum(tandem_router_engine_wait_requests{sel})",
        "arrived": f"sum(increase(tandem_router_arrivals_total{sel}[{window}]))",
        "in_flight": f"sum(tandem_router_engine_in_flight{sel})",
        "prefill_wanted": f"sum(increase(tandem_router_prefill_wanted_total{sel}[{window}]))",
    }


async def read_router_demand(
    client: PrometheusClient, namespace: str, cluster: str, window_s: float
) -> RouterDemand | None:
    """The routers' demand, or None when Prometheus fails or answers implausibly (rule 6)."""
    queries = demand_queries(namespace, cluster, window_s)
    try:
        values = await asyncio.gather(*(client.value(q) for q in queries.values()))
        observed = {key: value or 0.0 for key, value in zip(queries, values, strict=True)}
        return RouterDemand(routers=round(observed.pop("routers")), **observed)
    except (PrometheusUnavailable, ValidationError):
        return None


def zero_decision(step: ZeroStep, current: int) -> Decision:
    """The Decision of a pool whose size the scale-to-zero rules set (zero.py): ScaledUp when it
    wakes, ScaledDown when it sleeps, Asleep while it stays at 0."""
    reason: Reason
    if step.desired > current:
        reason = "ScaledUp"
    elif step.desired < current:
        reason = "ScaledDown"
    else:
        reason = "Asleep" if current == 0 else "Steady"
    return Decision(
        pool=step.pool,
        current=current,
        desired=step.desired,
        recommendation=step.desired,
        reason=reason,
        message=step.message,
    )
