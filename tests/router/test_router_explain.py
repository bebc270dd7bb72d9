"""The predictive router's explain line (`Ticket.explain`) and what the trace benchmark reads off
it (`benchmarks/router_trace.py`: `passed_over`, the cache hits the local picks gave up)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tandem.common.routing import PredictiveConfig
from tandem.router.engines import Engine
from tandem.router.metrics import RouterMetrics
from tandem.router.predict.candidate import PlacementInputs
from tandem.router.predict.output_length import length_keys
from tandem.router.predict.placement import place
from tandem.router.predict.predictor import MIN_TPOT_TOKENS, Predictor
from tandem.router.predict.slo import SloTarget

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from router_trace_tandem import passed_over


def engine(name: str) -> Engine:
    return Engine(f"http://{name}", "both")


def explain_line(predictor: Predictor, engines: list[Engine], hits: dict[str, int]) -> dict:
    keys = length_keys(False, 100, 2000, None)
    output = predictor.lengths.predict(keys, 100)
    target = SloTarget(2.0, 0.1, False)
    inputs = PlacementInputs(2000, 16, hits, output, target, 0.5, 0.3, 1000.0, 1e6, 1000.0, 100.0)
    placement = place(engines, [], predictor.ledger, inputs, "auto")
    ticket = predictor.ticket(placement, keys, True)
    ticket.first_byte(placement.decode.engine, now=100.2, upstream_start=100.0, prefill_done=None)
    ticket.finished(output_tokens=20, last_event=100.6)
    return json.loads(json.dumps(ticket.explain(20, 100.6)))  # as the debug log carries it


def test_the_explain_line_lists_every_candidate_as_weighed() -> None:
    predictor = Predictor(PredictiveConfig(), RouterMetrics())
    a, b = engine("a"), engine("b")
    line = explain_line(predictor, [a, b], {a.id: 100})  # 1,600 of 2,000 tokens cached on a
    assert line["decode"] == a.id
    by_engine = {c["engine"]: c for c in line["candidates"]}
    assert by_engine.keys() == {a.id, b.id}
    assert (by_engine[a.id]["own"], by_engine[b.id]["own"]) == (400, 2000)
    assert by_engine[a.id]["cost_ms"] < by_engine[b.id]["cost_ms"]
    assert by_engine[a.id]["ttft_ms"] == line["ttft_ms"]
    assert line["meet_bar"] == 0.5  # both are likely to meet: the cost decides
    assert passed_over([line]) == {"placements": 0, "meet": 0.0, "cost": 0.0}
    assert line["load"] == [0, 0]  # nothing decoded on a as it was placed
    # alone on an idle engine, its 200 ms taught a's prefill model
    model = line["prefill_model"]
    assert model["fixed_ms"] > 0.0
    assert model["scale"] > 1.0
    assert model["pace"] == model["scale"]  # no pace sample yet: its prior, the model's κ
    assert line["prefill_pace"] == 1.0  # predicted on a's seed: the model learned at its answer


def test_passed_over_files_each_lost_hit_under_its_reason() -> None:
    def candidate(name: str, own: float, meet: float) -> dict:
        return {"engine": name, "own": own, "meet": meet}

    lines = [
        # b held 1,500 more cached tokens but its P(meet) was below the bar
        {"route": "local", "decode": "a", "prompt": 2000, "meet_bar": 0.85,
         "candidates": [candidate("a", 2000, 0.9), candidate("b", 500, 0.8)]},
        # b was weighed (likely to meet) and dearer
        {"route": "local", "decode": "a", "prompt": 1000, "meet_bar": 0.5,
         "candidates": [candidate("a", 1000, 0.9), candidate("b", 600, 0.8)]},
        # the most cached engine was chosen; a P/D request's decode engine prefills nothing
        {"route": "local", "decode": "b", "prompt": 600, "meet_bar": 0.5,
         "candidates": [candidate("a", 600, 1.0), candidate("b", 0, 1.0)]},
        {"route": "pd", "decode": "a", "prompt": 400, "meet_bar": 0.5,
         "candidates": [candidate("a", 400, 1.0), candidate("b", 0, 1.0)]},
    ]  # fmt: skip
    over = passed_over(lines)
    assert over["placements"] == 2
    assert over["meet"] == pytest.approx(1500 / 4000)
    assert over["cost"] == pytest.approx(400 / 4000)
    # a line of a Tandem that logged no bar: its pick ranked by the band 0.05 below the best
    for line in lines:
        del line["meet_bar"]
    over = passed_over(lines)
    assert over["meet"] == pytest.approx(1900 / 4000)
    assert over["cost"] == 0.0


def test_the_explain_line_gives_the_tpot_the_router_scores() -> None:
    """(last event - first byte) / (events - 1), as the router's TPOT error counts it: none for an
    answer of fewer than MIN_TPOT_TOKENS events, whose gaps are jitter (or ~0 in one read)."""
    predictor = Predictor(PredictiveConfig(), RouterMetrics())
    a = engine("a")
    line = explain_line(predictor, [a], {})
    assert line["tpot_obs_ms"] == pytest.approx(400 / 19, abs=1e-3)  # 20 events over 0.4 s
    keys = length_keys(False, 100, 2000, None)
    output = predictor.lengths.predict(keys, 100)
    target = SloTarget(2.0, 0.1, False)
    inputs = PlacementInputs(2000, 16, {}, output, target, 0.5, 0.3, 1000.0, 1e6, 1000.0, 100.0)
    placement = place([a], [], predictor.ledger, inputs, "auto")
    ticket = predictor.ticket(placement, keys, True)
    ticket.first_byte(a, now=100.2, upstream_start=100.0, prefill_done=None)
    ticket.finished(output_tokens=MIN_TPOT_TOKENS - 1, last_event=100.20005)
    assert ticket.explain(MIN_TPOT_TOKENS - 1, 100.20005)["tpot_obs_ms"] is None
    assert ticket.explain(MIN_TPOT_TOKENS, 100.2)["tpot_obs_ms"] is None  # all in one read
    assert ticket.explain(MIN_TPOT_TOKENS, 100.23)["tpot_obs_ms"] == pytest.approx(10.0)
