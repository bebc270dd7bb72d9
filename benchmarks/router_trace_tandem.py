"""What Tandem's router tells of a `router_trace.py` run: the figures on its /metrics, and the
predictive policy's per-request explain lines (each term's error, the cache hits passed over)."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tandem.router.predict.placement import CLOSE_ENOUGH

_INDEX_BLOCKS = ("tandem_router_prefix_query_blocks_total", "tandem_router_prefix_hit_blocks_total")


def tandem_figures(text: str) -> dict[str, Any]:
    """What Tandem's router says of the run in its /metrics `text`: its P/D decisions, the share
    of prompt blocks its index held on the engine it chose (at placement: what the router
    expected to hit), and under the predictive policy the mean |observed - predicted| / observed
    of each predicted quantity (`tandem_router_prediction_error_ratio`'s _sum / _count: the
    MAPE)."""
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for family in text_string_to_metric_families(text):
        for sample in family.samples:  # summed over the other labels (router processes)
            if sample.name.startswith("tandem_router_prediction_error_ratio_"):
                totals[sample.name][sample.labels["quantity"]] += sample.value
            elif sample.name == "tandem_router_decisions_total":
                totals[sample.name][sample.labels["decision"]] += sample.value
            elif sample.name in _INDEX_BLOCKS:
                totals[sample.name][sample.labels["index"]] += sample.value
    sums = totals["tandem_router_prediction_error_ratio_sum"]
    counts = totals["tandem_router_prediction_error_ratio_count"]
    decisions = dict(totals["tandem_router_decisions_total"])
    mape = {q: sums[q] / counts[q] for q in sums if counts[q]}
    queried = sum(totals["tandem_router_prefix_query_blocks_total"].values())
    hit = sum(totals["tandem_router_prefix_hit_blocks_total"].values())
    figures: dict[str, Any] = {"decisions": decisions, "prediction_mape": mape}
    if queried:
        figures["router_hit_rate"] = hit / queried
    return figures


def explained(log: str) -> list[dict[str, Any]]:
    """The predictive router's per-request `prediction {...}` debug lines (`Ticket.explain`)."""
    marker = " prediction {"
    return [
        json.loads(line[line.index(marker) + len(marker) - 1 :])
        for line in log.splitlines()
        if marker in line
    ]


def term_errors(lines: list[dict[str, Any]]) -> dict[str, float]:
    """Mean |observed - predicted| / observed of each term of the predicted TTFT over the
    requests that have both: `ttft local`, `ttft pd` (upstream TTFT by route), `prefill` (the P/D
    prefill), `handoff` (the wait on the decode engine plus the handoff, against the time from
    the prefill's answer to the first byte) and `tpot`."""
    pairs: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for line in lines:
        pairs[f"ttft {line['route']}"].append((line["ttft_ms"], line["ttft_obs_ms"]))
        pairs["tpot"].append((line["tpot_ms"], line["tpot_obs_ms"]))
        if line["route"] == "pd":
            pairs["prefill"].append((line["prefill_ms"], line["prefill_obs_ms"]))
            handoff = line["handoff_ms"] + line["wait_ms"]
            pairs["handoff"].append((handoff, line["handoff_obs_ms"]))
    out = {}
    for term, found in pairs.items():
        errors = [abs(o - p) / o for p, o in found if p is not None and o]
        if errors:
            out[term] = sum(errors) / len(errors)
    return out


def passed_over(lines: list[dict[str, Any]]) -> dict[str, float]:
    """The cache hits the local picks passed over: for a request placed locally on an engine
    where another candidate had more of its prompt cached, own(chosen) - min own over the
    candidates, filed under `meet` when the probability the pick ranked by (P(TTFT ≤ T_ttft),
    or P(meet) in the lines of a Tandem that logged no `ttft_meet`) was below its bar
    (`placement.meet_bar`; the best - CLOSE_ENOUGH in the lines of a Tandem that logged no bar,
    whose pick ranked by that band), else under `cost` (weighed, and dearer);
    each as a fraction of all the requests' prompt tokens, with `placements` the number of such
    picks."""
    prompt = sum(line["prompt"] for line in lines) or 1
    tokens = {"meet": 0.0, "cost": 0.0}
    placements = 0
    for line in lines:
        candidates = line["candidates"]
        if line["route"] != "local" or not candidates:
            continue
        chosen = next(c for c in candidates if c["engine"] == line["decode"])
        cached = min(candidates, key=lambda c: c["own"])
        if cached["own"] >= chosen["own"]:
            continue
        placements += 1
        ranked = "ttft_meet" if "ttft_meet" in cached else "meet"
        bar = line.get("meet_bar", max(c[ranked] for c in candidates) - CLOSE_ENOUGH)
        tokens["meet" if cached[ranked] < bar else "cost"] += chosen["own"] - cached["own"]
    return {"placements": placements, **{k: v / prompt for k, v in tokens.items()}}


# -- main ----------------------------------------------------------------------------------------
