"""Drain-safe removal as rendered: the preStop sleep, vLLM's --shutdown-timeout, the budgets."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from sc_manifests import cluster

from tandem.operator.drain import TEARDOWN_MARGIN_S, shutdown_timeout
from tandem.operator.engine_render import vllm_args
from tandem.operator.render import render


def _deployment(objects: list[dict[str, Any]], role: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == role]
    return found


@pytest.mark.parametrize(
    ("grace", "pre_stop", "expected"),
    [
        (120, 5, 115 - TEARDOWN_MARGIN_S),  # the default: 105 s of drain
        (30, 2, 28 - 9),  # a third of a short budget goes to the teardown
        (7, 5, 2),  # 2 s left: 2 // 3 = 0 s of margin
        (5, 5, 0),  # nothing left after the preStop: vLLM aborts
        (3, 5, 0),  # the preStop is cut to the grace period
        (0, 5, 0),
    ],
)
def test_shutdown_timeout_is_the_grace_left_after_the_pre_stop_less_a_teardown_margin(
    grace: int, pre_stop: int, expected: int
) -> None:
    sc = cluster(
        decode={"terminationGracePeriodSeconds": grace, "drain": {"preStopSeconds": pre_stop}}
    )
    assert shutdown_timeout(sc.spec.decode) == expected
    args = vllm_args(sc, "decode")
    assert args[args.index("--shutdown-timeout") + 1] == str(expected)


def test_engine_pods_get_a_pre_stop_sleep_and_each_pool_a_budget() -> None:
    sc = cluster(prefill={"replicas": 2}, decode={"drain": {"preStopSeconds": 0}})
    objects = render(sc)
    name = sc.metadata.name
    prefill = _deployment(objects, f"{name}-prefill")["spec"]["template"]["spec"]
    assert prefill["terminationGracePeriodSeconds"] == 120
    assert prefill["containers"][0]["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    decode = _deployment(objects, f"{name}-decode")["spec"]["template"]["spec"]
    assert "lifecycle" not in decode["containers"][0]  # 0: SIGTERM at once
    budgets = {
        o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "PodDisruptionBudget"
    }
    for role in ("prefill", "decode"):
        assert budgets[f"{name}-{role}"]["maxUnavailable"] == 1
    for obj in objects:
        if obj["kind"] == "Deployment":
            kubernetes_validate.validate(obj, "1.34.0", strict=True)


def test_a_user_shutdown_timeout_in_extra_args_wins() -> None:
    """vLLM's argument parser keeps the last value; extraArgs come after the rendered flags."""
    sc = cluster(decode={"extraArgs": ["--shutdown-timeout", "7"]})
    args = vllm_args(sc, "decode")
    assert args[len(args) - 1 - args[::-1].index("--shutdown-timeout") + 1] == "7"
