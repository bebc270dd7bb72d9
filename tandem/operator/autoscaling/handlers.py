"""The autoscaler: every intervalSeconds read Prometheus, decide per pool, scale, record.

One asyncio task runs per ServingCluster whose `spec.autoscaling.enabled` is true, started and
stopped by a watch-event handler (`AutoscalerLoops`). Not a kopf daemon or timer: those put a
finalizer on the object, and deleting it would then hang while the operator is down or gone.
Each evaluation, per pool:
  1. reads the pool Deployment (labels tandem.dev/cluster, tandem.dev/role): current and ready;
  2. reads the pool's signals from Prometheus (queries.py); failures become MetricsUnavailable;
  3. calls the pure `decide` (decision.py) with the state kept since the last evaluation;
  4. ranks the pods of a pool it shrinks by cache (deletion_cost.py), then writes
     `status.autoscaling.<pool>` and the ScalingLimited / MetricsUnavailable conditions;
  5. sets the Deployment's replicas (a merge patch, field manager tandem-operator);
  6. posts an Event on a size change, on hitting a limit, and on losing or regaining metrics.
The status is written before the scale so that a reconcile in between renders the new size.
An evaluation that raises sets ScalingActive=False with a Warning Event, and the loop goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import kopf
from pydantic import ValidationError

from tandem.common.roles import LABEL_CLUSTER, LABEL_ROLE, ROLES, Role
from tandem.operator.api import API_VERSION, GROUP, KIND, PLURAL, VERSION, AutoscalingSpec
from tandem.operator.autoscaling.decision import Decision, ScalingMemory, decide
from tandem.operator.autoscaling.deletion_cost import rank_pool_for_scale_down
from tandem.operator.autoscaling.planner import PlannerMemory
from tandem.operator.autoscaling.planner_loop import (
    PlannerState,
    evaluate_planner,
    planner_policy,
    planner_status,
)
from tandem.operator.autoscaling.policy import PoolPolicy, pool_policies
from tandem.operator.autoscaling.prometheus import PrometheusClient, PrometheusUnavailable
from tandem.operator.autoscaling.queries import PoolSelector, read_pool_signals
from tandem.operator.autoscaling.signals import PoolSignals
from tandem.operator.autoscaling.status import (
    SCALING_ACTIVE,
    USER_LIMITS,
    autoscaling_conditions,
    condition,
    pool_status,
)
from tandem.operator.autoscaling.zero import (
    ZeroMemory,
    ZeroPolicy,
    ZeroStep,
    read_router_demand,
    zero_decision,
    zero_steps,
)
from tandem.operator.handlers import kube as operator_kube
from tandem.operator.kube import FIELD_MANAGER, Kube, object_path
from tandem.operator.metrics import record_decision


def _enabled(spec: Mapping[str, Any], **_: Any) -> bool:
    """Autoscaling on, and not handed to KEDA or an HPA (a `provider` other than tandem)."""
    autoscaling = spec.get("autoscaling") or {}
    return bool(autoscaling.get("enabled")) and autoscaling.get("provider", "tandem") == "tandem"


def _stamp() -> str:
    """RFC 3339 with milliseconds: evaluations a few seconds apart stay ordered and replayable."""
    return (
        datetime.datetime.now(datetime.UTC)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )


def pool_deployments(kube: Kube, namespace: str, cluster: str) -> dict[Role, tuple[str, int, int]]:
    """pool -> (Deployment name, spec.replicas, status.readyReplicas) of the cluster's pools."""
    found: dict[Role, tuple[str, int, int]] = {}
    for item in kube.list("apps/v1", "Deployment", namespace, f"{LABEL_CLUSTER}={cluster}"):
        role = item["metadata"].get("labels", {}).get(LABEL_ROLE)
        for pool in ROLES:
            if role == pool:
                replicas = item.get("spec", {}).get("replicas", 1)
                ready = item.get("status", {}).get("readyReplicas", 0)
                found[pool] = (item["metadata"]["name"], int(replicas), int(ready))
    return found


