"""Runs a workload against one endpoint: warm-up, timed Poisson dispatch, metrics sampling, record."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tandem.bench.client import Api, RequestResult, discover_model, request_body, send
from tandem.bench.presets import WorkloadSpec
from tandem.bench.records import (
    BenchRecord,
    EngineTotals,
    RequestRecord,
    SampleRecord,
    versions,
)
from tandem.bench.resources import LocalProbe, summarize_resources
from tandem.bench.sampler import Sampler
from tandem.bench.spec import SLO, Burst, Trace
from tandem.bench.stats import burst_recovery, engine_totals, group_by, queue_share, summarize
from tandem.bench.trace_plan import trace_requests
from tandem.bench.trace_prompts import build_trace_schedule
from tandem.bench.trace_report import slo_goodput, trace_report
from tandem.bench.workloads import PlannedRequest, Schedule, build_schedule

WARMUP_CONCURRENCY = 4
COUNTER_SUFFIXES = ("_total", "_sum", "_count", "_created", "_info")


@dataclass
class Target:
    """An endpoint to measure: its base URL and the /metrics URLs to sample while it runs."""

    label: str
    url: str
    metrics: dict[str, str] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    processes: dict[str, int] = field(default_factory=dict)  # local engine/router pids to watch

    @property
    def completions_url(self) -> str:
        return self.url.rstrip("/") + "/v1/completions"

    @property
    def chat_url(self) -> str:
        return self.url.rstrip("/") + "/v1/chat/completions"


@dataclass
class RunOptions:
    api: Api = "completions"
    model: str | None = None
    ignore_eos: bool = True
    # every request asks for this max_tokens and ends at its planned length by a stop token
    length_cap: int | None = None
    slo: SLO = field(default_factory=SLO)
    extra_slos: list[SLO] = field(default_factory=list)  # more SLOs to report attainment for
    request_timeout_s: float = 300.0
    sample_interval_s: float = 0.5
    headers: dict[str, str] = field(default_factory=dict)
    progress: bool = True
    prometheus_url: str | None = None  # a Prometheus holding dcgm-exporter's GPU gauges
    nvml: bool = True  # read this machine's GPUs through NVML when nvidia-ml-py is installed


def _record(result: RequestResult) -> RequestRecord:
    def ms(value: float | None) -> float | None:
        return None if value is None else round(value * 1000, 3)

    return RequestRecord(
        index=result.index,
        klass=result.klass,
        phase=result.phase,
        start_s=round(result.start_s, 6),
        ok=result.ok,
        status=result.status,
        error=result.error,
        ttft_ms=ms(result.ttft_s),
        e2e_ms=ms(result.e2e_s),
        tpot_ms=ms(result.tpot_s),
        itl_ms=[round(gap * 1000, 3) for gap in result.itl_s],
        output_tokens=result.output_tokens,
        prompt_tokens=result.prompt_tokens,
        cached_tokens=result.cached_tokens,
        breakdown_ms=result.breakdown_ms,
        tags=result.tags,
        lag_ms=round(result.lag_s * 1000, 3),
    )


class _Run:
    """The state of one measured run: the session, the URL and the per-request bookkeeping."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        target: Target,
        options: RunOptions,
        model: str,
        task_acceptance: dict[str, float],
    ) -> None:
        self.session, self.options, self.model = session, options, model
        self.task_acceptance = task_acceptance
        self.url = target.completions_url if options.api == "completions" else target.chat_url
        self.headers = dict(options.headers)

    async def one(
        self, planned: PlannedRequest, t0: float, gate: asyncio.Semaphore | None
    ) -> RequestResult:
        if gate is not None:
            await gate.acquire()
        try:
            now = time.perf_counter()
            result = RequestResult(
                planned.index,
                planned.klass,
                planned.phase,
                now - t0,
                lag_s=max(0.0, now - t0 - planned.at_s),
            )
            options = self.options
            body = request_body(
                planned, options.api, self.model, options.ignore_eos, options.length_cap
            )
            rate = self.task_acceptance.get(planned.klass, self.task_acceptance.get("*"))
            if rate is not None:
                body["vllm_xargs"] = {"spec_acceptance_rate": rate}
            headers = self.headers | {"X-Request-Id": f"bench-{uuid.uuid4().hex[:16]}"}
            return await send(
                self.session, self.url, body, result, self.options.request_timeout_s, headers
            )
        finally:
            if gate is not None:
                gate.release()


