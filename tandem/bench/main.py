"""`tandem bench`: measure one or more OpenAI-compatible endpoints and report, plot, store, compare."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import uvloop
import yaml
from pydantic import TypeAdapter, ValidationError
from rich.console import Console

from tandem.bench.baseline import compare, find_baseline, store
from tandem.bench.plots import write_all
from tandem.bench.presets import PRESETS, WorkloadSpec, preset
from tandem.bench.records import BenchRecord
from tandem.bench.report import print_ab, print_changes, print_record
from tandem.bench.runner import RunOptions, Target, run_target
from tandem.bench.spec import SLO, LengthDist, Phase, Trace, Workload
from tandem.bench.traces import TRACE_BLOCK_TOKENS, TRACE_FORMATS, file_format

DEFAULT_ENDPOINT = "http://127.0.0.1:8000"

# CLI flag (dest) -> workload field it sets.
OVERRIDES = {
    "qps": "qps",
    "num_requests": "num_requests",
    "seed": "seed",
    "warmup": "warmup_requests",
    "max_concurrency": "max_concurrency",
    "input": "input",
    "output": "output",
    "share_ratio": "share_ratio",
    "groups": "groups",
    "long_fraction": "long_fraction",
    "short_input": "short_input",
    "long_input": "long_input",
    "long_output": "long_output",
    "phases": "phases",
    "max_duration": "max_duration_s",
}


def parse_phases(text: str) -> list[Phase]:
    """`QPSxSECONDS,...`, e.g. `2x15,20x10,2x20` (low → high → low)."""
    phases = []
    for number, part in enumerate(text.split(",")):
        qps, _, seconds = part.strip().partition("x")
        phases.append(Phase(qps=float(qps), duration_s=float(seconds), name=f"phase-{number}"))
    return phases


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem bench",
        description="Measure OpenAI-compatible endpoints under production-like load (warm-up excluded). "
        "Give two endpoints for an A/B run of the same workload, one after the other.",
    )
    parser.add_argument(
        "endpoints",
        nargs="*",
        metavar="URL",
        help=f"base URL of each endpoint (default {DEFAULT_ENDPOINT})",
    )
    parser.add_argument(
        "--label",
        action="append",
        default=[],
        help="name of each endpoint, in order (default A, B, ...)",
    )
    parser.add_argument(
        "--preset", default="quick", choices=list(PRESETS), help="the workload to start from"
    )
    parser.add_argument(
        "--workload-file", type=Path, help="a workload spec (YAML or JSON) instead of a preset"
    )
    parser.add_argument("--list-presets", action="store_true", help="print the presets and exit")
    shape = parser.add_argument_group("workload overrides")
    shape.add_argument("--qps", type=float)
    shape.add_argument("--num-requests", type=int)
    shape.add_argument("--seed", type=int)
    shape.add_argument("--warmup", type=int, help="warm-up requests, excluded from the statistics")
    shape.add_argument("--max-concurrency", type=int)
    shape.add_argument(
        "--input",
        type=LengthDist.parse,
        help="prompt tokens: N, uniform:A-B, lognormal:MEDIAN[,SIGMA][,A-B]",
    )
    shape.add_argument(
        "--output", type=LengthDist.parse, help="output tokens, same syntax as --input"
    )
    shape.add_argument(
        "--share-ratio",
        type=float,
        help="shared-prefix: fraction of each prompt that is the group's prefix",
    )
    shape.add_argument("--groups", type=int, help="shared-prefix: number of distinct prefixes")
    shape.add_argument("--long-fraction", type=float, help="mixed: fraction of long requests")
    shape.add_argument("--short-input", type=LengthDist.parse)
    shape.add_argument("--long-input", type=LengthDist.parse)
    shape.add_argument("--long-output", type=LengthDist.parse)
    shape.add_argument(
        "--phases", type=parse_phases, help="burst: QPSxSECONDS,... e.g. 2x15,20x10,2x20"
    )
    shape.add_argument("--max-duration", type=float, help="bound on the measured phase in seconds")
    shape.add_argument(
        "--task-acceptance",
        action="append",
        metavar="CLASS=RATE",
        help="speculative decoding: the draft acceptance rate of a request class's task "
        "(short, long, group-N, default; * for all), sent as vllm_xargs.spec_acceptance_rate",
    )
    trace = parser.add_argument_group(
        "trace replay",
        "replay a trace file open loop at its own timestamps (formats: mooncake, azure, "
        "burstgpt, tandem; docs/bench.md)",
    )
    trace.add_argument("--trace", type=Path, metavar="FILE", help="the trace to replay")
    trace.add_argument("--trace-format", choices=TRACE_FORMATS, help="default: detected")
    trace.add_argument(
        "--trace-speedup", type=float, default=1.0, help="divide the file's send times by this"
    )
    trace.add_argument(
        "--trace-start", type=float, default=0.0, metavar="S", help="window start, file seconds"
    )
    trace.add_argument(
        "--trace-duration", type=float, metavar="S", help="window length, file seconds"
    )
    trace.add_argument("--trace-max-requests", type=int, metavar="N", help="window: first N rows")
    trace.add_argument("--trace-loops", type=int, default=1, help="send the window this many times")
    trace.add_argument(
        "--trace-block-tokens",
        type=int,
        default=TRACE_BLOCK_TOKENS,
        metavar="B",
        help="tokens each 512-token block becomes (prompts scale by B/512)",
    )
    trace.add_argument("--trace-max-input", type=int, metavar="N", help="cut prompts to N tokens")
    trace.add_argument("--trace-max-output", type=int, metavar="N", help="cap outputs at N tokens")
    trace.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="the served model's tokenizer.json (or its directory): exact token blocks",
    )
    trace.add_argument(
        "--trace-prompt",
        choices=["ids", "text"],
        help="token-id or text prompts (default: ids with --tokenizer and completions, else text)",
    )
    trace.add_argument(
        "--trace-bucket", type=float, default=10.0, metavar="S", help="report bucket width"
    )
    client = parser.add_argument_group("client")
    client.add_argument("--api", choices=["completions", "chat"], default="completions")
    client.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    client.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send vLLM's ignore_eos (for strict OpenAI servers)",
    )
    client.add_argument(
        "--length-cap",
        type=int,
        metavar="N",
        help="send max_tokens N on every request and end each at its planned length with a "
        "stop token (min_tokens, stop_token_ids, logit_bias), so that a router cannot read the "
        "length from the request; N should be at least the longest planned output",
    )
    client.add_argument("--header", action="append", default=[], metavar="NAME:VALUE")
    client.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    client.add_argument("--request-timeout", type=float, default=300.0)
    client.add_argument(
        "--metrics",
        action="append",
        default=[],
        metavar="[LABEL:]NAME=URL",
        help="a /metrics URL to sample during the run (default: each endpoint's own /metrics); "
        "prefix with an endpoint's label to tie it to that endpoint only",
    )
    client.add_argument("--sample-interval", type=float, default=0.5)
    resources = parser.add_argument_group("resources")
    resources.add_argument(
        "--prometheus",
        metavar="URL",
        help="a Prometheus that scrapes dcgm-exporter: sample its GPU utilisation and memory",
    )
    resources.add_argument(
        "--pid",
        action="append",
        default=[],
        metavar="NAME=PID",
        help="a local process (engine, router) whose CPU and resident memory to sample",
    )
    resources.add_argument(
        "--no-nvml", action="store_true", help="do not read this machine's GPUs through NVML"
    )
    client.add_argument(
        "--slo-ttft-ms",
        type=float,
        action="append",
        help=f"TTFT target of an SLO; repeat with --slo-tpot-ms for several (default {SLO().ttft_ms:g})",
    )
    client.add_argument(
        "--slo-tpot-ms",
        "--slo-itl-ms",
        dest="slo_tpot_ms",
        type=float,
        action="append",
        help=f"time-per-output-token target of an SLO, paired in order (default {SLO().itl_ms:g})",
    )
    output = parser.add_argument_group("output")
    output.add_argument(
        "--out", type=Path, help="directory for records and plots (default out/bench/<time>)"
    )
    output.add_argument("--no-plots", action="store_true")
    output.add_argument("--quiet", action="store_true", help="no progress bars")
    output.add_argument(
        "--compare",
        type=Path,
        metavar="BASELINE",
        help="a record, or a store to search for the same workload",
    )
    output.add_argument(
        "--tolerance", type=float, default=0.10, help="relative loss flagged as a regression"
    )
    output.add_argument(
        "--store", type=Path, metavar="DIR", help="also copy the records into this baseline store"
    )
    return parser


def trace_from_args(args: argparse.Namespace) -> Trace:
    """The trace replay the --trace options describe; the file's format is resolved here."""
    path: Path = args.trace
    prompt = args.trace_prompt or (
        "ids" if args.tokenizer and args.api == "completions" else "text"
    )
    return Trace(
        path=str(path),
        format=args.trace_format or file_format(path),
        speedup=args.trace_speedup,
        start_s=args.trace_start,
        duration_s=args.trace_duration,
        max_requests=args.trace_max_requests,
        loops=args.trace_loops,
        block_tokens=args.trace_block_tokens,
        max_input_tokens=args.trace_max_input,
        max_output_tokens=args.trace_max_output,
        tokenizer=args.tokenizer,
        prompt=prompt,
        bucket_s=args.trace_bucket,
    )


