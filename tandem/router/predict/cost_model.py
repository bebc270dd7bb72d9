"""Per-engine cost models, learned online from what the router times on every request.

Each is a linear model y = θ·x fitted by recursive least squares with forgetting (`OnlineLinear`),
seeded by a prior (the timing profile's figures, `PredictionConfig`):

    prefill seconds  = θ0 · steps + θ1 · tokens / 1000 + θ2 · pairs / 10⁶
                       (tokens: the uncached tokens ahead plus its own; pairs: their attention
                       pairs, Σ u · (c + u / 2) over the requests of u uncached tokens after c
                       cached ones: the quadratic part of a long prompt's prefill; steps =
                       max(⌈tokens / C⌉, 1), the forward passes chunked prefill splits them
                       into at a token budget of C per step, each with its fixed cost and the
                       decode of the streams running beside it)
    handoff seconds  = θ0 + θ1 · prompt tokens / 1000       (KV pull + the decode engine's first step)
    decode step      = θ0 + θ1 · streams + θ2 · context tokens / 1000

Features are in thousands of tokens so that the coefficients, and the prior variances, are of
one order; every coefficient is kept non-negative (a cost never falls with more work).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


class OnlineLinear:
    """y ≈ θ·x, fitted by recursive least squares with forgetting factor λ:

        e = y - θ·x
        k = P x / (λ + xᵀ P x)
        θ ← max(θ + k e, 0)                    (each coefficient)
        P ← (P - k xᵀ P) / λ, scaled down to trace(P0) when it grows past it

    P0 = diag(prior_variance). λ < 1 forgets old samples (weight λ^age, an effective window of
    1 / (1 - λ) samples) so the fit follows an engine whose speed changes; the trace bound stops
    P from growing without limit while samples carry no new information (a steady load).
    Example: prior θ = (0.01, 0.02), one sample x = (1, 2), y = 0.1 moves θ towards a fit of
    0.1 s for 2,000 tokens in proportion to P0.
    """

    __slots__ = ("_p", "_trace0", "forget", "theta")

    def __init__(
        self, prior: Sequence[float], prior_variance: Sequence[float], forget: float = 0.98
    ) -> None:
        n = len(prior)
        self.theta = [float(v) for v in prior]
        self._p = [
            [float(prior_variance[i]) if i == j else 0.0 for j in range(n)] for i in range(n)
        ]
        self._trace0 = float(sum(prior_variance))
        self.forget = forget

    def predict(self, x: Sequence[float]) -> float:
        return sum(t * v for t, v in zip(self.theta, x, strict=True))

    def update(self, x: Sequence[float], y: float) -> None:
        p = self._p
        n = len(x)
        px = [sum(p[i][j] * x[j] for j in range(n)) for i in range(n)]
        denominator = self.forget + sum(x[i] * px[i] for i in range(n))
        if denominator <= 0.0:
            return
        gain = [v / denominator for v in px]
        error = y - self.predict(x)
        self.theta = [max(t + g * error, 0.0) for t, g in zip(self.theta, gain, strict=True)]
        # P x = xᵀ P for a symmetric P, so P - k (P x)ᵀ keeps it symmetric
        scale = 1.0 / self.forget
        trace = 0.0
        for i in range(n):
            row = p[i]
            for j in range(n):
                row[j] = (row[j] - gain[i] * px[j]) * scale
            trace += row[i]
        if trace > self._trace0:
            shrink = self._trace0 / trace
            for row in p:
                for j in range(n):
                    row[j] *= shrink


PRIOR_SAMPLES = 2.0  # the seed counts as this many requests against what is observed
# the typical size of each feature: prefill (1, ~1k tokens, ~10⁶ pairs), handoff (1, ~1k tokens),
# a step (1, ~16 streams, ~16k context tokens)
_PREFILL_SCALE = (1.0, 1.0, 1.0)
_HANDOFF_SCALE = (1.0, 1.0)
_STEP_SCALE = (1.0, 16.0, 16.0)


def prior_variance(scales: Sequence[float]) -> list[float]:
    """P0_i = 1 / (PRIOR_SAMPLES · s_i²): with P0 = δ I, recursive least squares minimises
    Σ (y - θ·x)² + Σ (θ_i - prior_i)² / δ_i, so the seed weighs as much as PRIOR_SAMPLES
    samples whose feature i is of size s_i, whatever the unit of y."""
    return [1.0 / (PRIOR_SAMPLES * s * s) for s in scales]


class EngineCosts:
    """One engine's three models (module docstring), with the formulas that read them."""

    __slots__ = ("chunk_tokens", "handoff", "prefill", "step")

    def __init__(
        self,
        prefill: tuple[float, float, float],
        handoff: tuple[float, float],
        step: tuple[float, float, float],
        forget: float,
        chunk_tokens: int = 8192,
    ) -> None:
        self.chunk_tokens = chunk_tokens
        self.prefill = OnlineLinear(prefill, prior_variance(_PREFILL_SCALE), forget)
        self.handoff = OnlineLinear(handoff, prior_variance(_HANDOFF_SCALE), forget)
        self.step = OnlineLinear(step, prior_variance(_STEP_SCALE), forget)

    def steps(self, tokens: float) -> float:
        """max(⌈tokens / C⌉, 1): the engine steps a prefill of `tokens` takes."""
        return max(math.ceil(tokens / self.chunk_tokens), 1)

    def prefill_s(self, tokens: float, pairs: float) -> float:
        """θ0 · steps + θ1 · tokens / 1000 + θ2 · pairs / 10⁶: a prefill of `tokens` with
        `pairs` attention pairs (the work ahead included)."""
        theta = self.prefill.theta
        return theta[0] * self.steps(tokens) + theta[1] * tokens * 1e-3 + theta[2] * pairs * 1e-6

    def prefill_compute_s(self, tokens: float, pairs: float) -> float:
        """θ1 · tokens / 1000 + θ2 · pairs / 10⁶: the engine time a prefill's tokens take, what a
        local prefill stalls the streams decoding beside it for."""
        theta = self.prefill.theta
        return theta[1] * tokens * 1e-3 + theta[2] * pairs * 1e-6

    def handoff_s(self, prompt_tokens: float) -> float:
        """θ0 + θ1 · prompt tokens / 1000: the KV pull and the first decode step."""
        theta = self.handoff.theta
        return theta[0] + theta[1] * prompt_tokens * 1e-3

    def step_s(self, streams: float, context_tokens: float) -> float:
        """θ0 + θ1 · streams + θ2 · context tokens / 1000: one decode step of the batch."""
        theta = self.step.theta
        return theta[0] + theta[1] * streams + theta[2] * context_tokens * 1e-3

    def observe_prefill(self, tokens: float, pairs: float, seconds: float) -> None:
        self.prefill.update((self.steps(tokens), tokens * 1e-3, pairs * 1e-6), seconds)

    def observe_handoff(self, prompt_tokens: float, seconds: float) -> None:
        self.handoff.update((1.0, prompt_tokens * 1e-3), seconds)

    def observe_step(self, streams: float, context_tokens: float, seconds: float) -> None:
        self.step.update((1.0, streams, context_tokens * 1e-3), seconds)
