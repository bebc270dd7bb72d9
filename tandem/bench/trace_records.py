"""Record fields of a trace replay: load and latency per time bucket, goodput per SLO, prefix reuse."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TraceBucket(_Record):
    """One time bucket [start_s, start_s + width) of a replay (seconds from its start).

    Offered: the requests scheduled to be sent in it, per second, and their prompt + output
    tokens per second. Achieved: the requests that completed in it, and the prompt (usage) +
    output tokens of those. Latencies are of the requests sent in it that succeeded.
    """

    start_s: float
    offered: int
    completed: int
    failed: int  # sent in the bucket and failed
    offered_rps: float
    achieved_rps: float
    offered_tok_s: float
    achieved_tok_s: float
    ttft_ms_p50: float | None = None
    ttft_ms_p99: float | None = None
    tpot_ms_p50: float | None = None
    tpot_ms_p99: float | None = None


class SLOGoodput(_Record):
    """Requests meeting TTFT <= ttft_ms and TPOT <= tpot_ms: their share and rate."""

    ttft_ms: float
    tpot_ms: float
    attainment: float  # met / requests sent
    goodput_rps: float  # met / the run's duration


class TraceReport(_Record):
    """What a trace replay adds to the record."""

    format: str
    requests: int  # timed requests of the replay (window x loops)
    offered_span_s: float  # last scheduled send time
    offered_rps: float  # requests / span (mean offered rate)
    mean_input_tokens: float
    mean_output_tokens: float
    block_tokens: int
    # An unbounded cache's hit rate on the replay's prompts (tandem.bench.trace_plan.prefix_bound).
    bound_block_hit_rate: float | None = None
    bound_token_hit_rate: float | None = None
    engine_hit_rate: float | None = None  # stats.prompt_hit_rate over the run
    engine_share_of_bound: float | None = None  # engine_hit_rate / bound_token_hit_rate
    bucket_s: float
    buckets: list[TraceBucket] = Field(default_factory=list)
