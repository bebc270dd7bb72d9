"""The operator's Prometheus metrics: reconciles, their durations, pool sizes, autoscaler decisions.

Series about a ServingCluster carry the labels `namespace` and `tandem_dev_cluster` (the same
names the engines' and router's series get from their monitors), so rules join them without
relabelling; the operator's ServiceMonitor scrapes with honorLabels so Prometheus keeps these
instead of the operator pod's own namespace.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Mapping
from typing import Any, ParamSpec, get_args
from wsgiref.simple_server import WSGIServer

import kopf
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from tandem.operator.api_status import ServingClusterStatus
from tandem.operator.autoscaling.decision import Decision, Limit
from tandem.operator.autoscaling.policy import PoolPolicy
from tandem.operator.autoscaling.signals import PoolSignals

CLUSTER_LABELS = ("namespace", "tandem_dev_cluster")
POOL_LABELS = (*CLUSTER_LABELS, "pool")
COMPONENTS = ("prefill", "decode", "router")

REGISTRY = CollectorRegistry()
RECONCILES = Counter(
    "tandem_operator_reconciles",
    "Reconciles of a ServingCluster by result: applied, gone, invalid_spec, apply_failed, error.",
    [*CLUSTER_LABELS, "result"],
    registry=REGISTRY,
)
RECONCILE_DURATION = Histogram(
    "tandem_operator_reconcile_duration_seconds",
    "Time to render, apply, prune and report one ServingCluster.",
    CLUSTER_LABELS,
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
    registry=REGISTRY,
)
POOL_REPLICAS = Gauge(
    "tandem_operator_pool_replicas",
    "Replicas of a ServingCluster's Deployment as last reported in its status (state: desired, ready).",
    [*POOL_LABELS, "state"],
    registry=REGISTRY,
)
EVALUATIONS = Counter(
    "tandem_operator_autoscaler_evaluations",
    "Autoscaler evaluations of a pool by decision: ScaledUp, ScaledDown, Steady, Stabilizing, MetricsUnavailable, Asleep (held at zero).",
    [*POOL_LABELS, "decision"],
    registry=REGISTRY,
)
REPLICAS = Gauge(
    "tandem_operator_autoscaler_replicas",
    "The autoscaler's view of a pool at its last evaluation (kind: current, ready, recommendation, desired, min, max).",
    [*POOL_LABELS, "kind"],
    registry=REGISTRY,
)
SIGNAL = Gauge(
    "tandem_operator_autoscaler_signal",
    "Signals the autoscaler read from Prometheus at its last evaluation (engines, latency_seconds, waiting, running, kv_usage, request_rate).",
    [*POOL_LABELS, "signal"],
    registry=REGISTRY,
)
TARGET = Gauge(
    "tandem_operator_autoscaler_signal_target",
    "The pool's targets (latency_seconds, waiting_per_replica, kv_usage).",
    [*POOL_LABELS, "signal"],
    registry=REGISTRY,
)
RECOMMENDATION = Gauge(
    "tandem_operator_autoscaler_signal_recommendation",
    "Replicas each signal recommended at the last evaluation (latency, queue, kvUsage, idle).",
    [*POOL_LABELS, "signal"],
    registry=REGISTRY,
)
LIMITED = Gauge(
    "tandem_operator_autoscaler_limited",
    "1 when the last decision hit this limit (TooManyReplicas, TooFewReplicas, ScaleUpLimit).",
    [*POOL_LABELS, "limit"],
    registry=REGISTRY,
)
METRICS_AVAILABLE = Gauge(
    "tandem_operator_autoscaler_metrics_available",
    "0 when the last evaluation could not read the pool's metrics (MetricsUnavailable), else 1.",
    POOL_LABELS,
    registry=REGISTRY,
)

P = ParamSpec("P")


def serve(port: int, host: str = "0.0.0.0") -> WSGIServer:
    """Serve /metrics on host:port from a daemon thread; `shutdown()` the server to stop."""
    server, _ = start_http_server(port, addr=host, registry=REGISTRY)
    return server


def observe_reconcile(reconcile: Callable[P, str | None]) -> Callable[P, str | None]:
    """Count and time each call of `reconcile(kube, body, ...)` by its result."""

    @functools.wraps(reconcile)
    def timed(*args: P.args, **kwargs: P.kwargs) -> str | None:
        body: Mapping[str, Any] = kwargs.get("body") or (args[1] if len(args) > 1 else {})  # type: ignore[assignment]
        meta = body.get("metadata", {})
        labels = (meta.get("namespace", ""), meta.get("name", ""))
        result, start = "error", time.perf_counter()
        try:
            phase = reconcile(*args, **kwargs)
            result = "applied" if phase is not None else "gone"
            return phase
        except kopf.PermanentError:
            result = "invalid_spec"
            raise
        except kopf.TemporaryError:
            result = "apply_failed"
            raise
        finally:
            RECONCILES.labels(*labels, result).inc()
            RECONCILE_DURATION.labels(*labels).observe(time.perf_counter() - start)

    return timed


def record_pools(namespace: str, cluster: str, status: ServingClusterStatus) -> None:
    """Pool sizes from a freshly aggregated status; a component no longer rendered is dropped."""
    for component in COMPONENTS:
        pool = getattr(status, component)
        for state in ("desired", "ready"):
            labels = (namespace, cluster, component, state)
            if pool is None:
                _remove(POOL_REPLICAS, labels)
            else:
                POOL_REPLICAS.labels(*labels).set(getattr(pool, state))


def record_decision(
    namespace: str,
    cluster: str,
    policy: PoolPolicy,
    decision: Decision,
    signals: PoolSignals | None,
    ready: int,
) -> None:
    """One autoscaler evaluation of one pool: its outcome, sizes, signals, targets and limits."""
    labels = (namespace, cluster, policy.pool)
    EVALUATIONS.labels(*labels, decision.reason).inc()
    sizes = {
        "current": decision.current,
        "ready": ready,
        "recommendation": decision.recommendation,
        "desired": decision.desired,
        "min": policy.min_replicas,
        "max": policy.max_replicas,
    }
    _set(REPLICAS, labels, sizes, ())
    METRICS_AVAILABLE.labels(*labels).set(0 if decision.reason == "MetricsUnavailable" else 1)
    observed: dict[str, float | None] = {}
    if signals is not None:
        observed = {
            "engines": signals.engines,
            "latency_seconds": signals.latency_s,
            "waiting": signals.waiting,
            "running": signals.running,
            "kv_usage": signals.kv_usage,
            "request_rate": signals.request_rate,
        }
    _set(
        SIGNAL,
        labels,
        observed,
        ("engines", "latency_seconds", "waiting", "running", "kv_usage", "request_rate"),
    )
    targets = {
        "latency_seconds": policy.target_latency_s,
        "waiting_per_replica": policy.target_waiting_per_replica,
        "kv_usage": policy.max_kv_usage,
    }
    _set(TARGET, labels, targets, tuple(targets))
    _set(RECOMMENDATION, labels, dict(decision.signals), ("latency", "queue", "kvUsage", "idle"))
    _set(LIMITED, labels, {limit: float(decision.limit == limit) for limit in get_args(Limit)}, ())


def forget_cluster(namespace: str, cluster: str) -> None:
    """Drop every series of a deleted ServingCluster, so no alert fires on what is gone."""
    for metric in (RECONCILES, RECONCILE_DURATION, POOL_REPLICAS, EVALUATIONS, REPLICAS,
                   SIGNAL, TARGET, RECOMMENDATION, LIMITED, METRICS_AVAILABLE):  # fmt: skip
        for family in metric.collect():
            for sample in family.samples:
                if (sample.labels.get("namespace"), sample.labels.get("tandem_dev_cluster")) == (
                    namespace,
                    cluster,
                ):
                    values = [sample.labels[name] for name in metric._labelnames]
                    _remove(metric, tuple(values))


def _set(
    gauge: Gauge,
    labels: tuple[str, ...],
    values: Mapping[str, float | None],
    known: tuple[str, ...],
) -> None:
    """Set gauge{labels, key} for each value; remove the keys in `known` that are absent or None."""
    for key in {*known, *values}:
        value = values.get(key)
        if value is None:
            _remove(gauge, (*labels, key))
        else:
            gauge.labels(*labels, key).set(value)


def _remove(metric: Counter | Gauge | Histogram, labels: tuple[str, ...]) -> None:
    with contextlib.suppress(KeyError):
        metric.remove(*labels)
