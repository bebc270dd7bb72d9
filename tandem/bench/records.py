"""The benchmark record: one JSON document per run (config, workload, seed, versions, results)."""

from __future__ import annotations

import platform
import sys
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tandem.bench.spec import SLO, Workload
from tandem.bench.trace_records import SLOGoodput, TraceReport

SCHEMA_VERSION = 1


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Percentiles(_Record):
    """Summary of one latency, in milliseconds (numpy's linear-interpolation percentiles)."""

    count: int = 0
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None


class Summary(_Record):
    """Throughput, latency and resources of a set of requests (the whole run, a class or a phase)."""

    requests: int
    ok: int
    failed: int
    duration_s: float
    request_rate: float  # completed requests per second
    output_tok_s: float
    input_tok_s: float
    goodput_rps: float  # requests per second that met the SLO
    slo_attainment: float  # fraction of requests that met the SLO
    ttft_ms: Percentiles
    itl_ms: Percentiles  # every gap between two token chunks
    tpot_ms: Percentiles  # per request: (e2e - ttft) / (output tokens - 1)
    e2e_ms: Percentiles
    breakdown_ms: dict[str, Percentiles] = Field(
        default_factory=dict
    )  # router x-tandem-*-ms headers
    cached_prompt_fraction: float | None = (
        None  # usage.prompt_tokens_details.cached_tokens / prompt
    )


class EngineTotals(_Record):
    """What the engines' /metrics said about the measured window (counter deltas)."""

    queue_ms_per_request: float | None = None  # sum of vllm:request_queue_time over client requests
    prefill_ms_per_request: float | None = None
    decode_ms_per_request: float | None = None
    kv_transfer_ms_per_request: float | None = None  # vllm:nixl_xfer_time
    prefix_hit_rate: float | None = None  # the prompt tokens from cache (stats.prompt_hit_rate)
    preemptions: float | None = None
    max_waiting: float | None = None
    max_kv_usage: float | None = None
    # The engines' own inter-token latency (vllm:inter_token_latency_seconds buckets over the
    # run), which client-side and proxy delays do not touch.
    itl_ms_p50: float | None = None
    itl_ms_p99: float | None = None
    # Router histograms (tandem_router_<stage>_seconds), mean ms per client request, by stage.
    router_ms_per_request: dict[str, float] = Field(default_factory=dict)


class ResourceSummary(_Record):
    """One resource over the run (tandem.bench.resources): baseline is the first sample, before
    the load; saturated_at_s is when it first reached saturation_threshold of its capacity."""

    name: str
    source: str
    unit: str
    baseline: float
    mean: float
    p99: float
    peak: float
    capacity: float | None = None
    saturation_threshold: float | None = None
    saturated_at_s: float | None = None


class RequestRecord(_Record):
    index: int
    klass: str
    phase: str
    start_s: float
    ok: bool
    status: int
    error: str = ""
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    tpot_ms: float | None = None
    itl_ms: list[float] = Field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    breakdown_ms: dict[str, float] = Field(default_factory=dict)
    tags: dict[str, str] = Field(default_factory=dict)  # other x-tandem-* headers: route, engines
    lag_ms: float = 0.0


class SampleRecord(_Record):
    t_s: float
    source: str
    values: dict[str, float]


class BenchRecord(_Record):
    """One run against one endpoint; the unit the baseline store keeps and compares."""

    schema_version: int = SCHEMA_VERSION
    run_id: str
    label: str
    created_at: datetime
    finished_at: datetime
    endpoint: str
    model: str
    api: str
    workload: Workload
    seed: int
    slo: SLO
    config: dict[str, Any] = Field(default_factory=dict)  # what the caller knows of the deployment
    versions: dict[str, str] = Field(default_factory=dict)
    summary: Summary
    engine: EngineTotals
    queue_share: float | None = None  # queueing's share of mean end-to-end latency
    burst_recovery_s: float | None = None
    by_class: dict[str, Summary] = Field(default_factory=dict)
    by_phase: dict[str, Summary] = Field(default_factory=dict)
    requests: list[RequestRecord] = Field(default_factory=list)
    samples: list[SampleRecord] = Field(default_factory=list)
    resources: list[ResourceSummary] = Field(default_factory=list)
    slo_goodput: list[SLOGoodput] = Field(default_factory=list)  # one per SLO given
    trace: TraceReport | None = None  # a trace replay's load over time and prefix reuse

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=1))
        return path

    @classmethod
    def load(cls, path: Path) -> BenchRecord:
        return cls.model_validate_json(path.read_text())


def versions() -> dict[str, str]:
    """Versions that explain a number: Tandem, Python, the platform and the client libraries."""
    found = {"python": sys.version.split()[0], "platform": platform.platform()}
    for dist in ("tandem-serving", "aiohttp", "vllm"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return found
