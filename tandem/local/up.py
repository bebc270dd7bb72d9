"""`tandem up FILE...`: run ServingClusters on this machine until Ctrl-C, or benchmark them and stop."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shlex
import signal
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import uvloop
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from tandem.bench.main import build_parser as bench_parser
from tandem.bench.main import finish, options_from_args, workload_from_args
from tandem.bench.presets import PRESETS, WorkloadSpec
from tandem.bench.records import BenchRecord
from tandem.bench.runner import Target, run_target
from tandem.common.ports import free_port
from tandem.local.cluster import DEFAULT_PROFILE, LocalCluster, load_cluster, port_is_free
from tandem.local.devices import DeviceError, probe_machine
from tandem.local.gateway import gateway_groups, gateway_process
from tandem.local.plan import LocalOptions, LocalPlan
from tandem.local.supervisor import StartupError, Supervisor
from tandem.operator.api import ServingCluster
from tandem.operator.manifest import ManifestError

DEFAULT_ROUTER_PORT = 8000


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem up",
        description="Run ServingCluster manifests on this machine: engine processes (the emulator, or vLLM), "
        "the router, health checks; Ctrl-C stops everything. With --bench, benchmark each cluster in turn "
        "(an A/B run when two manifests are given) and stop.",
    )
    parser.add_argument("manifests", nargs="+", type=Path, metavar="FILE")
    parser.add_argument(
        "--engine", choices=["emulator", "vllm"], default="emulator", help="engine processes to run"
    )
    parser.add_argument(
        "--vllm-python",
        default=sys.executable,
        metavar="PYTHON",
        help="the interpreter whose vLLM runs the engines (default: this one)",
    )
    parser.add_argument(
        "--timing-profile",
        help=f"emulator timing profile (default {DEFAULT_PROFILE.name} when present)",
    )
    parser.add_argument(
        "--speedup",
        type=float,
        default=1.0,
        help="emulator clock speed-up (timing divided by this)",
    )
    parser.add_argument(
        "--port", type=int, help="router port of the first cluster (default 8000, or a free one)"
    )
    parser.add_argument(
        "--prefill", type=int, help="prefill replicas here (default: the manifest's)"
    )
    parser.add_argument("--decode", type=int, help="decode replicas here (default: the manifest's)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override a manifest field, e.g. spec.router.scoring.prefixWeight=0",
    )
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for every engine process; write it with = (--engine-arg=--no-enable-prefix-caching)",
    )
    parser.add_argument(
        "--run-dir", type=Path, help="logs and router config (default out/up/<name>-<time>)"
    )
    parser.add_argument(
        "--startup-timeout", type=float, help="seconds to wait for health (default 120, vLLM 900)"
    )
    parser.add_argument(
        "--bench",
        choices=list(PRESETS),
        metavar="PRESET",
        help=f"benchmark, report and stop ({', '.join(PRESETS)})",
    )
    parser.add_argument(
        "--bench-args",
        default="",
        help='more `tandem bench` options, written with =, e.g. --bench-args="--qps 8 --num-requests 100"',
    )
    parser.add_argument(
        "--out", type=Path, help="benchmark records and plots (default out/bench/<time>)"
    )
    return parser


def _stamp() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")


def _labels(clusters: Sequence[ServingCluster], files: Sequence[Path]) -> list[str]:
    """Cluster names, or file stems when names repeat (two variants of one cluster)."""
    names = [sc.name for sc in clusters]
    if len(set(names)) == len(names):
        return names
    stems = [f.stem for f in files]
    return stems if len(set(stems)) == len(stems) else [f"{n}-{i}" for i, n in enumerate(names)]


def describe(console: Console, label: str, plan: LocalPlan, run_dir: Path) -> None:
    table = Table(
        title=f"{label}: {len(plan.engines)} engine(s) and a router", title_justify="left"
    )
    for column in ("process", "role", "URL", "KV events"):
        table.add_column(column)
    for spec in [*plan.engines, plan.router]:
        table.add_row(spec.name, spec.role, spec.url, spec.kv_events or "")
    console.print(table)
    for note in plan.notes:
        console.print(f"[yellow]note:[/] {note}")
    model = plan.router_config.served_model_name
    console.print(f"endpoint: [bold]{plan.endpoint}[/]   logs: {run_dir / 'logs'}")
    console.print(
        f"  curl {plan.endpoint}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f'    -d \'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}\''
    )


def bench_args_of(args: argparse.Namespace) -> argparse.Namespace | None:
    """`--bench PRESET --bench-args "..."` as `tandem bench` options (None without --bench)."""
    if not args.bench:
        return None
    return bench_parser().parse_args(["--preset", args.bench, *shlex.split(args.bench_args)])


class _Up:
    """One invocation: options shared by every cluster, and the signal-driven stop."""

    def __init__(self, args: argparse.Namespace, options: LocalOptions, console: Console) -> None:
        self.args, self.options, self.console = args, options, console
        self.stamp = _stamp()

    def cluster(self, sc: ServingCluster, label: str, first: bool) -> LocalCluster:
        if first and self.args.port:
            port = self.args.port
        elif first and port_is_free(DEFAULT_ROUTER_PORT):
            port = DEFAULT_ROUTER_PORT
        else:
            port = free_port()
        options = dataclasses.replace(self.options, router_port=port)
        run_dir = self.args.run_dir or Path("out") / "up" / f"{label}-{self.stamp}"
        if self.args.run_dir and len(self.args.manifests) > 1:
            run_dir = self.args.run_dir / label
        return LocalCluster(
            sc,
            options,
            run_dir,
            self.args.startup_timeout,
            report=lambda line: self.console.print(f"{label}: {line}", highlight=False),
        )

    async def serve(self, clusters: Sequence[ServingCluster], labels: Sequence[str]) -> int:
        """Start every cluster, then wait for Ctrl-C / SIGTERM or a crashed process."""
        running: list[LocalCluster] = []
        gateways: Supervisor | None = None
        try:
            for i, (sc, label) in enumerate(zip(clusters, labels, strict=True)):
                local = self.cluster(sc, label, first=i == 0)
                running.append(local)
                self.console.print(f"starting [bold]{label}[/] ({self.options.engine}) ...")
                plan = await local.start()
                describe(self.console, label, plan, local.run_dir)
            gateways = await self.start_gateways(clusters, running)
            self.console.print(
                f"[green]ready[/] — measure it with `tandem bench {running[0].plan.endpoint if running[0].plan else ''}`; "
                "Ctrl-C stops everything"
            )
            supervisors = [c.supervisor for c in running] + ([gateways] if gateways else [])
            watchers = [asyncio.ensure_future(s.first_exit()) for s in supervisors]
            try:
                done, _ = await asyncio.wait(watchers, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for watcher in watchers:
                    watcher.cancel()
            child = next(iter(done)).result()
            self.console.print(
                f"[red]{child.spec.name} exited with status {child.process.returncode}[/]; stopping. "
                f"From {child.log_path}:\n{child.log_excerpt()}"
            )
            return 1
        finally:
            if gateways is not None:
                await gateways.stop()
            for local in reversed(running):
                await local.stop()

    async def start_gateways(
        self, clusters: Sequence[ServingCluster], running: Sequence[LocalCluster]
    ) -> Supervisor | None:
        """A `tandem gateway` per gateway name the clusters join, over their routers' configs."""
        groups = gateway_groups(clusters)
        if not groups:
            return None
        supervisor = Supervisor(running[0].run_dir / "logs")
        for name, members in groups.items():
            plans = [running[i].plan for i in members]
            spec, config = gateway_process(
                name,
                [plan for plan in plans if plan is not None],
                free_port(),
                running[members[0]].run_dir,
                self.options.python,
                os.environ,
            )
            await supervisor.wait_healthy([await supervisor.start(spec)], 60.0)
            served = ", ".join(m.served_model_name for m in config.models)
            self.console.print(f"gateway [bold]{name}[/]: {spec.url} serves {served}")
        return supervisor

    async def bench(
        self,
        clusters: Sequence[ServingCluster],
        labels: Sequence[str],
        bench_args: argparse.Namespace,
        workload: WorkloadSpec,
    ) -> list[BenchRecord]:
        """Each cluster in turn: start, run the preset against its router, stop."""
        options = options_from_args(bench_args)
        records = []
        for i, (sc, label) in enumerate(zip(clusters, labels, strict=True)):
            local = self.cluster(sc, label, first=i == 0)
            self.console.print(f"starting [bold]{label}[/] ({self.options.engine}) ...")
            async with local as plan:
                describe(self.console, label, plan, local.run_dir)
                config = {
                    "manifest": str(self.args.manifests[i]),
                    "engine": self.options.engine,
                    "timing_profile": self.options.timing_profile,
                    "speedup": self.options.speedup,
                    "sets": list(self.args.set),
                    "spec": sc.spec.model_dump(mode="json", by_alias=True, exclude_none=True),
                }
                target = Target(
                    label=label,
                    url=plan.endpoint,
                    metrics=plan.metrics_urls(),
                    config=config,
                    # CPU and memory of the engines and the router beside their metrics
                    processes={c.spec.name: c.pid for c in local.supervisor.children},
                )
                records.append(await run_target(target, workload, options, self.console))
            self.console.print(f"stopped {label}")
        return records


