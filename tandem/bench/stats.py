"""Pure statistics over request results: percentiles, throughput, goodput, breakdowns, recovery."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from tandem.bench.records import EngineTotals, Percentiles, RequestRecord, SampleRecord, Summary
from tandem.bench.spec import SLO
from tandem.observability.names import (
    ENGINE_PREFIX_HITS,
    ENGINE_PREFIX_QUERIES,
    ENGINE_PROMPT_TOKENS_BY_SOURCE,
)

ROUTER_STAGE = re.compile(r"^tandem_router_(.+)_seconds_sum$")


def percentiles(values_ms: Iterable[float]) -> Percentiles:
    """Mean and p50/p90/p99 with numpy's linear interpolation between closest ranks."""
    data = np.asarray(list(values_ms), dtype=float)
    if data.size == 0:
        return Percentiles()
    p50, p90, p99 = np.percentile(data, [50, 90, 99])
    return Percentiles(
        count=int(data.size),
        mean=float(data.mean()),
        p50=float(p50),
        p90=float(p90),
        p99=float(p99),
    )


def meets_slo(request: RequestRecord, slo: SLO) -> bool:
    """TTFT <= slo.ttft_ms and time per output token <= slo.itl_ms (a one-token answer has no ITL)."""
    if not request.ok or request.ttft_ms is None or request.ttft_ms > slo.ttft_ms:
        return False
    return request.tpot_ms is None or request.tpot_ms <= slo.itl_ms


def summarize(requests: Sequence[RequestRecord], slo: SLO) -> Summary:
    """Throughput over the span from the first send to the last completion, latencies of successes."""
    ok = [r for r in requests if r.ok]
    if requests:
        begin = min(r.start_s for r in requests)
        end = max(r.start_s + (r.e2e_ms or 0.0) / 1000 for r in requests)
        duration = max(end - begin, 1e-9)
    else:
        duration = 0.0
    per_s = 1 / duration if duration > 0 else 0.0
    stages = sorted({stage for r in ok for stage in r.breakdown_ms})
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    good = sum(meets_slo(r, slo) for r in requests)
    return Summary(
        requests=len(requests),
        ok=len(ok),
        failed=len(requests) - len(ok),
        duration_s=duration,
        request_rate=len(ok) * per_s,
        output_tok_s=sum(r.output_tokens for r in ok) * per_s,
        input_tok_s=prompt * per_s,
        goodput_rps=good * per_s,
        slo_attainment=good / len(requests) if requests else 0.0,
        ttft_ms=percentiles(r.ttft_ms for r in ok if r.ttft_ms is not None),
        itl_ms=percentiles(gap for r in ok for gap in r.itl_ms),
        tpot_ms=percentiles(r.tpot_ms for r in ok if r.tpot_ms is not None),
        e2e_ms=percentiles(r.e2e_ms for r in ok if r.e2e_ms is not None),
        breakdown_ms={
            s: percentiles(r.breakdown_ms[s] for r in ok if s in r.breakdown_ms) for s in stages
        },
        cached_prompt_fraction=(sum(cached) / prompt) if cached and prompt else None,
    )


def group_by(requests: Sequence[RequestRecord], key: str, slo: SLO) -> dict[str, Summary]:
    """A summary per distinct value of `klass` or `phase`, in order of first appearance."""
    groups: dict[str, list[RequestRecord]] = {}
    for r in requests:
        groups.setdefault(getattr(r, key), []).append(r)
    return {name: summarize(members, slo) for name, members in groups.items()}


def prompt_cache_tokens(delta: Callable[[str], float | None]) -> tuple[float, float] | None:
    """The engines' prompt tokens taken from their prefix caches and the prompt tokens they
    computed or took from them, from the increases `delta(name)` of their counters over a run
    (None where they export neither pair): `vllm:prompt_tokens_by_source`'s local_cache_hit and
    local_cache_hit + local_compute, counted once per request at its first scheduling (tokens
    pulled from a P/D prefill engine count on neither side). vLLM's `prefix_cache_hits` and
    `prefix_cache_queries` count a lookup each time its scheduler tries the request at the head
    of the waiting queue, again after every step it could not be admitted (KV full): that
    weights the requests that waited, and so the engines a router fills up. They are the
    figures of last resort, for engines without the per-source counters."""
    hit = delta(f"{ENGINE_PROMPT_TOKENS_BY_SOURCE}{{source=local_cache_hit}}")
    computed = delta(f"{ENGINE_PROMPT_TOKENS_BY_SOURCE}{{source=local_compute}}")
    if hit is not None and computed is not None:
        return hit, hit + computed
    hits = delta(ENGINE_PREFIX_HITS)
    queries = delta(ENGINE_PREFIX_QUERIES)
    return None if hits is None or queries is None else (hits, queries)


def prompt_hit_rate(delta: Callable[[str], float | None]) -> float | None:
    """hit rate = Σ local_cache_hit / Σ (local_cache_hit + local_compute) over the run
    (`prompt_cache_tokens`); None when no prompt token was counted."""
    tokens = prompt_cache_tokens(delta)
    return tokens[0] / tokens[1] if tokens and tokens[1] else None


def _delta(
    first: dict[str, dict[str, float]], last: dict[str, dict[str, float]], name: str
) -> float | None:
    """Increase of counter `name` summed over sources; None when no source exports it."""
    found = [src for src, values in last.items() if name in values]
    if not found:
        return None
    return sum(last[src][name] - first.get(src, {}).get(name, 0.0) for src in found)


