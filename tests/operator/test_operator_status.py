"""Status aggregation: pool states, phase, conditions and phase-change events (pure functions)."""

from __future__ import annotations

from typing import Any

from sc_manifests import cluster, minimal

from tandem.operator.api_status import Condition
from tandem.operator.manifest import parse_manifest
from tandem.operator.status import (
    DeploymentState,
    aggregate_status,
    merge_conditions,
    phase_event,
    pool_health,
    status_patch,
)

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def deployment(
    replicas: int,
    ready: int,
    updated: int | None = None,
    total: int | None = None,
    generation: int = 1,
    observed: int = 1,
    progressing: str | None = "NewReplicaSetAvailable",
    failure: str | None = None,
    available: bool | None = None,
) -> dict[str, Any]:
    conditions = []
    if available is not None:
        conditions.append({"type": "Available", "status": "True" if available else "False"})
    if progressing:
        status = "False" if progressing == "ProgressDeadlineExceeded" else "True"
        conditions.append(
            {
                "type": "Progressing",
                "status": status,
                "reason": progressing,
                "message": f"{progressing} msg",
            }
        )
    if failure:
        conditions.append(
            {
                "type": "ReplicaFailure",
                "status": "True",
                "reason": "FailedCreate",
                "message": failure,
            }
        )
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": observed,
            "replicas": replicas if total is None else total,
            "updatedReplicas": replicas if updated is None else updated,
            "readyReplicas": ready,
            "conditions": conditions,
        },
    }


def test_pool_states() -> None:
    assert pool_health("decode", None, 3).state == DeploymentState.MISSING
    assert pool_health("decode", None, 3).status.summary == "0/3"
    assert pool_health("decode", deployment(2, 2)).state == DeploymentState.READY
    assert pool_health("decode", deployment(2, 1)).state == DeploymentState.SCALING
    assert pool_health("decode", deployment(3, 2, available=True)).state == DeploymentState.SCALING
    assert pool_health("decode", deployment(2, 0, available=False)).state == DeploymentState.SHORT
    assert (
        pool_health("decode", deployment(2, 0, progressing="ReplicaSetUpdated")).state
        == DeploymentState.ROLLING
    )
    assert (
        pool_health("decode", deployment(2, 2, generation=2, observed=1)).state
        == DeploymentState.ROLLING
    )
    assert (
        pool_health("decode", deployment(2, 2, updated=1, total=3)).state == DeploymentState.ROLLING
    )
    assert (
        pool_health("decode", deployment(2, 1, progressing="ProgressDeadlineExceeded")).state
        == DeploymentState.FAILED
    )
    assert (
        pool_health("decode", deployment(2, 0, failure="exceeded quota")).state
        == DeploymentState.FAILED
    )
    assert pool_health("decode", deployment(0, 0)).state == DeploymentState.READY


def test_fresh_cluster_is_pending() -> None:
    sc = cluster()
    status = aggregate_status(sc, {}, T0, observed_generation=1)
    assert status.phase == "Pending"
    assert status.observed_generation == 1
    assert status.endpoint == "http://m-router.ns:8000"
    assert status.prefill is not None
    assert status.prefill.summary == "0/1"
    ready = {c.type: c for c in status.conditions}["Ready"]
    assert (ready.status, ready.reason) == ("False", "PodsStarting")


def test_all_ready() -> None:
    sc = cluster(prefill={"replicas": 2}, decode={"replicas": 3})
    status = aggregate_status(
        sc,
        {"prefill": deployment(2, 2), "decode": deployment(3, 3), "router": deployment(1, 1)},
        T0,
    )
    assert status.phase == "Ready"
    conditions = {c.type: c for c in status.conditions}
    assert (conditions["Ready"].status, conditions["Ready"].reason) == ("True", "AllPodsReady")
    assert "decode 3/3" in conditions["Ready"].message
    assert conditions["Degraded"].status == "False"
    assert conditions["Progressing"].reason == "RolloutComplete"
    assert conditions["ScalingLimited"].reason == "AutoscalingDisabled"
    assert status.decode is not None
    assert (status.decode.desired, status.decode.ready) == (3, 3)


def test_rolling_is_progressing() -> None:
    sc = cluster(decode={"replicas": 2})
    deployments = {
        "prefill": deployment(1, 1),
        "decode": deployment(2, 1, progressing="ReplicaSetUpdated"),
        "router": deployment(1, 1),
    }
    status = aggregate_status(sc, deployments, T0)
    assert status.phase == "Progressing"
    progressing = {c.type: c for c in status.conditions}["Progressing"]
    assert (progressing.status, progressing.reason) == ("True", "RollingOut")
    assert "decode 1/2" in progressing.message


def test_not_ready_before_the_latest_generation_is_applied() -> None:
    document = minimal()
    document["metadata"]["generation"] = 2
    document["status"] = {"observedGeneration": 1}
    ready = {"prefill": deployment(1, 1), "decode": deployment(1, 1), "router": deployment(1, 1)}
    status = aggregate_status(parse_manifest(document), ready, T0)
    conditions = {c.type: c for c in status.conditions}
    assert (status.phase, conditions["Ready"].reason, conditions["Progressing"].reason) == (
        "Progressing", "SpecNotApplied", "Applying",
    )  # fmt: skip
    status = aggregate_status(parse_manifest(document), ready, T0, observed_generation=2)
    assert status.phase == "Ready"


