"""Workload specifications: length distributions, arrival shapes and SLOs as pydantic models."""

from __future__ import annotations

import re
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tandem.bench.traces import TRACE_BLOCK_TOKENS, TraceFormat


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LengthDist(_Spec):
    """A distribution of token counts, clipped to [low, high].

    fixed: always `mean`; uniform: integers in [low, high]; lognormal: median `mean`, shape `sigma`
    (exp(N(ln mean, sigma))); normal: N(mean, sigma * mean).
    """

    kind: Literal["fixed", "uniform", "lognormal", "normal"] = "fixed"
    mean: float = Field(128, gt=0)
    sigma: float = Field(0.5, ge=0)
    low: int = Field(1, ge=1)
    high: int = Field(1_000_000, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> LengthDist:
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) must not exceed high ({self.high})")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.kind == "fixed":
            values = np.full(n, self.mean)
        elif self.kind == "uniform":
            values = rng.integers(self.low, self.high + 1, size=n)
        elif self.kind == "lognormal":
            values = rng.lognormal(np.log(self.mean), self.sigma, size=n)
        else:
            values = rng.normal(self.mean, self.sigma * self.mean, size=n)
        clipped = np.clip(np.rint(values), self.low, self.high)
        return [int(v) for v in clipped]

    def expected(self) -> float:
        """The distribution's mean before clipping (for sizing and labels)."""
        if self.kind == "uniform":
            return (self.low + self.high) / 2
        if self.kind == "lognormal":
            return float(self.mean * np.exp(self.sigma**2 / 2))
        return self.mean

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"{int(self.mean)}"
        if self.kind == "uniform":
            return f"uniform {self.low}-{self.high}"
        return f"{self.kind} {self.mean:g} (sigma {self.sigma:g}, {self.low}-{self.high})"

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """Parse `N`, `fixed:N`, `uniform:A-B`, `lognormal:MEDIAN[,SIGMA][,A-B]`, `normal:MEAN[,REL_STD][,A-B]`."""
        text = text.strip()
        if text.isdigit():
            return cls(kind="fixed", mean=int(text))
        kind, _, rest = text.partition(":")
        parts = [p.strip() for p in rest.split(",") if p.strip()]
        if kind == "fixed" and len(parts) == 1 and parts[0].isdigit():
            return cls(kind="fixed", mean=int(parts[0]))
        bounds = [p for p in parts if re.fullmatch(r"\d+-\d+", p)]
        numbers = [p for p in parts if p not in bounds]
        low, high = (int(x) for x in bounds[0].split("-")) if bounds else (1, 1_000_000)
        if kind == "uniform" and bounds and not numbers:
            return cls(kind="uniform", low=low, high=high, mean=(low + high) / 2)
        if kind in {"lognormal", "normal"} and 1 <= len(numbers) <= 2:
            sigma = float(numbers[1]) if len(numbers) == 2 else 0.5
            return cls(kind=kind, mean=float(numbers[0]), sigma=sigma, low=low, high=high)
        raise ValueError(
            f"cannot parse length distribution {text!r}; use N, fixed:N, uniform:A-B, "
            "lognormal:MEDIAN[,SIGMA][,A-B] or normal:MEAN[,REL_STD][,A-B]"
        )


class Phase(_Spec):
    """A stretch of Poisson arrivals at one rate."""

    qps: float = Field(gt=0)
    duration_s: float = Field(gt=0)
    name: str = ""


class _Workload(_Spec):
    seed: int = 0
    warmup_requests: int = Field(8, ge=0)
    # Caps requests in flight (a closed loop behind the open one); None sends every arrival at once.
    max_concurrency: int | None = Field(None, ge=1)
    output: LengthDist = Field(default_factory=lambda: LengthDist(kind="fixed", mean=128))
    # Hard bound on how long the measured phase may take (arrivals plus draining).
    max_duration_s: float = Field(600, gt=0)
    # Speculative decoding: each request class's task as a draft acceptance rate ("*": every
    # class), sent as vllm_xargs.spec_acceptance_rate, from which the emulator draws accepted
    # drafts (a real vLLM keeps it in the sampling params' extra args and ignores it).
    task_acceptance: dict[str, float] = Field(default_factory=dict)

    @field_validator("task_acceptance")
    @classmethod
    def _rates(cls, value: dict[str, float]) -> dict[str, float]:
        if any(not 0 <= rate <= 1 for rate in value.values()):
            raise ValueError("acceptance rates are between 0 and 1")
        return value