def engine_totals(
    first: dict[str, dict[str, float]],
    last: dict[str, dict[str, float]],
    samples: Sequence[SampleRecord],
    client_requests: int,
) -> EngineTotals:
    """Per-client-request engine times from histogram sums (ms), hit rate, preemptions, peaks.

    x_ms_per_request = 1000 * delta(vllm:request_x_time_seconds_sum) / client_requests, summed over
    every engine: with P/D a request queues at a prefill and at a decode engine and both count.
    """

    def per_request(name: str) -> float | None:
        total = _delta(first, last, name)
        return None if total is None or client_requests == 0 else 1000 * total / client_requests

    router_stages = sorted(
        {
            m.group(1)
            for values in last.values()
            for name in values
            if (m := ROUTER_STAGE.match(name))
        }
    )
    router_ms = {
        stage: per_request(f"tandem_router_{stage}_seconds_sum") for stage in router_stages
    }
    waiting = [
        s.values["vllm:num_requests_waiting"]
        for s in samples
        if "vllm:num_requests_waiting" in s.values
    ]
    kv = [
        s.values["vllm:kv_cache_usage_perc"]
        for s in samples
        if "vllm:kv_cache_usage_perc" in s.values
    ]
    itl_buckets = bucket_deltas(first, last, "vllm:inter_token_latency_seconds")
    itl_p50, itl_p99 = (histogram_quantile(q, itl_buckets) for q in (0.5, 0.99))
    return EngineTotals(
        itl_ms_p50=None if itl_p50 is None else 1000 * itl_p50,
        itl_ms_p99=None if itl_p99 is None else 1000 * itl_p99,
        queue_ms_per_request=per_request("vllm:request_queue_time_seconds_sum"),
        prefill_ms_per_request=per_request("vllm:request_prefill_time_seconds_sum"),
        decode_ms_per_request=per_request("vllm:request_decode_time_seconds_sum"),
        kv_transfer_ms_per_request=per_request("vllm:nixl_xfer_time_seconds_sum"),
        prefix_hit_rate=prompt_hit_rate(lambda name: _delta(first, last, name)),
        preemptions=_delta(first, last, "vllm:num_preemptions_total"),
        max_waiting=max(waiting) if waiting else None,
        max_kv_usage=max(kv) if kv else None,
        router_ms_per_request={stage: ms for stage, ms in router_ms.items() if ms is not None},
    )


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The q-quantile of a cumulative histogram {upper bound: count}, interpolating linearly
    inside the bucket that holds it (as Prometheus's histogram_quantile does); None if empty.
    A quantile in the +Inf bucket is reported as the largest finite bound."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            inside = count - lower_count
            fraction = (rank - lower_count) / inside if inside > 0 else 1.0
            return lower_bound + (bound - lower_bound) * fraction
        lower_bound, lower_count = bound, count
    return lower_bound


def bucket_deltas(
    first: dict[str, dict[str, float]], last: dict[str, dict[str, float]], name: str
) -> dict[float, float]:
    """{upper bound: increase over the run} of histogram `name`'s buckets, summed over sources."""
    prefix = f"{name}_bucket{{le="
    deltas: dict[float, float] = {}
    for source, values in last.items():
        for key, value in values.items():
            if key.startswith(prefix):
                bound = float(key[len(prefix) : -1])
                before = first.get(source, {}).get(key, 0.0)
                deltas[bound] = deltas.get(bound, 0.0) + value - before
    return deltas


def queue_share(summary: Summary, engine: EngineTotals) -> float | None:
    """(router queue + engine queue) per request / mean end-to-end latency.

    The router's part is the mean of every `x-tandem-*-ms` header stage whose name contains
    "queue", or failing headers the router's queue histograms per request; the engines' part is
    `engine.queue_ms_per_request`. None when neither is known.
    """
    router_queue = [
        p.mean
        for stage, p in summary.breakdown_ms.items()
        if "queue" in stage and p.mean is not None
    ]
    if not router_queue:
        router_queue = [
            ms for stage, ms in engine.router_ms_per_request.items() if "queue" in stage
        ]
    parts = [
        *router_queue,
        *([engine.queue_ms_per_request] if engine.queue_ms_per_request is not None else []),
    ]
    if not parts or not summary.e2e_ms.mean:
        return None
    return min(1.0, sum(parts) / summary.e2e_ms.mean)


def burst_recovery(
    requests: Sequence[RequestRecord], phase_ends: Sequence[tuple[str, float, float]]
) -> float | None:
    """Seconds after the busiest phase ends until TTFT is back near its level before it.

    phase_ends: (name, qps, end_s) per phase in order. The reference level is the median TTFT of
    the first phase; recovery is the first post-peak request from which the next 5 TTFTs are all
    <= 1.5 x that level, measured from the peak's end. None if never or not a burst.
    """
    if len(phase_ends) < 3:
        return None
    peak = max(range(len(phase_ends)), key=lambda i: phase_ends[i][1])
    if peak == 0 or peak == len(phase_ends) - 1:
        return None
    first_name = phase_ends[0][0]
    before = [
        r.ttft_ms for r in requests if r.phase == first_name and r.ok and r.ttft_ms is not None
    ]
    if not before:
        return None
    level = 1.5 * float(np.median(before))
    peak_end = phase_ends[peak][2]
    after = sorted(
        (r for r in requests if r.start_s >= peak_end and r.ok and r.ttft_ms is not None),
        key=lambda r: r.start_s,
    )
    for i in range(len(after)):
        window = [r.ttft_ms for r in after[i : i + 5] if r.ttft_ms is not None]
        if len(window) == 5 and max(window) <= level:
            return after[i].start_s - peak_end
    return None