def test_scaling_up_is_progressing_not_degraded() -> None:
    sc = cluster(decode={"replicas": 3})
    deployments = {
        "prefill": deployment(1, 1),
        "decode": deployment(3, 2, available=True),
        "router": deployment(1, 1),
    }
    status = aggregate_status(sc, deployments, T0)
    progressing = {c.type: c for c in status.conditions}["Progressing"]
    assert status.phase == "Progressing"
    assert (progressing.reason, progressing.message) == (
        "PodsStarting",
        "pods starting: decode 2/3",
    )


def test_failures_are_degraded_with_reasons() -> None:
    sc = cluster()
    stuck = {
        "prefill": deployment(1, 0, progressing="ProgressDeadlineExceeded"),
        "decode": deployment(1, 1),
        "router": deployment(1, 1),
    }
    status = aggregate_status(sc, stuck, T0)
    degraded = {c.type: c for c in status.conditions}["Degraded"]
    assert status.phase == "Degraded"
    assert (degraded.status, degraded.reason) == ("True", "RolloutFailed")
    assert "prefill" in degraded.message
    crashed = {
        "prefill": deployment(1, 1),
        "decode": deployment(1, 0, available=False),
        "router": deployment(1, 1),
    }
    degraded = {c.type: c for c in aggregate_status(sc, crashed, T0).conditions}["Degraded"]
    assert degraded.reason == "PodsUnavailable"
    failed_apply = aggregate_status(sc, crashed, T0, apply_error="applying children failed: 403")
    degraded = {c.type: c for c in failed_apply.conditions}["Degraded"]
    assert (failed_apply.phase, degraded.reason, degraded.message) == (
        "Degraded", "ApplyFailed", "applying children failed: 403",
    )  # fmt: skip


def test_autoscaler_conditions_are_kept_while_enabled_and_dropped_when_off() -> None:
    limited = {
        "type": "ScalingLimited",
        "status": "True",
        "reason": "TooManyReplicas",
        "message": "decode wants 20, max 16",
    }
    metrics = {
        "type": "MetricsUnavailable",
        "status": "False",
        "reason": "MetricsRead",
        "message": "ok",
    }
    document = minimal(autoscaling={"enabled": True})
    document["status"] = {"conditions": [limited, metrics]}
    status = aggregate_status(parse_manifest(document), {}, T0)
    by_type = {c.type: c for c in status.conditions}
    assert [c.type for c in status.conditions][:3] == ["Ready", "Progressing", "Degraded"]
    assert (by_type["ScalingLimited"].reason, by_type["ScalingLimited"].message) == (
        "TooManyReplicas",
        "decode wants 20, max 16",
    )
    assert by_type["MetricsUnavailable"].reason == "MetricsRead"
    document["spec"]["autoscaling"]["enabled"] = False
    status = aggregate_status(parse_manifest(document), {}, T0)
    by_type = {c.type: c for c in status.conditions}
    assert by_type["ScalingLimited"].reason == "AutoscalingDisabled"
    assert "MetricsUnavailable" not in by_type


def test_transition_time_kept_while_status_unchanged() -> None:
    previous = [
        Condition(type="Ready", status="False", reason="PodsStarting", last_transition_time=T0)
    ]
    wanted = {
        "Ready": ("False", "PodsNotReady", "x"),
        "Progressing": ("True", "RollingOut", "y"),
        "Degraded": ("False", "AsExpected", "z"),
        "ScalingLimited": ("False", "AutoscalingDisabled", "w"),
    }
    merged = {c.type: c for c in merge_conditions(previous, wanted, 4, T1)}
    assert merged["Ready"].last_transition_time == T0
    assert merged["Ready"].reason == "PodsNotReady"
    assert merged["Progressing"].last_transition_time == T1
    assert merged["Ready"].observed_generation == 4
    wanted["Ready"] = ("True", "AllPodsReady", "ok")
    merged = {c.type: c for c in merge_conditions(list(merged.values()), wanted, 4, T1)}
    assert merged["Ready"].last_transition_time == T1


def test_colocated_has_no_prefill_status() -> None:
    sc = cluster(router={"disaggregation": {"mode": "never"}}, prefill={"replicas": 0})
    status = aggregate_status(sc, {"decode": deployment(1, 1), "router": deployment(1, 1)}, T0)
    assert status.phase == "Ready"
    assert status.prefill is None
    patch = status_patch(status)
    assert patch["prefill"] is None  # removes a stale prefill entry
    assert "autoscaling" not in patch  # the autoscaler owns that section


def test_phase_events() -> None:
    sc = cluster()
    ready = aggregate_status(
        sc,
        {"prefill": deployment(1, 1), "decode": deployment(1, 1), "router": deployment(1, 1)},
        T0,
    )
    assert phase_event("Ready", "Ready", ready.conditions) is None
    assert phase_event("Progressing", "Ready", ready.conditions) == (
        "Normal",
        "Ready",
        ready.conditions[0].message,
    )
    broken = aggregate_status(sc, {}, T0, apply_error="boom")
    event = phase_event("Ready", "Degraded", broken.conditions)
    assert event == ("Warning", "Degraded", "boom")