def slos_from_args(args: argparse.Namespace) -> list[SLO]:
    """The SLO pairs in order; a single value on one side goes with every value of the other."""
    ttft = args.slo_ttft_ms or [SLO().ttft_ms]
    tpot = args.slo_tpot_ms or [SLO().itl_ms]
    if len(ttft) != len(tpot) and 1 not in (len(ttft), len(tpot)):
        raise ValueError("give as many --slo-ttft-ms as --slo-tpot-ms, or one of either")
    count = max(len(ttft), len(tpot))
    ttft, tpot = ttft * (count if len(ttft) == 1 else 1), tpot * (count if len(tpot) == 1 else 1)
    return [SLO(ttft_ms=t, itl_ms=i) for t, i in zip(ttft, tpot, strict=True)]


def workload_from_args(args: argparse.Namespace) -> WorkloadSpec:
    """The trace, preset or workload file, with every given override applied and validated."""
    if args.trace:
        if args.api == "chat" and args.trace_prompt == "ids":
            raise ValueError("chat requests need text prompts: drop --trace-prompt ids")
        base: WorkloadSpec = trace_from_args(args)
    elif args.workload_file:
        raw = yaml.safe_load(args.workload_file.read_text())
        base = TypeAdapter(Workload).validate_python(raw)
    else:
        base = preset(args.preset)
    fields = base.model_dump()
    for dest, field in OVERRIDES.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if field not in type(base).model_fields:
            raise ValueError(f"--{dest.replace('_', '-')} does not apply to a {base.kind} workload")
        fields[field] = value
    if args.task_acceptance:
        rates = (item.partition("=") for item in args.task_acceptance)
        fields["task_acceptance"] = {klass: float(rate) for klass, _, rate in rates}
    validated: WorkloadSpec = TypeAdapter(Workload).validate_python(fields)
    return validated