def scale_deployment(kube: Kube, namespace: str, name: str, replicas: int) -> None:
    """Set the Deployment's spec.replicas with a merge patch under the operator's field manager.

    The Deployment itself rather than its scale subresource, so the operator's RBAC (patch on
    deployments) is all it needs; the next server-side apply renders the same count from status.
    """
    kube.request(
        "PATCH",
        object_path("apps/v1", "Deployment", namespace, name),
        [("fieldManager", FIELD_MANAGER)],
        {"spec": {"replicas": replicas}},
        "application/merge-patch+json",
    )


async def _read_signals(
    prometheus: PrometheusClient, selector: PoolSelector, policy: PoolPolicy
) -> tuple[PoolSignals | None, str]:
    """The pool's signals, or None and why not."""
    try:
        signals = await read_pool_signals(prometheus, selector, policy)
    except PrometheusUnavailable as exc:
        return None, str(exc)
    if signals.engines == 0:
        return (
            None,
            f"Prometheus at {prometheus.base_url} has no engine metrics for {selector.matchers()}",
        )
    return signals, ""


def _events(body: Mapping[str, Any], decision: Decision, previous: Decision | None) -> None:
    """Post an Event when the size changes or a limit or a metrics gap starts or ends."""
    if decision.changed:
        _post(body, "Normal", decision.reason, decision.message)
    if decision.limit in USER_LIMITS and (previous is None or previous.limit != decision.limit):
        _post(body, "Warning", "ScalingLimited", decision.message)
    unavailable = decision.reason == "MetricsUnavailable"
    was_unavailable = previous is not None and previous.reason == "MetricsUnavailable"
    if unavailable and not was_unavailable:
        _post(body, "Warning", "MetricsUnavailable", decision.message)
    elif was_unavailable and not unavailable:
        _post(body, "Normal", "MetricsAvailable", decision.message)