async def _warm_up(run: _Run, warmup: Sequence[PlannedRequest]) -> list[RequestResult]:
    gate = asyncio.Semaphore(WARMUP_CONCURRENCY)
    t0 = time.perf_counter()
    return list(await asyncio.gather(*(run.one(p, t0, gate) for p in warmup)))


async def _dispatch(
    run: _Run,
    planned: Sequence[PlannedRequest],
    t0: float,
    max_concurrency: int | None,
    on_done: Any,
    tasks: list[asyncio.Task[RequestResult]],
) -> None:
    """Start each request at t0 + at_s (open loop) into `tasks`; a semaphore caps concurrency."""
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    for request in planned:
        delay = t0 + request.at_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(run.one(request, t0, gate))
        task.add_done_callback(on_done)
        tasks.append(task)


def gauges(values: dict[str, float]) -> dict[str, float]:
    """The time-series part of a scrape: gauges only; counters matter as deltas over the run."""
    return {
        k: v for k, v in values.items() if not k.endswith(COUNTER_SUFFIXES) and "_bucket" not in k
    }


def phase_ends(workload: WorkloadSpec) -> list[tuple[str, float, float]]:
    """(name, qps, end time) of each phase of a burst workload; empty for the others."""
    if not isinstance(workload, Burst):
        return []
    ends, clock = [], 0.0
    for number, phase in enumerate(workload.phases):
        clock += phase.duration_s
        ends.append((phase.name or f"phase-{number}", phase.qps, clock))
    return ends


@dataclass
class Replay:
    """What one run measured: each measured request, the /metrics samples and the engines'
    counter totals over the measured window."""

    model: str
    requests: list[RequestRecord]
    samples: list[SampleRecord]
    engine: EngineTotals
    created: datetime
    finished: datetime