class FixedQPS(_Workload):
    """Poisson arrivals at a fixed rate: are the median and the P99 stable?"""

    kind: Literal["fixed-qps"] = "fixed-qps"
    qps: float = Field(4.0, gt=0)
    num_requests: int = Field(200, ge=1)
    input: LengthDist = Field(
        default_factory=lambda: LengthDist(kind="lognormal", mean=512, sigma=0.6, low=16, high=4096)
    )


class Burst(_Workload):
    """Low, then high, then low Poisson rates: how far does latency degrade, how long to recover?"""

    kind: Literal["burst"] = "burst"
    phases: list[Phase] = Field(
        default_factory=lambda: [
            Phase(qps=2, duration_s=10, name="low"),
            Phase(qps=16, duration_s=10, name="high"),
            Phase(qps=2, duration_s=15, name="recovery"),
        ],
        min_length=1,
    )
    input: LengthDist = Field(
        default_factory=lambda: LengthDist(kind="lognormal", mean=512, sigma=0.6, low=16, high=4096)
    )


class Mixed(_Workload):
    """Short chats and long documents at once: how much do they hurt each other?"""

    kind: Literal["mixed"] = "mixed"
    qps: float = Field(4.0, gt=0)
    num_requests: int = Field(200, ge=1)
    long_fraction: float = Field(0.2, ge=0, le=1)
    short_input: LengthDist = Field(
        default_factory=lambda: LengthDist(kind="lognormal", mean=128, sigma=0.5, low=8, high=1024)
    )
    long_input: LengthDist = Field(
        default_factory=lambda: LengthDist(
            kind="lognormal", mean=4096, sigma=0.3, low=1024, high=16384
        )
    )
    long_output: LengthDist = Field(default_factory=lambda: LengthDist(kind="fixed", mean=64))


class SharedPrefix(_Workload):
    """Requests in groups sharing a system prompt: `share_ratio` of each prompt is the group's prefix."""

    kind: Literal["shared-prefix"] = "shared-prefix"
    qps: float = Field(4.0, gt=0)
    num_requests: int = Field(200, ge=1)
    groups: int = Field(8, ge=1)
    share_ratio: float = Field(0.75, ge=0, lt=1)
    input: LengthDist = Field(default_factory=lambda: LengthDist(kind="fixed", mean=2048))

    def prefix_tokens(self) -> int:
        return round(self.share_ratio * self.input.expected())


class Trace(_Spec):
    """A trace file replayed open loop at its own timestamps (tandem.bench.traces, trace_plan).

    The window is on the file's own clock: rows from `start_s` for `duration_s` seconds, at most
    `max_requests` of them; it is sent `loops` times, its send times divided by `speedup`. Each
    512-token block of a prompt becomes `block_tokens` tokens (prompts scale by
    block_tokens / 512), then prompts are cut to `max_input_tokens` and outputs to
    `max_output_tokens`. `prompt`: token ids (completions, with `tokenizer`) or text.
    """

    kind: Literal["trace"] = "trace"
    path: str
    format: TraceFormat | None = None  # None: detected from the file's first line
    speedup: float = Field(1.0, gt=0)
    start_s: float = Field(0.0, ge=0)
    duration_s: float | None = Field(None, gt=0)
    max_requests: int | None = Field(None, ge=1)
    loops: int = Field(1, ge=1, le=1000)
    block_tokens: int = Field(TRACE_BLOCK_TOKENS, ge=1)
    max_input_tokens: int | None = Field(None, ge=1)
    max_output_tokens: int | None = Field(None, ge=1)
    tokenizer: str | None = None  # the served model's tokenizer.json, or its directory
    prompt: Literal["ids", "text"] = "text"
    bucket_s: float = Field(10.0, gt=0)  # width of the report's time buckets, in replay seconds
    seed: int = 0
    warmup_requests: int = Field(4, ge=0)
    max_concurrency: int | None = Field(None, ge=1)
    max_duration_s: float = Field(600, gt=0)
    task_acceptance: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _prompt_source(self) -> Trace:
        if self.prompt == "ids" and not self.tokenizer:
            raise ValueError("token-id prompts need the served model's tokenizer")
        return self


Workload = Annotated[FixedQPS | Burst | Mixed | SharedPrefix | Trace, Field(discriminator="kind")]


class SLO(_Spec):
    """A request meets the SLO when its TTFT and its mean inter-token latency are both under target."""

    ttft_ms: float = Field(2000, gt=0)
    itl_ms: float = Field(100, gt=0)
