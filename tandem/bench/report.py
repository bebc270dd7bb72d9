"""The terminal report: latency, throughput, breakdown and resources of runs, A/B ratios, regressions."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from tandem.bench.baseline import METRICS, Change
from tandem.bench.records import BenchRecord, Percentiles, Summary
from tandem.bench.resources import first_saturated
from tandem.bench.trace_report import buckets_table, describe_trace, goodput_table, trace_lines


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.2f}"


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def describe_workload(record: BenchRecord) -> str:
    w = record.workload
    if w.kind == "trace":
        return describe_trace(w)
    out = w.output.describe()
    if w.kind == "burst":
        phases = " → ".join(f"{p.qps:g} qps for {p.duration_s:g}s" for p in w.phases)
        return f"burst {phases}, input {w.input.describe()}, output {out}"
    if w.kind == "mixed":
        return (
            f"mixed at {w.qps:g} qps, {w.num_requests} requests, {100 * w.long_fraction:.0f}% long "
            f"(input {w.long_input.describe()}), short input {w.short_input.describe()}, output {out}"
        )
    if w.kind == "shared-prefix":
        return (
            f"shared prefix at {w.qps:g} qps, {w.num_requests} requests, {w.groups} groups, "
            f"share {w.share_ratio:.0%} of {w.input.describe()} tokens, output {out}"
        )
    return f"fixed {w.qps:g} qps (Poisson), {w.num_requests} requests, input {w.input.describe()}, output {out}"


def latency_table(summary: Summary, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("latency (ms)", "mean", "p50", "p90", "p99", "n"):
        table.add_column(column, justify="right" if column != "latency (ms)" else "left")
    rows: list[tuple[str, Percentiles]] = [
        ("TTFT", summary.ttft_ms),
        ("inter-token", summary.itl_ms),
        ("time per output token", summary.tpot_ms),
        ("end-to-end", summary.e2e_ms),
    ]
    rows += [(f"router: {stage}", p) for stage, p in summary.breakdown_ms.items()]
    for name, p in rows:
        table.add_row(name, _ms(p.mean), _ms(p.p50), _ms(p.p90), _ms(p.p99), str(p.count))
    return table


def overview_table(record: BenchRecord) -> Table:
    s, e = record.summary, record.engine
    table = Table(
        title="throughput, queueing and resources", title_justify="left", show_header=False
    )
    table.add_column(justify="left")
    table.add_column(justify="right")
    rows = [
        ("requests ok / failed", f"{s.ok} / {s.failed}"),
        ("duration", f"{s.duration_s:.1f} s"),
        ("requests/s", f"{s.request_rate:.2f}"),
        ("output tokens/s", f"{s.output_tok_s:,.0f}"),
        ("input tokens/s", f"{s.input_tok_s:,.0f}"),
        (
            f"goodput (TTFT ≤ {record.slo.ttft_ms:g} ms, TPOT ≤ {record.slo.itl_ms:g} ms)",
            f"{s.goodput_rps:.2f} req/s ({_pct(s.slo_attainment)})",
        ),
        ("queueing share of end-to-end", _pct(record.queue_share)),
        (
            "engine queue / prefill / decode per request (ms)",
            " / ".join(
                _ms(v)
                for v in (e.queue_ms_per_request, e.prefill_ms_per_request, e.decode_ms_per_request)
            ),
        ),
        ("KV transfer per request (ms)", _ms(e.kv_transfer_ms_per_request)),
        ("inter-token p50 / p99 at the engines (ms)", f"{_ms(e.itl_ms_p50)} / {_ms(e.itl_ms_p99)}"),
        *[
            (f"router {stage} per request (ms)", _ms(ms))
            for stage, ms in e.router_ms_per_request.items()
        ],
        ("prefix-cache hit rate (engines)", _pct(e.prefix_hit_rate)),
        ("cached prompt tokens (usage)", _pct(s.cached_prompt_fraction)),
        (
            "peak waiting requests / peak KV usage",
            f"{_count(e.max_waiting)} / {_pct(e.max_kv_usage)}",
        ),
        ("preemptions", _count(e.preemptions)),
    ]
    routes = Counter(r.tags["route"] for r in record.requests if "route" in r.tags)
    if routes:
        rows.append(
            (
                "routes taken (router)",
                ", ".join(f"{name} {count}" for name, count in routes.most_common()),
            )
        )
    if record.burst_recovery_s is not None or record.workload.kind == "burst":
        recovery = (
            "not within the run"
            if record.burst_recovery_s is None
            else f"{record.burst_recovery_s:.1f} s"
        )
        rows.append(("recovery after the burst", recovery))
    for name, value in rows:
        table.add_row(name, value)
    return table


def groups_table(groups: dict[str, Summary], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column in (
        "",
        "ok",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        "E2E p50",
        "E2E p99",
        "req/s",
    ):
        table.add_column(column, justify="right" if column else "left")
    for name, s in groups.items():
        table.add_row(
            name, str(s.ok), _ms(s.ttft_ms.p50), _ms(s.ttft_ms.p99), _ms(s.itl_ms.p50), _ms(s.itl_ms.p99),
            _ms(s.e2e_ms.p50), _ms(s.e2e_ms.p99), f"{s.request_rate:.2f}",
        )  # fmt: skip
    return table


def _amount(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if unit in ("MiB", "count") or value >= 100 else f"{value:.1f}"


def resources_table(record: BenchRecord) -> Table:
    """Baseline, mean, p99 and peak of each resource, and when it saturated."""
    table = Table(title="resources (baseline = before the load)", title_justify="left")
    for column in ("resource", "source", "unit", "baseline", "mean", "p99", "peak", "saturated"):
        table.add_column(column, justify="left" if column in ("resource", "source") else "right")
    first = first_saturated(record.resources)
    for r in record.resources:
        if r.saturated_at_s is None:
            saturated = "-"
        else:
            saturated = f"at {r.saturated_at_s:.1f} s" + (" [bold](first)[/]" if r is first else "")
        table.add_row(
            r.name, r.source, r.unit, _amount(r.baseline, r.unit), _amount(r.mean, r.unit),
            _amount(r.p99, r.unit), _amount(r.peak, r.unit), saturated,
        )  # fmt: skip
    return table


def saturation_line(record: BenchRecord) -> str:
    first = first_saturated(record.resources)
    if first is None:
        return "no resource reached its saturation threshold"
    threshold = f"{100 * (first.saturation_threshold or 0):.0f}%"
    what = "first preemption" if first.name == "preemptions" else f"≥ {threshold} of capacity"
    return (
        f"first to saturate: {first.name} ({first.source}) at {first.saturated_at_s:.1f} s ({what})"
    )


def print_record(console: Console, record: BenchRecord) -> None:
    console.rule(f"[bold]{record.label}[/] — {record.endpoint} — model {record.model}")
    console.print(
        f"workload: {describe_workload(record)}; seed {record.seed}; warm-up {record.workload.warmup_requests} requests excluded"
    )
    console.print(latency_table(record.summary, "latency"))
    console.print(overview_table(record))
    if record.workload.kind == "mixed" and record.by_class:
        console.print(groups_table(record.by_class, "by request class"))
    if record.by_phase:
        console.print(groups_table(record.by_phase, "by phase"))
    if record.resources:
        console.print(resources_table(record))
        console.print(saturation_line(record))
    if record.trace is not None:
        for line in trace_lines(record.trace):
            console.print(line)
        console.print(buckets_table(record.trace))
    if record.trace is not None or len(record.slo_goodput) > 1:
        console.print(goodput_table(record.slo_goodput))
    lag = max((r.lag_ms for r in record.requests), default=0.0)
    if lag > 50:
        console.print(
            f"[yellow]the client sent some requests up to {lag:.0f} ms late: it may be the bottleneck[/]"
        )
    errors = sorted({r.error for r in record.requests if not r.ok and r.error})
    for error in errors[:3]:
        console.print(f"[red]error:[/] {error}")


def print_ab(console: Console, records: Sequence[BenchRecord]) -> None:
    """Side-by-side metrics of several runs with each one's ratio to the first."""
    base = records[0]
    table = Table(title=f"A/B: ratios to {base.label}", title_justify="left")
    table.add_column("metric")
    for record in records:
        table.add_column(record.label, justify="right")
    for record in records[1:]:
        table.add_column(f"{record.label}/{base.label}", justify="right")
    for name, read, _ in METRICS:
        values = [read(r.summary) for r in records]
        ratios = [
            "-" if v is None or not values[0] else f"{v / values[0]:.2f}x" for v in values[1:]
        ]
        table.add_row(name, *[_ms(v) for v in values], *ratios)
    table.add_row(
        "queueing share", *[_pct(r.queue_share) for r in records], *["" for _ in records[1:]]
    )
    console.print(table)


def print_changes(
    console: Console, changes: Sequence[Change], baseline: BenchRecord, tolerance: float
) -> None:
    table = Table(
        title=f"against baseline {baseline.run_id} (tolerance {tolerance:.0%})",
        title_justify="left",
    )
    for column in ("metric", "baseline", "now", "ratio", ""):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for c in changes:
        flag = (
            "[red]REGRESSION[/]"
            if c.regression
            else ("[green]better[/]" if c.worse_by < -tolerance else "")
        )
        table.add_row(c.metric, _ms(c.baseline), _ms(c.current), f"{c.ratio:.2f}x", flag)
    console.print(table)