async def replay(
    target: Target,
    schedule: Schedule,
    options: RunOptions,
    *,
    max_concurrency: int | None = None,
    max_duration_s: float = 600.0,
    task_acceptance: dict[str, float] | None = None,
    title: str = "run",
    console: Console | None = None,
) -> Replay:
    """Warm up, then send the measured schedule open loop (each request at t0 + at_s) while
    sampling /metrics; requests still running `max_duration_s` after the last send are
    cancelled."""
    console = console or Console(stderr=True)
    created = datetime.now(UTC)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, read_bufsize=1 << 18) as session:
        model = options.model or await discover_model(session, target.url)
        run = _Run(session, target, options, model, task_acceptance or {})
        if schedule.warmup:
            warm = await _warm_up(run, schedule.warmup)
            if not any(r.ok for r in warm):
                errors = "; ".join(sorted({f"{r.status} {r.error}" for r in warm}))[:500]
                raise RuntimeError(f"every warm-up request to {run.url} failed: {errors}")
        probe = LocalProbe(target.processes, options.nvml)
        sampler = Sampler(
            dict(target.metrics),
            options.sample_interval_s,
            prometheus=options.prometheus_url,
            probe=probe if probe.active else None,
        )
        t0 = time.perf_counter()
        await sampler.start(session, t0)
        t0 = sampler.t0
        progress = Progress(
            TextColumn(f"[bold]{target.label}[/] {title}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[failed]} failed"),
            TimeElapsedColumn(),
            console=console,
            disable=not options.progress,
            transient=False,
        )
        with progress:
            bar = progress.add_task("run", total=len(schedule.measured), failed=0)
            failures = 0

            def on_done(task: asyncio.Task[RequestResult]) -> None:
                nonlocal failures
                if task.cancelled() or task.exception() is not None or not task.result().ok:
                    failures += 1
                progress.update(bar, advance=1, failed=failures)

            last_at = schedule.measured[-1].at_s if schedule.measured else 0.0
            deadline = last_at + max_duration_s
            tasks: list[asyncio.Task[RequestResult]] = []
            dispatch = _dispatch(run, schedule.measured, t0, max_concurrency, on_done, tasks)
            try:
                await asyncio.wait_for(dispatch, deadline)
                remaining = deadline - (time.perf_counter() - t0)
                if tasks:
                    await asyncio.wait(tasks, timeout=max(0.0, remaining))
            except TimeoutError:
                pass
            pending = [task for task in tasks if not task.done()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        await sampler.stop(session)
    results = [_result_of(task, schedule.measured[i], t0) for i, task in enumerate(tasks)]
    requests = [_record(r) for r in results]
    samples = [
        SampleRecord(t_s=round(s.t_s, 4), source=s.source, values=s.values) for s in sampler.samples
    ]
    ok = sum(r.ok for r in requests)
    engine = engine_totals(sampler.first, sampler.last, samples, ok)
    return Replay(model, requests, samples, engine, created, datetime.now(UTC))


async def run_target(
    target: Target,
    workload: WorkloadSpec,
    options: RunOptions,
    console: Console | None = None,
) -> BenchRecord:
    """Build the workload's schedule (a trace's, read from its file), replay it and return the
    run's record."""
    timed = trace_requests(workload) if isinstance(workload, Trace) else None
    if isinstance(workload, Trace):
        assert timed is not None
        schedule = build_trace_schedule(workload, timed)
    else:
        schedule = build_schedule(workload)
    run = await replay(
        target,
        schedule,
        options,
        max_concurrency=workload.max_concurrency,
        max_duration_s=workload.max_duration_s,
        task_acceptance=workload.task_acceptance,
        title=workload.kind,
        console=console,
    )
    requests = run.requests
    summary = summarize(requests, options.slo)
    trace = None
    if isinstance(workload, Trace) and timed is not None:
        trace = trace_report(workload, workload.format or "", timed, requests, run.engine)
    return BenchRecord(
        run_id=f"{run.created:%Y%m%dT%H%M%SZ}-{target.label}-{uuid.uuid4().hex[:6]}",
        label=target.label,
        created_at=run.created,
        finished_at=run.finished,
        endpoint=target.url,
        model=run.model,
        api=options.api,
        workload=workload,
        seed=workload.seed,
        slo=options.slo,
        config=target.config | {"metrics_sources": sorted(target.metrics)},
        versions=versions(),
        summary=summary,
        engine=run.engine,
        queue_share=queue_share(summary, run.engine),
        burst_recovery_s=burst_recovery(requests, phase_ends(workload)),
        by_class=group_by(requests, "klass", options.slo)
        if workload.kind in {"mixed", "shared-prefix"}
        else {},
        by_phase=group_by(requests, "phase", options.slo)
        if workload.kind == "burst" or (isinstance(workload, Trace) and workload.loops > 1)
        else {},
        requests=requests,
        samples=run.samples,
        resources=summarize_resources(run.samples),
        slo_goodput=slo_goodput(requests, [options.slo, *options.extra_slos], summary.duration_s),
        trace=trace,
    )


def _result_of(
    task: asyncio.Task[RequestResult], planned: PlannedRequest, t0: float
) -> RequestResult:
    if task.done() and not task.cancelled() and task.exception() is None:
        return task.result()
    error = "cancelled at the run's time bound" if task.cancelled() else repr(task.exception())
    return RequestResult(planned.index, planned.klass, planned.phase, planned.at_s, error=error)
