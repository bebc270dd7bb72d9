"""The operator's /metrics: reconcile results and durations, pool sizes, autoscaler decisions."""

from __future__ import annotations

from typing import Any

import httpx
import kopf
import pytest

from tandem.common.ports import free_port
from tandem.operator import metrics
from tandem.operator.api_status import PoolStatus, ServingClusterStatus
from tandem.operator.autoscaling.decision import ScalingMemory, decide
from tandem.operator.autoscaling.policy import pool_policies
from tandem.operator.autoscaling.signals import PoolSignals
from tandem.operator.main import parse_args

POLICY = pool_policies(
    {"enabled": True, "prefill": {"min": 1, "max": 2, "targetTTFTSeconds": 0.5}}
)["prefill"]


def value(name: str, **labels: str) -> float | None:
    return metrics.REGISTRY.get_sample_value(name, labels)


def body(name: str) -> dict[str, Any]:
    return {"metadata": {"namespace": "ops", "name": name}}


@metrics.observe_reconcile
def reconcile(kube: object, body: dict[str, Any], outcome: str = "Ready") -> str | None:
    if outcome == "invalid":
        raise kopf.PermanentError("bad spec")
    if outcome == "refused":
        raise kopf.TemporaryError("apply failed", delay=1)
    return None if outcome == "gone" else outcome


@pytest.mark.parametrize(
    ("outcome", "result"),
    [
        ("Ready", "applied"),
        ("gone", "gone"),
        ("invalid", "invalid_spec"),
        ("refused", "apply_failed"),
    ],
)
def test_reconciles_are_counted_by_result_and_timed(outcome: str, result: str) -> None:
    labels = {"namespace": "ops", "tandem_dev_cluster": f"rec-{outcome}"}
    if outcome in {"invalid", "refused"}:
        with pytest.raises((kopf.PermanentError, kopf.TemporaryError)):
            reconcile(None, body(f"rec-{outcome}"), outcome)
    else:
        reconcile(None, body(f"rec-{outcome}"), outcome)
    assert value("tandem_operator_reconciles_total", **labels, result=result) == 1
    assert value("tandem_operator_reconcile_duration_seconds_count", **labels) == 1


def test_pool_sizes_follow_the_status_and_drop_removed_pools() -> None:
    labels = {"namespace": "ops", "tandem_dev_cluster": "pools"}
    status = ServingClusterStatus(
        prefill=PoolStatus(desired=2, ready=1), decode=PoolStatus(desired=3, ready=3)
    )
    metrics.record_pools("ops", "pools", status)
    assert value("tandem_operator_pool_replicas", **labels, pool="prefill", state="desired") == 2
    assert value("tandem_operator_pool_replicas", **labels, pool="prefill", state="ready") == 1
    metrics.record_pools(
        "ops", "pools", ServingClusterStatus(decode=PoolStatus(desired=3, ready=2))
    )
    assert value("tandem_operator_pool_replicas", **labels, pool="prefill", state="ready") is None
    assert value("tandem_operator_pool_replicas", **labels, pool="decode", state="ready") == 2


def test_a_decision_records_its_signals_targets_and_limit() -> None:
    labels = {"namespace": "ops", "tandem_dev_cluster": "scale", "pool": "prefill"}
    signals = PoolSignals(
        pool="prefill", engines=2, latency_s=2.0, waiting=4, running=2, request_rate=3
    )
    decision, _ = decide(POLICY, signals, current=2, ready=2, state=ScalingMemory(), now=0.0)
    assert decision.limit == "TooManyReplicas"
    metrics.record_decision("ops", "scale", POLICY, decision, signals, ready=2)
    assert value("tandem_operator_autoscaler_evaluations_total", **labels, decision="Steady") == 1
    assert value("tandem_operator_autoscaler_replicas", **labels, kind="max") == 2
    assert value("tandem_operator_autoscaler_replicas", **labels, kind="desired") == 2
    assert value("tandem_operator_autoscaler_signal", **labels, signal="latency_seconds") == 2.0
    assert value("tandem_operator_autoscaler_signal", **labels, signal="kv_usage") is None
    assert (
        value("tandem_operator_autoscaler_signal_target", **labels, signal="latency_seconds") == 0.5
    )
    assert (
        value("tandem_operator_autoscaler_signal_recommendation", **labels, signal="latency") == 8
    )
    assert value("tandem_operator_autoscaler_limited", **labels, limit="TooManyReplicas") == 1
    assert value("tandem_operator_autoscaler_limited", **labels, limit="ScaleUpLimit") == 0
    assert value("tandem_operator_autoscaler_metrics_available", **labels) == 1

    gap, _ = decide(POLICY, None, current=2, ready=2, state=ScalingMemory(), now=1.0)
    metrics.record_decision("ops", "scale", POLICY, gap, None, ready=2)
    assert value("tandem_operator_autoscaler_metrics_available", **labels) == 0
    assert value("tandem_operator_autoscaler_signal", **labels, signal="latency_seconds") is None
    assert value("tandem_operator_autoscaler_limited", **labels, limit="TooManyReplicas") == 0


def test_a_deleted_cluster_leaves_no_series() -> None:
    metrics.record_pools("ops", "gone", ServingClusterStatus(decode=PoolStatus(desired=1, ready=1)))
    reconcile(None, body("gone"))
    metrics.forget_cluster("ops", "gone")
    left = [
        sample
        for family in metrics.REGISTRY.collect()
        for sample in family.samples
        if sample.labels.get("tandem_dev_cluster") == "gone"
    ]
    assert left == []


def test_metrics_are_served_over_http() -> None:
    port = free_port()
    server = metrics.serve(port, "127.0.0.1")
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    finally:
        server.shutdown()
    assert "# TYPE tandem_operator_reconciles_total counter" in text
    assert "# TYPE tandem_operator_autoscaler_signal gauge" in text


def test_the_port_flag() -> None:
    args = parse_args(["--metrics-port", "8081"])
    assert (args.metrics_port, args.metrics_host) == (8081, "0.0.0.0")
    assert parse_args([]).metrics_port is None