def local_options(args: argparse.Namespace) -> LocalOptions:
    """The command line as local-run options; for vLLM engines, what this machine has to share
    out (raises DeviceError when the named interpreter has no vLLM)."""
    profile = args.timing_profile or (str(DEFAULT_PROFILE) if DEFAULT_PROFILE.is_file() else None)
    return LocalOptions(
        engine=args.engine,
        timing_profile=profile,
        speedup=args.speedup,
        prefill_replicas=args.prefill,
        decode_replicas=args.decode,
        engine_extra_args=tuple(args.engine_arg),
        vllm_python=args.vllm_python,
        machine=probe_machine(args.vllm_python, os.environ) if args.engine == "vllm" else None,
    )


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    try:
        clusters = [load_cluster(path, args.set) for path in args.manifests]
        bench_args = bench_args_of(args)
        # Bad benchmark options are refused before anything starts.
        workload = workload_from_args(bench_args) if bench_args is not None else None
        options = local_options(args)
    except (ManifestError, ValueError, ValidationError) as exc:  # DeviceError included
        print(f"tandem up: {exc}", file=sys.stderr)
        return 2
    labels = _labels(clusters, args.manifests)
    up = _Up(args, options, console)

    async def run() -> int | list[BenchRecord]:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        stopping = False

        def on_signal() -> None:
            nonlocal stopping
            if not stopping:  # a second Ctrl-C must not interrupt the orderly stop
                stopping = True
                console.print("\nstopping ...")
                task.cancel()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        try:
            if bench_args is not None and workload is not None:
                return await up.bench(clusters, labels, bench_args, workload)
            return await up.serve(clusters, labels)
        except asyncio.CancelledError:
            return 130 if args.bench else 0
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            outcome = runner.run(run())
    except (StartupError, DeviceError) as exc:
        console.print(f"[red]tandem up: {exc}[/]", highlight=False)
        return 1
    except RuntimeError as exc:  # the benchmark's warm-up found the cluster unusable
        console.print(f"[red]tandem up: {exc}[/]", highlight=False)
        return 1
    if isinstance(outcome, int):
        if outcome == 0:
            console.print("stopped")
        return outcome
    assert bench_args is not None
    return finish(
        outcome,
        args.out or bench_args.out or Path("out") / "bench" / up.stamp,
        plots=not bench_args.no_plots,
        baseline=bench_args.compare,
        tolerance=bench_args.tolerance,
        store_dir=bench_args.store,
        console=console,
    )
