"""SLO targets of a request, and the chance that a predicted latency meets one.

Targets: a trusted client's `x-slo-ttft-ms` / `x-slo-tpot-ms` headers (positive numbers; anything
else is ignored), else its priority class's (`PredictiveConfig.sloClasses`: the class with the
largest `minPriority` not above the request's priority, the first class for a priority below all).

The chance of meeting a target treats the predictor's error as log-normal:

    P(meet) = Φ((ln target - ln predicted) / sigma)

with sigma the root mean square of ln(observed / predicted) of the engine's recent requests
(`Predictor`); a prediction equal to its target meets it with probability 0.5.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.common.routing import SloClass

TTFT_HEADER = "x-slo-ttft-ms"
TPOT_HEADER = "x-slo-tpot-ms"


@dataclass(frozen=True, slots=True)
class SloTarget:
    ttft_s: float
    tpot_s: float
    sheddable: bool


def slo_class(classes: Sequence[SloClass], priority: int) -> SloClass:
    """The class with the largest min_priority ≤ priority; the lowest class below every one."""
    chosen = min(classes, key=lambda c: c.min_priority)
    for candidate in classes:
        if chosen.min_priority < candidate.min_priority <= priority:
            chosen = candidate
    return chosen


def _milliseconds(value: str | None) -> float | None:
    if not value:
        return None
    try:
        ms = float(value.strip())
    except ValueError:
        return None
    return ms if math.isfinite(ms) and ms > 0 else None


def slo_target(
    classes: Sequence[SloClass],
    priority: int,
    ttft_header: str | None = None,
    tpot_header: str | None = None,
) -> SloTarget:
    """The request's targets: the headers' (pass them only for a trusted client), else its class's."""
    cls = slo_class(classes, priority)
    ttft_ms = _milliseconds(ttft_header) or cls.ttft_ms
    tpot_ms = _milliseconds(tpot_header) or cls.tpot_ms
    return SloTarget(ttft_ms * 1e-3, tpot_ms * 1e-3, cls.sheddable)


def meet_probability(predicted_s: float, target_s: float, sigma: float) -> float:
    """Φ((ln target - ln predicted) / sigma) (module docstring)."""
    if predicted_s <= 0.0:
        return 1.0
    z = math.log(target_s / predicted_s) / sigma
    return 0.5 * (1.0 + math.erf(z * 0.7071067811865476))
