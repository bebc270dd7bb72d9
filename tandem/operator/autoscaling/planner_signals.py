"""What the P:D planner observes at one evaluation: the offered load and each pool's operating point."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class PoolLoad(BaseModel):
    """One pool's engines and how busy they are, summed over its engines.

    `latency_s` is the pool's mean per-step latency over the window: for prefill the mean
    prefill time of a request (`vllm:request_prefill_time_seconds`), for decode the mean
    inter-token latency; `queue_s` the mean time a request waited before its first step
    (`vllm:request_queue_time_seconds`); None when no request finished in the window.
    """

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    engines: int = Field(ge=0)
    waiting: float = Field(0.0, ge=0)
    running: float = Field(0.0, ge=0)
    latency_s: float | None = Field(None, ge=0)
    queue_s: float | None = Field(None, ge=0)


class PlannerSignals(BaseModel):
    """The load offered to the whole cluster and the two pools' operating points.

    Token rates are per second over the window: prompt tokens the prefill pool took in,
    output tokens the decode pool generated. Per-request means are None while no request
    finished in the window; `prefix_hit_rate` is the prefill pool's prefix-cache hit share of
    prompt tokens (0..1), None when no prompt was looked up.
    """

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    prompt_tokens_per_s: float = Field(ge=0)
    output_tokens_per_s: float = Field(ge=0)
    prompt_tokens_per_request: float | None = Field(None, ge=0)
    output_tokens_per_request: float | None = Field(None, ge=0)
    prefix_hit_rate: float | None = Field(None, ge=0, le=1)
    prefill: PoolLoad
    decode: PoolLoad
