"""Pure report functions of a trace replay (load and latency over time, goodput per SLO, prefix
reuse against the trace's bound) and their terminal tables."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from rich.table import Table

from tandem.bench.records import EngineTotals, RequestRecord
from tandem.bench.spec import SLO, Trace
from tandem.bench.stats import meets_slo
from tandem.bench.trace_plan import TimedRequest, prefix_bound
from tandem.bench.trace_records import SLOGoodput, TraceBucket, TraceReport


def _quantiles(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    p50, p99 = np.percentile(np.asarray(values, dtype=float), [50, 99])
    return float(p50), float(p99)


def completion_s(request: RequestRecord) -> float:
    """When a request ended: start_s + e2e_ms / 1000 (its start when it has no e2e)."""
    return request.start_s + (request.e2e_ms or 0.0) / 1000


def time_buckets(
    timed: Sequence[TimedRequest], requests: Sequence[RequestRecord], bucket_s: float
) -> list[TraceBucket]:
    """Offered against achieved load, and TTFT/TPOT, per bucket of `bucket_s` seconds.

    Bucket k is [k * w, (k + 1) * w). offered_rps = scheduled sends in it / w;
    offered_tok_s = their (input + output) tokens / w; achieved_rps = successful completions in
    it / w; achieved_tok_s = those requests' (usage prompt tokens, else planned input, + output
    tokens) / w; TTFT and TPOT p50/p99 are over the successful requests sent in it. The buckets
    run until the last send or completion.
    """
    planned = {r.index: r for r in timed}
    ends = [completion_s(r) for r in requests]
    horizon = max([*(r.at_s for r in timed), *ends, 0.0])
    count = int(horizon // bucket_s) + 1
    offered = [0] * count
    offered_tok = [0] * count
    for r in timed:
        k = min(count - 1, int(r.at_s // bucket_s))
        offered[k] += 1
        offered_tok[k] += r.input_tokens + r.output_tokens
    completed = [0] * count
    achieved_tok = [0] * count
    failed = [0] * count
    ttft: list[list[float]] = [[] for _ in range(count)]
    tpot: list[list[float]] = [[] for _ in range(count)]
    for request, end in zip(requests, ends, strict=True):
        sent = min(count - 1, max(0, int(request.start_s // bucket_s)))
        if not request.ok:
            failed[sent] += 1
            continue
        k = min(count - 1, int(end // bucket_s))
        completed[k] += 1
        prompt = request.prompt_tokens
        if prompt is None:
            prompt = planned[request.index].input_tokens if request.index in planned else 0
        achieved_tok[k] += prompt + request.output_tokens
        if request.ttft_ms is not None:
            ttft[sent].append(request.ttft_ms)
        if request.tpot_ms is not None:
            tpot[sent].append(request.tpot_ms)
    buckets = []
    for k in range(count):
        ttft_p50, ttft_p99 = _quantiles(ttft[k])
        tpot_p50, tpot_p99 = _quantiles(tpot[k])
        buckets.append(
            TraceBucket(
                start_s=k * bucket_s,
                offered=offered[k],
                completed=completed[k],
                failed=failed[k],
                offered_rps=offered[k] / bucket_s,
                achieved_rps=completed[k] / bucket_s,
                offered_tok_s=offered_tok[k] / bucket_s,
                achieved_tok_s=achieved_tok[k] / bucket_s,
                ttft_ms_p50=ttft_p50,
                ttft_ms_p99=ttft_p99,
                tpot_ms_p50=tpot_p50,
                tpot_ms_p99=tpot_p99,
            )
        )
    return buckets


def slo_goodput(
    requests: Sequence[RequestRecord], slos: Sequence[SLO], duration_s: float
) -> list[SLOGoodput]:
    """Per SLO: attainment = requests meeting it (`stats.meets_slo`: TTFT <= ttft_ms and TPOT
    <= itl_ms) / requests sent, goodput_rps = those requests / duration_s."""
    out = []
    for slo in slos:
        met = sum(meets_slo(r, slo) for r in requests)
        out.append(
            SLOGoodput(
                ttft_ms=slo.ttft_ms,
                tpot_ms=slo.itl_ms,
                attainment=met / len(requests) if requests else 0.0,
                goodput_rps=met / duration_s if duration_s > 0 else 0.0,
            )
        )
    return out


def trace_report(
    spec: Trace,
    trace_format: str,
    timed: Sequence[TimedRequest],
    requests: Sequence[RequestRecord],
    engine: EngineTotals,
) -> TraceReport:
    """The trace part of a record; engine_share_of_bound = engine hit rate / token bound."""
    bound = prefix_bound(timed, spec.block_tokens)
    span = max((r.at_s for r in timed), default=0.0)
    n = len(timed)
    share = None
    if engine.prefix_hit_rate is not None and bound.token_fraction:
        share = engine.prefix_hit_rate / bound.token_fraction
    return TraceReport(
        format=trace_format,
        requests=n,
        offered_span_s=span,
        offered_rps=n / span if span > 0 else 0.0,
        mean_input_tokens=sum(r.input_tokens for r in timed) / n if n else 0.0,
        mean_output_tokens=sum(r.output_tokens for r in timed) / n if n else 0.0,
        block_tokens=spec.block_tokens,
        bound_block_hit_rate=bound.block_fraction,
        bound_token_hit_rate=bound.token_fraction,
        engine_hit_rate=engine.prefix_hit_rate,
        engine_share_of_bound=share,
        bucket_s=spec.bucket_s,
        buckets=time_buckets(timed, requests, spec.bucket_s),
    )


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _tokens(value: float) -> str:
    """Tokens/s short enough for a narrow terminal: 35.0k from 10,000 on."""
    return f"{value / 1000:.1f}k" if value >= 10_000 else f"{value:,.0f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def buckets_table(report: TraceReport) -> Table:
    table = Table(
        title=f"offered (sent) vs achieved (done) load and latency, {report.bucket_s:g} s buckets",
        title_justify="left",
    )
    # one short word per line, so that the table fits 80 columns
    columns = ("from s", "req/s sent", "req/s done", "tok/s sent", "tok/s done",
               "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "fail")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    for b in report.buckets:
        table.add_row(
            f"{b.start_s:g}", _num(b.offered_rps, 2), _num(b.achieved_rps, 2),
            _tokens(b.offered_tok_s), _tokens(b.achieved_tok_s), _num(b.ttft_ms_p50),
            _num(b.ttft_ms_p99),
            _num(b.tpot_ms_p50, 1), _num(b.tpot_ms_p99, 1), str(b.failed),
        )  # fmt: skip
    return table


def goodput_table(goodput: Sequence[SLOGoodput]) -> Table:
    table = Table(title="SLO attainment (goodput)", title_justify="left")
    for column in ("TTFT ≤ ms", "TPOT ≤ ms", "attainment", "goodput req/s"):
        table.add_column(column, justify="right")
    for g in goodput:
        table.add_row(
            f"{g.ttft_ms:g}", f"{g.tpot_ms:g}", _pct(g.attainment), f"{g.goodput_rps:.2f}"
        )
    return table


def describe_trace(spec: Trace) -> str:
    """The replay's options, as the report's workload line."""
    parts = [f"trace {spec.path} ({spec.format or 'detected'})", f"speed x{spec.speedup:g}"]
    if spec.start_s or spec.duration_s is not None:
        end = "end" if spec.duration_s is None else f"{spec.start_s + spec.duration_s:g} s"
        parts.append(f"window {spec.start_s:g} s to {end}")
    if spec.max_requests is not None:
        parts.append(f"first {spec.max_requests} requests")
    if spec.loops > 1:
        parts.append(f"{spec.loops} loops")
    parts.append(f"{spec.block_tokens} tokens per 512-token block")
    if spec.max_input_tokens is not None:
        parts.append(f"input ≤ {spec.max_input_tokens}")
    if spec.max_output_tokens is not None:
        parts.append(f"output ≤ {spec.max_output_tokens}")
    parts.append("token-id prompts" if spec.prompt == "ids" else "text prompts")
    return ", ".join(parts)


def trace_lines(report: TraceReport) -> list[str]:
    """The trace's shape and its prefix reuse, one line each."""
    return [
        f"trace ({report.format}): {report.requests} requests over {report.offered_span_s:.1f} s "
        f"({report.offered_rps:.2f} req/s offered), mean input {report.mean_input_tokens:,.0f} / "
        f"output {report.mean_output_tokens:,.0f} tokens, {report.block_tokens}-token blocks",
        f"prefix-cache hit rate: engines {_pct(report.engine_hit_rate)} against the trace's "
        f"unbounded-cache bound {_pct(report.bound_token_hit_rate)} of tokens "
        f"({_pct(report.bound_block_hit_rate)} of blocks); engines reach "
        f"{_pct(report.engine_share_of_bound)} of the bound",
    ]
