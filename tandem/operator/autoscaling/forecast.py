"""Short-term load forecast: Holt's double exponential smoothing, with the spread of its errors."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict


class Holt(BaseModel):
    """Level and trend (per second) of one load series, updated once per evaluation.

    With a sample y taken dt seconds after the previous one:
      level' = alpha * y + (1 - alpha) * (level + trend * dt)
      trend' = beta * (level' - level) / dt + (1 - beta) * trend
    and the forecast h seconds ahead is level' + trend' * h. The first sample sets the level with
    no trend. The one-step error e = y - (level + trend * dt) is smoothed as a variance,
      variance' = alpha * e^2 + (1 - alpha) * variance,
    so `upper(h, k)` = forecast(h) + k * sqrt(variance) bounds the load a pool must absorb with a
    chosen confidence (k = 1.28: about 90 % for normal errors).

    Why Holt and not a moving average: a pod ordered now serves only after it starts, so the
    planner must size for the load one start-up time ahead. Over minutes a day-shaped load is
    locally a ramp; Holt's trend term extrapolates the ramp, where an EWMA (or a max of a short
    and a long one) lags it by its time constant.
    """

    model_config = ConfigDict(frozen=True)

    level: float | None = None
    trend: float = 0.0
    variance: float = 0.0
    at: float = 0.0

    def update(self, sample: float, now: float, alpha: float, beta: float) -> Holt:
        if self.level is None:
            return Holt(level=sample, trend=0.0, at=now)
        dt = now - self.at
        if dt <= 0:
            return self
        predicted = self.level + self.trend * dt
        level = alpha * sample + (1 - alpha) * predicted
        trend = beta * (level - self.level) / dt + (1 - beta) * self.trend
        variance = alpha * (sample - predicted) ** 2 + (1 - alpha) * self.variance
        return Holt(level=level, trend=trend, variance=variance, at=now)

    def forecast(self, horizon_s: float) -> float:
        """level + trend * horizon, never below 0; 0 before the first sample."""
        if self.level is None:
            return 0.0
        return max(0.0, self.level + self.trend * horizon_s)

    def upper(self, horizon_s: float, sigmas: float) -> float:
        """forecast(horizon) + sigmas * the standard deviation of the one-step errors."""
        return self.forecast(horizon_s) + sigmas * math.sqrt(self.variance)
