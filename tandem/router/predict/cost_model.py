"""Per-engine cost models, learned online from what the router times on every request.

Each model has the shape of the timing profile's formula (the seed s(x), `PredictiveConfig`'s
figures) and learns two numbers per engine, a fixed part a and a scale κ:

    y = a + κ · s(x),   (a, κ) from (0, 1)

    prefill:  s = steps · (s0 + d1 · D + d2 · X / 1000) + s1 · tokens / 1000 + s2 · pairs / 10⁶
                  [+ (s0 + d1 · D + d2 · X / 1000) / 2 when it starts mid-step, D > 0]
              (tokens: the uncached tokens ahead plus its own; pairs: their attention pairs,
              Σ u · (c + u / 2) over the requests of u uncached tokens after c cached ones, the
              quadratic part of a long prompt's prefill; steps = max(⌈tokens / max(C - D, 1)⌉, 1),
              the forward passes chunked prefill splits them into at a token budget of C per
              step less one token per decoding stream; each step carries the D streams decoding
              on the engine and their X context tokens (`DecodeLoad`), as vLLM's scheduler runs
              the running requests first. A request that comes to an engine with nothing of
              this router's prefilling there finds a decode step in flight when D > 0, half
              done on average: it waits for it before its first chunk is scheduled)
    handoff:  s = h0 + h1 · prompt tokens / 1000 + d1 · D + d2 · X / 1000
                  [+ (s0 + d1 · D + d2 · X / 1000) / 2 when D > 0]
              (the KV pull, then the decode engine's step that computes the prompt's last token
              beside its D streams: the pulled request waits for the step in flight)
    step:     s = d0 + d1 · streams + d2 · context tokens / 1000

(a, κ) are fitted by recursive least squares with forgetting (`OnlineLinear`) on the features
(1, s(x)). Two numbers are what the router's samples identify: under a steady load
the three coefficients of a free linear fit move together (work ahead and own work grow as one)
and a few unusual samples (a burst, a stalled engine) throw them far off; the profile's shape
holds across engines of one kind, and a, κ take in what differs (the engines' pace, HTTP and
scheduling overhead).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.common.routing import DEFAULT_STEP_TOKENS
from tandem.router.predict.prefill_queue import StepSeeds


@dataclass(slots=True)  # per request: a frozen one's __init__ takes ~5x as long
class DecodeLoad:
    """D streams decoding on an engine and their X context tokens: every step there carries them."""

    streams: float = 0.0
    context: float = 0.0


IDLE = DecodeLoad()


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
TYPICAL_SECONDS = 0.1  # the size of a seed's prediction s(x)


def prior_variance() -> list[float]:
    """P0_i = 1 / (PRIOR_SAMPLES · f_i²) for the features (1, s(x)) of typical size
    f = (1, TYPICAL_SECONDS): with P0 = δ I, recursive least squares minimises
    Σ (y - θ·x)² + Σ (θ_i - prior_i)² / δ_i, so the seed weighs as PRIOR_SAMPLES samples."""
    return [1.0 / PRIOR_SAMPLES, 1.0 / (PRIOR_SAMPLES * TYPICAL_SECONDS**2)]


class ScaledSeed:
    """y = a + κ · s(x) (module docstring)."""

    __slots__ = ("fit", "samples")

    def __init__(self, forget: float) -> None:
        self.fit = OnlineLinear((0.0, 1.0), prior_variance(), forget)
        self.samples = 0  # observations so far: 0 while the engine is known only by its seed

    @property
    def theta(self) -> list[float]:
        """(a, κ)."""
        return self.fit.theta

    @theta.setter
    def theta(self, value: list[float]) -> None:
        self.fit.theta = value

    def predict(self, seed_s: float) -> float:
        fixed, scale = self.fit.theta
        return fixed + scale * seed_s

    def observe(self, seed_s: float, seconds: float) -> None:
        self.fit.update((1.0, seed_s), seconds)
        self.samples += 1


class EngineCosts:
    """One engine's three models (module docstring), with the formulas that read them."""

    __slots__ = ("_handoff_seed", "_step_seed", "chunk_tokens", "handoff", "prefill", "seeds",
                 "step")  # fmt: skip

    def __init__(
        self,
        prefill: tuple[float, float, float],
        handoff: tuple[float, float],
        step: tuple[float, float, float],
        forget: float,
        chunk_tokens: int = DEFAULT_STEP_TOKENS,
    ) -> None:
        self._handoff_seed = handoff
        self._step_seed = step
        self.chunk_tokens = chunk_tokens
        s0, s1, s2 = prefill
        self.seeds = StepSeeds(s0, s1, s2, step[1], step[2], chunk_tokens)
        self.prefill = ScaledSeed(forget)
        self.handoff = ScaledSeed(forget)
        self.step = ScaledSeed(forget)

    def steps(self, tokens: float, streams: float = 0.0) -> float:
        """max(⌈tokens / max(C - D, 1)⌉, 1): the engine steps a prefill of `tokens` takes beside
        D decoding streams."""
        return max(math.ceil(tokens / self.seeds.budget(streams)), 1)

    def _prefill_seed_s(
        self, tokens: float, pairs: float, load: DecodeLoad, *, mid_step: bool
    ) -> float:
        seeds = self.seeds
        step = seeds.fixed(load.streams, load.context)
        seed = self.steps(tokens, load.streams) * step + seeds.work(tokens, pairs)
        if mid_step:
            seed += seeds.in_flight(load.streams, load.context)
        return seed

    def _handoff_seed_s(self, prompt_tokens: float, load: DecodeLoad) -> float:
        h0, h1 = self._handoff_seed
        seeds = self.seeds
        seed = h0 + h1 * prompt_tokens * 1e-3
        if load.streams > 0.0:  # the streams' part of its step, and half the step in flight
            step = seeds.fixed(load.streams, load.context)
            seed += step - seeds.s0 + seeds.in_flight(load.streams, load.context)
        return seed

    def _step_seed_s(self, streams: float, context_tokens: float) -> float:
        d0, d1, d2 = self._step_seed
        return d0 + d1 * streams + d2 * context_tokens * 1e-3

    def prefill_s(
        self,
        tokens: float,
        pairs: float,
        load: DecodeLoad = IDLE,
        *,
        mid_step: bool = False,
        pace: float | None = None,
    ) -> float:
        """a + κ · s: a prefill of `tokens` with `pairs` attention pairs (the work ahead
        included) beside the decode `load`, starting `mid_step` (module docstring); `pace` in
        place of κ."""
        fixed, scale = self.prefill.theta
        seed = self._prefill_seed_s(tokens, pairs, load, mid_step=mid_step)
        return fixed + (scale if pace is None else pace) * seed

    def prefill_compute_s(self, tokens: float, pairs: float) -> float:
        """κ · (s1 · tokens / 1000 + s2 · pairs / 10⁶): the engine time a prefill's tokens take,
        what a local prefill stalls the streams decoding beside it for."""
        return self.prefill.theta[1] * self.seeds.work(tokens, pairs)

    def handoff_s(self, prompt_tokens: float, load: DecodeLoad = IDLE) -> float:
        """a + κ · s: the KV pull and the first decode step beside the decode `load` (module
        docstring)."""
        return self.handoff.predict(self._handoff_seed_s(prompt_tokens, load))

    def step_s(self, streams: float, context_tokens: float) -> float:
        """a + κ · (d0 + d1 · streams + d2 · context tokens / 1000): one decode step."""
        return self.step.predict(self._step_seed_s(streams, context_tokens))

    def observe_prefill(
        self, tokens: float, pairs: float, load: DecodeLoad, seconds: float
    ) -> None:
        """A prefill that met nothing of this router's on the engine (so it started mid-step)."""
        self.prefill.observe(self._prefill_seed_s(tokens, pairs, load, mid_step=True), seconds)

    def observe_handoff(self, prompt_tokens: float, load: DecodeLoad, seconds: float) -> None:
        self.handoff.observe(self._handoff_seed_s(prompt_tokens, load), seconds)

    def observe_step(self, streams: float, context_tokens: float, seconds: float) -> None:
        self.step.observe(self._step_seed_s(streams, context_tokens), seconds)