def _post(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    kopf.event(dict(body), type=type_, reason=reason, message=message)  # type: ignore[arg-type]


async def evaluate(
    kube: Kube,
    body: Mapping[str, Any],
    autoscaling: AutoscalingSpec,
    states: dict[Role, ScalingMemory],
    last: dict[Role, Decision],
    logger: logging.Logger | kopf.Logger,
    planner: PlannerState | None = None,
    zero: ZeroClock | None = None,
) -> dict[Role, Decision]:
    """One evaluation of both pools (steps 1-6 above); updates `states`, `last`, `planner` and
    `zero` (the scale-to-zero idle clock) in place. With `mode: planner`, step 3 is one `plan`
    (planner.py) for both pools, whose memory `planner` keeps. With scale-to-zero on, the zero
    rules (zero.py) set the size of a pool at 0 and of every pool when the cluster goes to sleep,
    in place of either mode's decision; in planner mode both pools wake together, and the
    planner's memory starts afresh whenever the zero rules set a size."""
    name, namespace = body["metadata"]["name"], body["metadata"].get("namespace") or "default"
    policies = pool_policies(autoscaling)
    deployments = await asyncio.to_thread(pool_deployments, kube, namespace, name)
    pools = [pool for pool in ROLES if pool in deployments]
    if not pools:
        logger.debug("autoscaler: no pool Deployment yet")
        return {}
    planned = None
    async with PrometheusClient(autoscaling.prometheus_url) as prometheus:
        now = time.monotonic()
        steps = await _zero_steps(prometheus, autoscaling, body, deployments, zero, now)
        if steps and planner is not None:
            planner.memory = PlannerMemory()  # asleep or waking: the next plan starts afresh
        if autoscaling.mode == "planner" and any(pool not in steps for pool in pools):
            spec = body.get("spec") or {}
            planned, _ = await evaluate_planner(
                prometheus,
                namespace,
                name,
                planner_policy(autoscaling, spec.get("prefill") or {}, spec.get("decode") or {}),
                autoscaling.metrics_window_seconds,
                {pool: deployments[pool][1] for pool in pools},
                planner if planner is not None else PlannerState(),
                now,
            )
        readings = await asyncio.gather(
            *(
                _read_signals(
                    prometheus,
                    PoolSelector(namespace=namespace, cluster=name, pool=pool),
                    policies[pool],
                )
                for pool in pools
            )
        )
    stamp = _stamp()
    previous_status: Mapping[str, Any] = body.get("status", {}).get("autoscaling") or {}
    decisions: dict[Role, Decision] = {}
    status: dict[str, Any] = {"autoscaling": {}}
    for pool, (signals, why) in zip(pools, readings, strict=True):
        _, current, ready = deployments[pool]
        if pool in steps:
            # Scale to zero and back: the pool's own rules start afresh once it runs again.
            decision, states[pool] = zero_decision(steps[pool], current), ScalingMemory()
        elif planned is not None:
            decision = planned.decisions[pool]
        else:
            decision, states[pool] = decide(
                policies[pool],
                signals,
                current,
                ready,
                states.get(pool, ScalingMemory()),
                now,
                why or "no metrics",
            )
        decisions[pool] = decision
        record_decision(namespace, name, policies[pool], decision, signals, ready)
        status["autoscaling"][pool] = pool_status(
            decision, signals, ready, previous_status.get(pool), stamp
        )
        if planned is not None:
            status["autoscaling"][pool]["planner"] = planner_status(planned, pool)
    status["conditions"] = autoscaling_conditions(
        decisions.values(), body.get("status", {}).get("conditions") or [], stamp
    )
    for pool, decision in decisions.items():
        if decision.desired < decision.current:  # before status: a reconcile may apply it at once
            selector = PoolSelector(namespace=namespace, cluster=name, pool=pool)
            await rank_pool_for_scale_down(kube, autoscaling.prometheus_url, selector, logger)
    await asyncio.to_thread(kube.patch_status, API_VERSION, KIND, namespace, name, status)
    for pool, decision in decisions.items():
        if decision.changed:
            await asyncio.to_thread(
                scale_deployment, kube, namespace, deployments[pool][0], decision.desired
            )
            logger.info(f"autoscaler: {decision.message}")
        _events(body, decision, last.get(pool))
        last[pool] = decision
    return decisions


class ZeroClock:
    """The scale-to-zero memory of one cluster's loop (its idle clock)."""

    def __init__(self) -> None:
        self.memory = ZeroMemory()


async def _zero_steps(
    prometheus: PrometheusClient,
    autoscaling: AutoscalingSpec,
    body: Mapping[str, Any],
    deployments: Mapping[Role, tuple[str, int, int]],
    zero: ZeroClock | None,
    now: float,
) -> dict[Role, ZeroStep]:
    """The pools whose size the scale-to-zero rules set this evaluation (none when it is off)."""
    settings = autoscaling.scale_to_zero
    if zero is None or not settings.enabled:
        return {}
    meta = body["metadata"]
    router = body.get("spec", {}).get("router") or {}
    window = max(autoscaling.metrics_window_seconds, 2 * autoscaling.interval_seconds)
    demand = await read_router_demand(
        prometheus, meta.get("namespace") or "default", meta["name"], window
    )
    policy = ZeroPolicy(
        idle_s=settings.idle_seconds,
        mode=(router.get("disaggregation") or {}).get("mode", "auto"),
        decode_min=autoscaling.decode.min,
        prefill_min=autoscaling.prefill.min,
        together=autoscaling.mode == "planner",
    )
    sizes = {pool: current for pool, (_, current, _) in deployments.items()}
    steps, zero.memory = zero_steps(policy, demand, sizes, zero.memory, now)
    return steps


async def report_failure(kube: Kube, body: Mapping[str, Any], exc: Exception) -> None:
    """An evaluation that raised: ScalingActive=False and a Warning Event (the sizes are held)."""
    meta = body["metadata"]
    message = f"autoscaler evaluation failed: {exc.__class__.__name__}: {exc}"
    existing = body.get("status", {}).get("conditions") or []
    previous = next((c for c in existing if c.get("type") == SCALING_ACTIVE), None)
    failed = condition(SCALING_ACTIVE, False, "EvaluationFailed", message, previous, _stamp())
    conditions = [c for c in existing if c.get("type") != SCALING_ACTIVE] + [failed]
    await asyncio.to_thread(
        kube.patch_status,
        API_VERSION,
        KIND,
        meta.get("namespace") or "default",
        meta["name"],
        {"conditions": conditions},
    )
    _post(body, "Warning", "AutoscalerFailed", message)


async def autoscale(
    kube: Kube,
    latest: Callable[[], Mapping[str, Any]],
    logger: logging.Logger,
    leading: Callable[[], bool] = lambda: True,
) -> None:
    """Evaluate every `spec.autoscaling.intervalSeconds` of the latest body, until cancelled.

    Only while `leading()`: of several operator replicas only the active peer scales (kopf's
    peering pause does not reach this loop); a standby's turn passes, and it starts from fresh
    state when it takes over."""
    states: dict[Role, ScalingMemory] = {}
    last: dict[Role, Decision] = {}
    planner = PlannerState()
    zero = ZeroClock()
    while True:
        interval = 15.0
        body = latest()
        if not leading():
            states.clear()
            last.clear()
            planner = PlannerState()
            zero = ZeroClock()
            await asyncio.sleep(interval)
            continue
        try:
            autoscaling = AutoscalingSpec.model_validate(
                body.get("spec", {}).get("autoscaling") or {}
            )
            interval = autoscaling.interval_seconds
            await evaluate(kube, body, autoscaling, states, last, logger, planner, zero)
        except ValidationError as exc:
            logger.error(f"autoscaler: invalid spec.autoscaling: {exc}")
        except Exception as exc:  # one failed evaluation must not end the loop; the next retries
            logger.exception(f"autoscaler: evaluation failed: {exc}")
            with contextlib.suppress(Exception):
                await report_failure(kube, body, exc)
            last.clear()  # the next good evaluation announces itself again
        await asyncio.sleep(interval)


class AutoscalerLoops:
    """One `autoscale` task per autoscaled ServingCluster (by uid), fed the latest body from
    watch events; a task stops when autoscaling is turned off or the object is deleted."""

    def __init__(
        self,
        client: Callable[[], Kube],
        logger: logging.Logger,
        leading: Callable[[], bool] = lambda: True,
    ) -> None:
        self.client = client
        self.logger = logger
        self.leading = leading
        self.bodies: dict[str, Mapping[str, Any]] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def observe(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        uid = body["metadata"]["uid"]
        gone = event_type == "DELETED" or body["metadata"].get("deletionTimestamp")
        if gone or not _enabled(body.get("spec") or {}):
            self.stop(uid)
            return
        self.bodies[uid] = body
        if uid not in self.tasks:
            self.tasks[uid] = asyncio.get_running_loop().create_task(
                autoscale(self.client(), lambda: self.bodies[uid], self.logger, self.leading),
                name=f"autoscaler-{body['metadata'].get('namespace')}-{body['metadata']['name']}",
            )

    def stop(self, uid: str) -> None:
        task = self.tasks.pop(uid, None)
        self.bodies.pop(uid, None)
        if task is not None:
            task.cancel()

    async def stop_all(self) -> None:
        tasks = list(self.tasks.values())
        for uid in list(self.tasks):
            self.stop(uid)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


def register(
    registry: kopf.OperatorRegistry,
    client: Callable[[], Kube] = operator_kube,
    leading: Callable[[], bool] = lambda: True,
) -> None:
    """Drive `AutoscalerLoops` from ServingCluster watch events (which put no finalizer); the
    loops scale only while `leading()` (this replica is the active peer)."""
    loops = AutoscalerLoops(client, logging.getLogger("tandem.operator.autoscaler"), leading)

    @kopf.on.event(GROUP, VERSION, PLURAL, id="autoscaler", registry=registry)
    async def autoscaler_event(event: kopf.RawEvent, body: kopf.Body, **_: Any) -> None:
        loops.observe(event.get("type"), dict(body))

    @kopf.on.cleanup(id="stop_autoscalers", registry=registry)
    async def stop_autoscalers(**_: Any) -> None:
        await loops.stop_all()
