"""Output length, predicted online from what the router sees of a request, with calibrated quantiles.

A request's key, from coarse to fine (`length_keys`):

    level 0: every request
    level 1: (endpoint, ⌊log2 max_tokens⌋)
    level 2: level 1 + ⌊log2(prompt tokens + 1)⌋
    level 3: level 2 + its group: the session id, else the first block's key (a shared system
             prompt, a few-shot template), absent when it has neither

Each key keeps exponentially decayed moments of v = ln(1 + output tokens) (weight W, mean m,
variance s²). The prediction shrinks each level towards the one above it with a prior strength
of k samples, starting from the prior (m₀, s₀²) = (ln(1 + prior tokens), 1):

    m ← (W_l · m_l + k · m) / (W_l + k)        s² ← (W_l · s²_l + k · s²) / (W_l + k)

so a key seen a few times leans on its coarser key, one seen often on itself. Quantiles assume
v is normal given the key, and are calibrated online: z_q starts at the normal quantile and moves
by η · (1[actual > predicted q] - (1 - q)) after each request (adaptive conformal calibration),
so the share of answers above the predicted q tends to 1 - q whatever the true shape is:

    quantile_q = clamp(exp(m + z_q · s) - 1, 1, max_tokens)
    median     = quantile_0.5     (the point prediction; its error is reported against the
                                   running mean of the answers, the "predict the mean" baseline:
                                   a plain mean of the first 1,000, then an EWMA of weight 1/1000)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# ceiling on a prediction when the request sets no max_tokens (the model's context bounds it)
UNBOUNDED_TOKENS = 32768


@dataclass(slots=True)  # per request: a frozen one's __init__ takes ~5x as long
class LengthPrediction:
    median: float
    p90: float


class _Moments:
    """Decayed weighted moments: W ← d·W + 1, m ← m + (v - m)/W, S ← d·S + (v - m_old)(v - m)."""

    __slots__ = ("mean", "spread", "weight")

    def __init__(self) -> None:
        self.weight = 0.0
        self.mean = 0.0
        self.spread = 0.0

    def add(self, value: float, decay: float) -> None:
        self.weight = self.weight * decay + 1.0
        delta = value - self.mean
        self.mean += delta / self.weight
        self.spread = self.spread * decay + delta * (value - self.mean)

    @property
    def variance(self) -> float:
        return self.spread / self.weight if self.weight > 0 else 0.0


LengthKeys = tuple[tuple[object, ...], ...]


def _log2_bucket(value: int | None) -> int:
    return -1 if value is None or value <= 0 else value.bit_length() - 1


def length_keys(
    chat: bool, max_tokens: int | None, prompt_tokens: int, group: str | int | None
) -> LengthKeys:
    """The request's keys from level 1 to 3 (module docstring); level 0 is implicit."""
    level1 = (chat, _log2_bucket(max_tokens))
    level2 = (*level1, _log2_bucket(prompt_tokens + 1))
    if group is None:
        return (level1, level2)
    return (level1, level2, (*level2, group))


class OutputLengthModel:
    """The per-key moments and the calibrated z of the median and the p90 (module docstring)."""

    def __init__(
        self,
        prior_tokens: float = 256.0,
        prior_strength: float = 8.0,
        decay: float = 0.999,
        calibration_rate: float = 0.02,
        max_keys: int = 8192,
    ) -> None:
        self._prior_mean = math.log1p(prior_tokens)
        self._strength = prior_strength
        self._decay = decay
        self._rate = calibration_rate
        self._max_keys = max_keys
        self._global = _Moments()
        self._keys: dict[tuple[object, ...], _Moments] = {}
        self.z_median = 0.0
        self.z_p90 = 1.2816  # the standard normal's 0.9 quantile
        self.mean_tokens = prior_tokens  # the running mean of answers (the baseline)
        self._answers = 0

    def _shrunk(self, keys: LengthKeys) -> tuple[float, float]:
        k = self._strength
        top = self._global
        mean = (top.weight * top.mean + k * self._prior_mean) / (top.weight + k)
        variance = (top.weight * top.variance + k) / (top.weight + k)
        for key in keys:
            moments = self._keys.get(key)
            if moments is None:
                break  # a finer key is only ever stored with its coarser ones
            w = moments.weight
            mean = (w * moments.mean + k * mean) / (w + k)
            variance = (w * moments.variance + k * variance) / (w + k)
        return mean, math.sqrt(variance)

    def predict(self, keys: LengthKeys, max_tokens: int | None) -> LengthPrediction:
        mean, sd = self._shrunk(keys)
        ceiling = float(max_tokens) if max_tokens else float(UNBOUNDED_TOKENS)
        median = min(max(math.expm1(mean + self.z_median * sd), 1.0), ceiling)
        p90 = min(max(math.expm1(mean + self.z_p90 * sd), 1.0), ceiling)
        return LengthPrediction(median, max(p90, median))

    def observe(self, keys: LengthKeys, predicted: LengthPrediction, tokens: int) -> None:
        """Learns one answer of `tokens` output tokens and calibrates the quantiles' z."""
        value = math.log1p(max(tokens, 0))
        decay = self._decay
        self._global.add(value, decay)
        store = self._keys
        for key in keys:
            moments = store.get(key)
            if moments is None:
                if len(store) >= self._max_keys:
                    del store[next(iter(store))]  # the oldest key first
                moments = store[key] = _Moments()
            moments.add(value, decay)
        self.z_median += self._rate * ((tokens > predicted.median) - 0.5)
        self.z_p90 += self._rate * ((tokens > predicted.p90) - 0.1)
        self._answers += 1
        self.mean_tokens += (tokens - self.mean_tokens) / min(self._answers, 1000)
