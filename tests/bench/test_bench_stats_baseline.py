"""Percentile and throughput math, queue share, burst recovery, and regression flags against a baseline."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from tandem_process import GOLDEN

from tandem.bench.baseline import compare, find_baseline
from tandem.bench.records import BenchRecord, EngineTotals, RequestRecord
from tandem.bench.sampler import flatten
from tandem.bench.spec import SLO, FixedQPS
from tandem.bench.stats import (
    bucket_deltas,
    burst_recovery,
    engine_totals,
    histogram_quantile,
    percentiles,
    prompt_hit_rate,
    queue_share,
    summarize,
)
from tandem.observability.names import ENGINE_PROMPT_TOKENS_BY_SOURCE


def request(
    i: int, ttft: float, e2e: float, tokens: int = 11, start: float = 0.0, **extra: object
) -> RequestRecord:
    gap = (e2e - ttft) / (tokens - 1)
    return RequestRecord(
        index=i, klass="default", phase=str(extra.pop("phase", "steady")), start_s=start, ok=True, status=200,
        ttft_ms=ttft, e2e_ms=e2e, tpot_ms=gap, itl_ms=[gap] * (tokens - 1), output_tokens=tokens,
        prompt_tokens=100, **extra,  # type: ignore[arg-type]
    )  # fmt: skip


def test_percentiles_of_one_to_one_hundred() -> None:
    p = percentiles(float(v) for v in range(1, 101))
    assert (p.count, p.mean, p.p50, p.p90, p.p99) == (
        100,
        50.5,
        50.5,
        pytest.approx(90.1),
        pytest.approx(99.01),
    )
    assert percentiles([]).p50 is None


def test_summary_throughput_goodput_and_failures() -> None:
    requests = [request(i, ttft=100, e2e=1100, start=i * 1.0) for i in range(10)]
    requests[3] = request(3, ttft=5000, e2e=6000, start=3.0)  # misses the TTFT SLO
    requests.append(
        RequestRecord(index=10, klass="default", phase="steady", start_s=2.0, ok=False, status=503)
    )
    s = summarize(requests, SLO(ttft_ms=1000, itl_ms=150))
    # From the first send (0 s) to the last completion (9 s + 1.1 s).
    assert s.duration_s == pytest.approx(10.1)
    assert (s.ok, s.failed) == (10, 1)
    assert s.request_rate == pytest.approx(10 / 10.1)
    assert s.output_tok_s == pytest.approx(110 / 10.1)
    assert s.goodput_rps == pytest.approx(9 / 10.1)
    assert s.slo_attainment == pytest.approx(9 / 11)
    assert s.ttft_ms.p50 == 100
    assert s.itl_ms.p50 == pytest.approx(100)


def test_router_breakdown_headers_and_queue_share() -> None:
    requests = [
        request(i, 300, 1000, breakdown_ms={"queue": 200.0, "prefill": 80.0}) for i in range(4)
    ]
    s = summarize(requests, SLO())
    assert s.breakdown_ms["queue"].mean == 200
    assert s.breakdown_ms["prefill"].p99 == 80
    # Router queue 200 ms + engine queue 250 ms per request, over 1000 ms end-to-end.
    assert queue_share(s, EngineTotals(queue_ms_per_request=250)) == pytest.approx(0.45)
    assert queue_share(summarize([request(0, 1, 2)], SLO()), EngineTotals()) is None


def test_engine_totals_from_counter_deltas() -> None:
    first = {
        "p": {
            "vllm:request_queue_time_seconds_sum": 1.0,
            "vllm:prefix_cache_hits_total": 0.0,
            "vllm:prefix_cache_queries_total": 0.0,
        }
    }
    last = {
        "p": {
            "vllm:request_queue_time_seconds_sum": 3.0,
            "vllm:prefix_cache_hits_total": 30.0,
            "vllm:prefix_cache_queries_total": 40.0,
        },
        "d": {"vllm:request_queue_time_seconds_sum": 2.0},  # appeared mid-run: counted from zero
    }
    last["router"] = {
        "tandem_router_queue_seconds_sum": 0.8,
        "tandem_router_prefill_seconds_sum": 1.6,
    }
    totals = engine_totals(first, last, [], client_requests=8)
    assert totals.queue_ms_per_request == pytest.approx(1000 * 4 / 8)
    assert totals.router_ms_per_request == {
        "prefill": pytest.approx(200),
        "queue": pytest.approx(100),
    }
    # Without queue headers the router's queue histogram counts: (100 + 500) / 1000 ms.
    assert queue_share(summarize([request(0, 300, 1000)], SLO()), totals) == pytest.approx(0.6)
    assert totals.prefix_hit_rate == pytest.approx(0.75)
    assert totals.prefill_ms_per_request is None


def test_the_hit_rate_counts_each_prompt_once_where_vllm_counts_each_lookup() -> None:
    """Real vLLM 0.32's counters at the end of the P/D transcript: the decode engine looked up
    each prompt it pulled twice (on arrival, and again once the KV was in), so its
    prefix_cache_queries says 186 tokens for its 93 prompt tokens; the per-source counters
    count each prompt once (computed on the prefill engine, pulled by the decode engine, none
    from a prefix cache)."""
    final = GOLDEN / "pd" / "main"
    last = {
        "prefill": flatten((final / "98_prefill_metrics_final.txt").read_text()),
        "decode": flatten((final / "99_decode_metrics_final.txt").read_text()),
    }
    assert last["decode"]["vllm:prefix_cache_queries_total"] == 2 * 93
    assert last["decode"]["vllm:prompt_tokens_total"] == 93

    def since_start(name: str) -> float | None:
        found = [values[name] for values in last.values() if name in values]
        return sum(found) if found else None

    assert since_start(f"{ENGINE_PROMPT_TOKENS_BY_SOURCE}{{source=local_compute}}") == 186
    assert prompt_hit_rate(since_start) == 0.0


def test_the_hit_rate_prefers_the_per_source_counters() -> None:
    first: dict[str, dict[str, float]] = {"e": {}}
    last = {
        "e": {
            "vllm:prefix_cache_hits_total": 300.0,  # a request of 100 cached tokens, looked
            "vllm:prefix_cache_queries_total": 400.0,  # up 3 times while KV was full, and 1
            f"{ENGINE_PROMPT_TOKENS_BY_SOURCE}{{source=local_cache_hit}}": 100.0,  # of 100 uncached
            f"{ENGINE_PROMPT_TOKENS_BY_SOURCE}{{source=local_compute}}": 100.0,
            f"{ENGINE_PROMPT_TOKENS_BY_SOURCE}{{source=external_kv_transfer}}": 500.0,
        }
    }
    assert engine_totals(first, last, [], client_requests=2).prefix_hit_rate == 0.5
    idle = {
        "e": {
            f"{ENGINE_PROMPT_TOKENS_BY_SOURCE}{{source={s}}}": 0.0
            for s in ("local_cache_hit", "local_compute")
        }
    }
    assert engine_totals(first, idle, [], client_requests=0).prefix_hit_rate is None


def test_histogram_quantile_interpolates_inside_buckets() -> None:
    buckets = {0.01: 50.0, 0.02: 90.0, 0.1: 99.0, float("inf"): 100.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.01)
    assert histogram_quantile(0.7, buckets) == pytest.approx(0.015)
    assert histogram_quantile(0.995, buckets) == pytest.approx(
        0.1
    )  # in +Inf: the last finite bound
    assert histogram_quantile(0.5, {float("inf"): 0.0}) is None
    first = {"d": {"h_bucket{le=0.01}": 5.0, "h_bucket{le=+Inf}": 5.0}}
    last = {
        "d": {"h_bucket{le=0.01}": 15.0, "h_bucket{le=+Inf}": 25.0},
        "e": {"h_bucket{le=+Inf}": 1.0},
    }
    assert bucket_deltas(first, last, "h") == {0.01: 10.0, float("inf"): 21.0}


def test_burst_recovery_time() -> None:
    phases = [("low", 1.0, 10.0), ("high", 10.0, 20.0), ("low2", 1.0, 40.0)]
    requests = [request(i, 100, 500, start=float(i), phase="low") for i in range(10)]
    requests += [request(100 + i, 2000, 3000, start=20.0 + i, phase="low2") for i in range(5)]
    requests += [request(200 + i, 110, 500, start=25.0 + i, phase="low2") for i in range(10)]
    assert burst_recovery(requests, phases) == pytest.approx(5.0)
    assert burst_recovery(requests[:15], phases) is None
    assert burst_recovery(requests, phases[:2]) is None


def record(label: str, ttft: float, created: datetime, seed: int = 0) -> BenchRecord:
    requests = [request(i, ttft, ttft + 1000, start=float(i)) for i in range(20)]
    summary = summarize(requests, SLO())
    return BenchRecord(
        run_id=f"{label}-{created.timestamp():.0f}", label=label, created_at=created, finished_at=created,
        endpoint="http://127.0.0.1:1", model="m", api="completions", workload=FixedQPS(seed=seed), seed=seed,
        slo=SLO(), summary=summary, engine=EngineTotals(), requests=requests,
    )  # fmt: skip


def test_compare_flags_only_losses_beyond_tolerance() -> None:
    base = record("A", 100, datetime(2026, 1, 1, tzinfo=UTC))
    slower = record("A", 130, datetime(2026, 1, 2, tzinfo=UTC))
    changes = {c.metric: c for c in compare(slower.summary, base.summary, tolerance=0.10)}
    assert changes["TTFT p50 ms"].regression
    assert changes["TTFT p50 ms"].ratio == pytest.approx(1.3)
    assert not changes["ITL p50 ms"].regression
    assert not any(c.regression for c in compare(base.summary, slower.summary, tolerance=0.10))
    assert not any(c.regression for c in compare(slower.summary, base.summary, tolerance=0.5))


def test_baseline_store_picks_the_newest_record_of_the_same_workload(tmp_path: Path) -> None:
    old = record("A", 100, datetime(2026, 1, 1, tzinfo=UTC))
    new = record("A", 120, datetime(2026, 1, 3, tzinfo=UTC))
    other_seed = record("A", 90, datetime(2026, 1, 4, tzinfo=UTC), seed=9)
    for r in (old, new, other_seed):
        r.save(tmp_path / "store" / f"{r.run_id}.json")
    (tmp_path / "store" / "notes.json").write_text("{}")
    current = record("A", 150, datetime(2026, 1, 5, tzinfo=UTC))
    assert find_baseline(tmp_path / "store", current).run_id == new.run_id
    assert find_baseline(tmp_path / "store" / f"{old.run_id}.json", current).run_id == old.run_id
    roundtrip = BenchRecord.load(tmp_path / "store" / f"{new.run_id}.json")
    assert roundtrip == new
    with pytest.raises(FileNotFoundError):
        find_baseline(tmp_path / "store", record("A", 1, datetime(2026, 1, 6, tzinfo=UTC), seed=4))
