"""benchmarks/router_trace_report.py: several rounds of one run summed up, and ratios paired
within a round (pure functions over the rows `router_trace.py` measures)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from router_trace_report import paired_ratios, round_figures, round_order

from tandem.bench.spec import SLO

SLOS = [SLO(ttft_ms=1000.0, itl_ms=50.0)]


def row(ttft_p50: float, ttft_p99: float, goodput: float, hit_rate: float) -> dict[str, Any]:
    return {
        "requests": 600,
        "ttft_p50": ttft_p50,
        "ttft_p90": None,  # a figure a round could not measure is left out of its spread
        "ttft_p99": ttft_p99,
        "tpot_p50": 15.0,
        "tpot_p99": 90.0,
        "goodput": {"1s/50ms": goodput},
        "hit_rate": hit_rate,
    }


def test_every_other_round_runs_the_routers_in_reverse() -> None:
    names = ["tandem-predictive", "tandem-predictive@before", "sglang"]
    assert round_order(names, 0) == names
    assert round_order(names, 1) == list(reversed(names))
    assert round_order(names, 2) == names


def test_figures_over_rounds_are_the_median_and_the_range() -> None:
    rounds = [
        {"sglang": row(240.0, 1200.0, 0.92, 0.16)},
        {"sglang": row(260.0, 1800.0, 0.88, 0.17)},
        {"sglang": row(250.0, 1300.0, 0.90, 0.15)},
    ]
    figures = round_figures(rounds, SLOS)["sglang"]
    assert figures["ttft_p50"] == (250.0, 240.0, 260.0)
    assert figures["ttft_p99"] == (1300.0, 1200.0, 1800.0)
    assert figures["goodput 1s/50ms"] == pytest.approx((0.90, 0.88, 0.92))
    assert figures["hit_rate"] == pytest.approx((0.16, 0.15, 0.17))
    assert "ttft_p90" not in figures


def test_ratios_are_paired_within_each_round() -> None:
    """A slow round slows every router in it: the ratios within a round stay put while each
    router's own figures move by half."""
    rounds = [
        {
            "tandem-predictive": row(200.0, 1000.0, 0.94, 0.13),
            "tandem-predictive@before": row(220.0, 1250.0, 0.90, 0.12),
            "sglang": row(240.0, 1200.0, 0.92, 0.16),
        },
        {
            "tandem-predictive": row(300.0, 1500.0, 0.85, 0.14),
            "tandem-predictive@before": row(330.0, 1900.0, 0.80, 0.12),
            "sglang": row(360.0, 1800.0, 0.83, 0.16),
        },
    ]
    paired = paired_ratios(rounds, SLOS)
    against_before = paired["tandem-predictive vs tandem-predictive@before"]
    assert against_before["ttft_p50"] == pytest.approx((200 / 220, 200 / 220, 200 / 220))
    assert against_before["ttft_p99"][1:] == pytest.approx((1500 / 1900, 1000 / 1250))
    assert against_before["hit_rate points"] == pytest.approx((1.5, 1.0, 2.0))
    against_peers = paired["tandem-predictive vs the best peer"]
    assert against_peers["ttft_p99"][1:] == pytest.approx((1000 / 1200, 1500 / 1800))
    assert against_peers["goodput 1s/50ms"][1:] == pytest.approx((0.94 / 0.92, 0.85 / 0.83))
    assert "tandem-predictive@before vs tandem-predictive@before@before" not in paired
    assert "tandem-predictive@before vs the best peer" in paired