def targets_from_args(args: argparse.Namespace) -> list[Target]:
    urls = [u.rstrip("/") for u in args.endpoints] or [DEFAULT_ENDPOINT]
    labels = list(args.label) + [chr(ord("A") + i) for i in range(len(args.label), len(urls))]
    if len(set(labels[: len(urls)])) != len(urls):
        raise ValueError("endpoint labels must be distinct")
    targets = [Target(label=labels[i], url=url) for i, url in enumerate(urls)]
    for spec in args.metrics:
        owner: Target | None = None
        head, sep, rest = spec.partition(":")
        if sep and any(t.label == head for t in targets) and not rest.startswith("//"):
            owner, spec = next(t for t in targets if t.label == head), rest
        name, eq, url = spec.partition("=")
        if not eq:
            name, url = spec, spec
        for target in [owner] if owner else targets:
            target.metrics[name] = url
    for target in targets:
        if not target.metrics:
            target.metrics["endpoint"] = f"{target.url}/metrics"
        for spec in args.pid:
            name, _, pid = spec.partition("=")
            target.processes[name] = int(pid)
    return targets


def options_from_args(args: argparse.Namespace) -> RunOptions:
    headers = dict(h.split(":", 1) for h in args.header)
    headers = {k.strip(): v.strip() for k, v in headers.items()}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    slo, *extra_slos = slos_from_args(args)
    if args.length_cap is not None and args.length_cap < 1:
        raise ValueError(f"--length-cap must be at least 1, not {args.length_cap}")
    return RunOptions(
        api=args.api,
        model=args.model,
        ignore_eos=not args.no_ignore_eos,
        length_cap=args.length_cap,
        slo=slo,
        extra_slos=extra_slos,
        request_timeout_s=args.request_timeout,
        sample_interval_s=args.sample_interval,
        headers=headers,
        progress=not args.quiet,
        prometheus_url=args.prometheus,
        nvml=not args.no_nvml,
    )


