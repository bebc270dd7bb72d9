"""The pure decision replayed on the evaluations recorded in closed-loop runs on the real control plane.

Each fixtures/closed-loop-run*.json holds `spec.autoscaling` of one run and every evaluation's
status (inputs: current and ready replicas, observed signals; outputs: replicas and decision), as
e2e/test_autoscaling.py writes them with TANDEM_AUTOSCALING_REPORT. Replaying the inputs through
`decide` must give the recorded outputs, evaluation by evaluation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from run_replay import replay

from tandem.operator.autoscaling.policy import pool_policies

RUNS = sorted((Path(__file__).parent / "fixtures").glob("closed-loop-run*.json"))


@pytest.fixture(params=RUNS, ids=[path.stem for path in RUNS])
def run(request: pytest.FixtureRequest) -> dict[str, Any]:
    recorded: dict[str, Any] = json.loads(request.param.read_text())
    return recorded


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_replayed_decisions_equal_the_recorded_ones(run: dict[str, Any], pool: str) -> None:
    pairs = list(replay(pool_policies(run["autoscaling"])[pool], run["rows"]))
    assert len(pairs) >= 20
    for recorded, replayed in pairs:
        assert (replayed.reason, replayed.desired) == (
            recorded["decision"],
            recorded["replicas"],
        ), recorded
        assert replayed.recommendation == recorded["recommendation"]


def test_the_run_went_up_on_load_and_back_to_min_when_idle(run: dict[str, Any]) -> None:
    rows = run["rows"]
    prefill = [row["prefill"]["replicas"] for row in rows]
    assert prefill[0] == 1
    assert max(prefill) == pool_policies(run["autoscaling"])["prefill"].max_replicas
    assert prefill[-1] == rows[-1]["decode"]["replicas"] == 1
    loaded = [row for row in rows if row["phase"] == "load"]
    assert any(row["prefill"]["decision"] == "ScaledUp" for row in loaded)