def default_out_dir() -> Path:
    return Path("out") / "bench" / datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")


async def run_all(
    targets: Sequence[Target], workload: WorkloadSpec, options: RunOptions, console: Console
) -> list[BenchRecord]:
    """Each target in turn with the same workload and seed (side by side on the same machine)."""
    return [await run_target(target, workload, options, console) for target in targets]


def finish(
    records: Sequence[BenchRecord],
    out_dir: Path,
    *,
    plots: bool = True,
    baseline: Path | None = None,
    tolerance: float = 0.10,
    store_dir: Path | None = None,
    console: Console | None = None,
) -> int:
    """Print the report, write records and plots, compare with a baseline; 0, or 1 when a
    regression was flagged, or 3 when no request succeeded."""
    console = console or Console()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [record.save(out_dir / f"{record.label}.json") for record in records]
    for record in records:
        print_record(console, record)
    if len(records) > 1:
        print_ab(console, records)
    status = 0
    if baseline is not None:
        for record in records:
            reference = find_baseline(baseline, record)
            changes = compare(record.summary, reference.summary, tolerance)
            print_changes(console, changes, reference, tolerance)
            if any(c.regression for c in changes):
                status = 1
    if store_dir is not None:
        for path in paths:
            store(path, store_dir)
    written = write_all(records, out_dir) if plots else []
    console.print(f"records: {', '.join(str(p) for p in paths)}")
    if written:
        console.print(f"plots: {', '.join(str(p) for p in written)}")
    if status:
        console.print("[red bold]regressions flagged against the baseline[/]")
    if all(r.summary.ok == 0 for r in records):
        return 3
    return status


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list_presets:
        for name, (description, _) in PRESETS.items():
            print(f"{name:14} {description}")
        return 0
    try:
        workload = workload_from_args(args)
        targets = targets_from_args(args)
        options = options_from_args(args)
    except (ValueError, ValidationError, OSError) as exc:
        print(f"tandem bench: {exc}", file=sys.stderr)
        return 2
    console = Console()
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            records = runner.run(run_all(targets, workload, options, console))
        return finish(
            records,
            args.out or default_out_dir(),
            plots=not args.no_plots,
            baseline=args.compare,
            tolerance=args.tolerance,
            store_dir=args.store,
            console=console,
        )
    except ValueError as exc:  # a trace line, or a tokenizer, that cannot be replayed
        print(f"tandem bench: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError, aiohttp.ClientError) as exc:
        print(f"tandem bench: {exc}", file=sys.stderr)
        return 3
