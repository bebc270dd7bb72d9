"""Cache-aware scale-down on a trace: which of 4 engines to remove, by removal cost or by default.

Two setups run side by side in one run, each a Tandem router (exact index on the engines' KV
events) in front of its own 4 emulated engines (`tandem emulate`, an H200 timing profile, started
one after the other). Both replay the same window of a trace (Mooncake conversation JSONL, by
path) in two phases:

  1. warm: trace seconds [0, --warm-seconds), 4 engines;
  2. then one engine is removed (stopped; the router sees it refuse and stops routing to it):
       cache-aware  the engine with the lowest `removal_cost` in the router's /engines
                    (tandem/router/removal_cost.py), what the operator's pod-deletion-cost ranking
                    makes the ReplicaSet controller remove;
       default      the engine the ReplicaSet controller removes without the annotation. Its
                    order (kube-controller-manager, ActivePodsWithRanks): unscheduled before
                    scheduled, Pending before Unknown before Running, not ready before ready,
                    lower pod-deletion-cost first, more pods of the set on the same node first,
                    ready for less time first (in log2 buckets, ties by uid), more restarts
                    first, newer creation first. Four Running, Ready, never restarted engines on their own
                    nodes differ only in age: the youngest goes, here the last one started, if it
                    is Ready for under half as long as the others (after --join-seconds);
                    engines started together share a log2 bucket and the uid picks any of them:
                    --default-victim costliest measures the worst such pick, the engine with
                    the highest removal cost;
  3. after: trace seconds [--warm-seconds, + --after-seconds), 3 engines, measured.

Reported per setup: every engine's removal cost at the removal and the victim's share of their
sum (the cache lost); the requests each engine served in the last window before the removal; for the after phase the engines' prefix-cache hit rate
(tandem.bench.stats.prompt_hit_rate, each prompt once), TTFT p50/p99 (emulated-H200 ms: wall ms x --speedup), TPOT
p50, failures; and the ratios cache-aware / default. The two setups see the same arrivals but
route on their own (load-aware scoring reacts to timing), so their caches already differ before the removal;
compare the lost shares as well as the hit rates.
Arrivals are the trace's time divided by --load (and follow the engines' --speedup). Bounded by
the window and by --run-seconds per phase.

    .venv/bin/python benchmarks/scaledown_trace.py \\
        --trace TRACES/mooncake_conversation_trace.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from router_bench import (
    MODEL,
    Proc,
    cache_delta,
    emulated_pool_flags,
    engine_counters,
    router_argv,
    start_engine,
)
from trace_peers import first_completion

from tandem.bench.records import BenchRecord
from tandem.bench.runner import RunOptions, Target, run_target
from tandem.bench.spec import Trace
from tandem.bench.trace_plan import TimedRequest, trace_requests
from tandem.common.ports import free_port

CHOICES = ("cache-aware", "default")
# The environment router_bench.start_engine gives an engine (its hash seed; dev mode's
# /reset_prefix_cache), for an engine started again on the same command line.
ENGINE_ENV = {"PYTHONHASHSEED": "0", "VLLM_SERVER_DEV_MODE": "1"}


@dataclass
class Setup:
    """One router and its engines, in the order they were started."""

    choice: str
    engines: list[Proc]
    router: Proc
    victim: Proc | None = None
    costs: dict[str, float] = field(default_factory=dict)

    def remaining(self) -> list[Proc]:
        return [e for e in self.engines if e is not self.victim]


def start_setup(choice: str, args: argparse.Namespace) -> Setup:
    engines = [
        start_engine(
            args.speedup,
            args.profile,
            args.blocks,
            extra_args=["--max-model-len", str(args.max_model_len)],
        )
        for _ in range(args.engines)
    ]
    port = free_port()
    flags = [*emulated_pool_flags(engines), "--trust-all-clients"]  # for x-tandem-debug
    router = Proc(
        f"router-{choice}", router_argv("tandem", port, [e.url for e in engines], flags), port
    )
    return Setup(choice, engines, router)


def window(args: argparse.Namespace, start_s: float, duration_s: float) -> Trace:
    return Trace(
        path=str(args.trace),
        speedup=args.load * args.speedup,
        start_s=start_s,
        duration_s=duration_s,
        block_tokens=args.block_tokens,
        max_input_tokens=args.max_input_tokens,
        max_output_tokens=args.max_output_tokens,
        warmup_requests=0,
        max_duration_s=args.run_seconds,
    )


async def replay(setup: Setup, workload: Trace, args: argparse.Namespace) -> BenchRecord:
    options = RunOptions(
        model=MODEL,
        progress=False,
        nvml=False,
        request_timeout_s=args.run_seconds,
        headers={"x-tandem-debug": "1"},  # the router names each request's engine
    )
    return await run_target(Target(setup.choice, setup.router.url), workload, options)


def chain_keys(block_ids: Sequence[int]) -> list[int]:
    """One key per prefix of a request's trace blocks: equal keys, equal prefixes."""
    keys, key = [], 0
    for block_id in block_ids:
        key = hash((key, block_id))
        keys.append(key)
    return keys


def held_by_engine(replays: Sequence[tuple[Trace, BenchRecord]]) -> dict[str, set[int]]:
    """engine url -> the prefixes of every request it served in `replays`, in trace blocks
    (caches large enough to evict nothing, as --blocks sets them)."""
    held: dict[str, set[int]] = {}
    for spec, record in replays:
        planned = trace_requests(spec)
        for request in record.requests:
            engine = request.tags.get("decode-engine")
            if request.ok and engine:
                held.setdefault(engine, set()).update(chain_keys(planned[request.index].block_ids))
    return held


def hit_bound(held: set[int], requests: Sequence[TimedRequest]) -> float:
    """Share of the blocks of `requests` (in send order) whose prefix is in `held` or in an
    earlier request: the hit rate of a router that always finds the prefix, with caches that
    evict nothing; the counterfactual of a removal, on one state, free of replay noise."""
    known, hits, total = set(held), 0, 0
    for request in sorted(requests, key=lambda r: r.at_s):
        hitting = True
        for key in chain_keys(request.block_ids):
            total += 1
            hitting = hitting and key in known
            hits += hitting
            known.add(key)
    return hits / total if total else 0.0


def victim_bounds(
    setup: Setup, replays: Sequence[tuple[Trace, BenchRecord]], after: Trace
) -> list[float]:
    """hit_bound of the after window for each engine removed (in start order), on this setup's
    state at the removal."""
    held = held_by_engine(replays)
    upcoming = trace_requests(after)
    return [
        hit_bound(
            set().union(*(held.get(o.url, set()) for o in setup.engines if o is not e)), upcoming
        )
        for e in setup.engines
    ]


async def engines_view(url: str) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.get(url + "/engines") as response:
        return list(await response.json())


async def router_sees(setup: Setup, engine: Proc, healthy: bool) -> None:
    for _ in range(150):  # at most 15 s: the monitor checks /health every 2 s
        view = {e["url"]: e for e in await engines_view(setup.router.url)}
        if view[engine.url]["healthy"] == healthy:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{setup.router.name}: {engine.url} not healthy={healthy} after 15 s")


async def leave(setup: Setup) -> None:
    """Stop the youngest engine before the replay: it joins at --join-seconds (a scale-up)."""
    setup.engines[-1].stop()
    await router_sees(setup, setup.engines[-1], healthy=False)


async def join(setup: Setup) -> None:
    """Start the youngest engine again, on the same ports and flags, with an empty cache."""
    gone = setup.engines[-1]
    argv = gone.proc.args
    assert isinstance(argv, list)
    engine = Proc(gone.name, argv, gone.port, ENGINE_ENV)
    engine.kv_events = gone.kv_events
    setup.engines[-1] = engine
    await engine.wait_ready("/health")
    await router_sees(setup, engine, healthy=True)


async def keep_costs_fresh(setups: Sequence[Setup]) -> None:
    """Read every router's /engines each second, as a Prometheus scrape reads its /metrics.

    A router serves the removal costs it computed when they were last read (a read of a reading
    over 5 s old starts the next computation and is answered with the old one,
    `RemovalCostCache`): without frequent reads, the costs read at the removal would be those of
    the read before, at the newcomer's join, when its cache was empty. Runs until cancelled."""
    while True:
        await asyncio.gather(*(engines_view(s.router.url) for s in setups))
        await asyncio.sleep(1.0)


async def remove_victim(setup: Setup, default_victim: str) -> None:
    """Pick the victim by the setup's rule, stop it, and wait until the router has dropped it."""
    view = {e["url"]: e for e in await engines_view(setup.router.url)}
    setup.costs = {e.url: float(view[e.url]["removal_cost"]) for e in setup.engines}
    if setup.choice == "cache-aware":
        setup.victim = min(setup.engines, key=lambda e: setup.costs[e.url])
    elif default_victim == "costliest":
        setup.victim = max(setup.engines, key=lambda e: setup.costs[e.url])
    else:
        setup.victim = setup.engines[-1]  # the youngest
    setup.victim.stop()
    await router_sees(setup, setup.victim, healthy=False)


def figures(
    record: BenchRecord, counters: tuple[float, float, list[float]], scale: float
) -> dict[str, Any]:
    hits, queries, served = counters
    summary = record.summary

    def emulated(value: float | None) -> float | None:
        return None if value is None else value * scale

    return {
        "requests": len(record.requests),
        "failed": summary.failed,
        "hit_rate": hits / queries if queries else 0.0,
        "ttft_p50": emulated(summary.ttft_ms.p50),
        "ttft_p99": emulated(summary.ttft_ms.p99),
        "tpot_p50": emulated(summary.tpot_ms.p50),
        "served": served,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    setups: list[Setup] = []
    try:
        for choice in CHOICES:
            setups.append(start_setup(choice, args))
        for setup in setups:
            await asyncio.gather(*(e.wait_ready("/health") for e in setup.engines))
            await first_completion(setup.router.url, [setup.router], 90.0)
        after = window(args, args.warm_seconds, args.after_seconds)
        reader = asyncio.create_task(keep_costs_fresh(setups))
        if args.join_seconds:
            for setup in setups:
                await leave(setup)
            early = window(args, 0.0, args.join_seconds)
            joined = window(args, args.join_seconds, args.warm_seconds - args.join_seconds)
            first = await asyncio.gather(*(replay(s, early, args) for s in setups))
            await asyncio.gather(*(join(s) for s in setups))
            second = await asyncio.gather(*(replay(s, joined, args) for s in setups))
            replays = [[(early, a), (joined, b)] for a, b in zip(first, second, strict=True)]
        else:
            warm = window(args, 0.0, args.warm_seconds)
            done = await asyncio.gather(*(replay(s, warm, args) for s in setups))
            replays = [[(warm, record)] for record in done]
        warmed = [[r for _, record in pairs for r in record.requests] for pairs in replays]
        reader.cancel()  # each router's reading is now at most ~6 s old
        await asyncio.gather(*(remove_victim(s, args.default_victim) for s in setups))
        before = await asyncio.gather(*(engine_counters(s.remaining()) for s in setups))
        records = await asyncio.gather(*(replay(s, after, args) for s in setups))
        finished = await asyncio.gather(*(engine_counters(s.remaining()) for s in setups))
        result: dict[str, Any] = {}
        rows = zip(setups, replays, warmed, records, before, finished, strict=True)
        for setup, pairs, w, record, b, a in rows:
            assert setup.victim is not None
            order = [e.url for e in setup.engines]
            result[setup.choice] = figures(record, cache_delta(b, a), args.speedup) | {
                "bounds": victim_bounds(setup, pairs, after),
                "warm_requests": len(w),
                "warm_failed": sum(1 for r in w if not r.ok),
                "costs": [round(setup.costs[u], 1) for u in order],  # in start order
                "served_before": served_by(pairs[-1][1], order),
                "victim": order.index(setup.victim.url),
            }
        return result
    finally:
        for setup in setups:
            setup.router.stop()
            for engine in setup.engines:
                engine.stop()


def served_by(record: BenchRecord, order: Sequence[str]) -> list[int]:
    """Requests each engine (in start order) served in `record`: for the last window before the
    removal, whether the youngest took a share (after --join-seconds, a newcomer's)."""
    engines = [request.tags.get("decode-engine") for request in record.requests if request.ok]
    return [engines.count(url) for url in order]


def ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b else float("nan")


def report(result: dict[str, Any], args: argparse.Namespace, load_text: str) -> None:
    print(
        f"\n{args.trace.name}: warm [0, {args.warm_seconds:g}) s, then one of {args.engines} engines"
        f" removed, measured [{args.warm_seconds:g}, {args.warm_seconds + args.after_seconds:g}) s;"
        f" arrivals x{args.load:g}, {args.blocks} KV blocks per engine, blocks of"
        f" {args.block_tokens} tokens, outputs <= {args.max_output_tokens} ({args.profile},"
        f" speedup {args.speedup:g}); default victim: the {args.default_victim};"
        " latencies in emulated ms"
    )
    print(
        f"    {'victim':<12} {'removed':>7} {'costs at removal (start order)':<34} {'lost':>5}"
        f" {'hit rate':>8}"
        f" {'TTFT p50':>8} {'p99':>6} {'TPOT p50':>8} {'failed':>6} {'req':>5}"
    )
    for choice, row in result.items():
        costs = " ".join(f"{c:.0f}" for c in row["costs"])
        lost = row["costs"][row["victim"]] / sum(row["costs"]) if sum(row["costs"]) else 0.0
        print(
            f"    {choice:<12} {'#' + str(row['victim']):>7} {costs:<34} {lost:5.0%}"
            f" {row['hit_rate']:8.1%}"
            f" {row['ttft_p50'] or 0:8.0f} {row['ttft_p99'] or 0:6.0f} {row['tpot_p50'] or 0:8.1f}"
            f" {row['failed'] + row['warm_failed']:6d} {row['requests']:5d}"
        )
    print(
        "    requests each engine served in the last window before the removal (start order): "
        + "; ".join(
            f"{choice} {' '.join(str(n) for n in row['served_before'])}"
            for choice, row in result.items()
        )
    )
    print(
        "    hit-rate bound of the after window for each engine removed, on each setup's own"
        " state (start order):"
    )
    for choice, row in result.items():
        bounds = " ".join(f"{b:.1%}" for b in row["bounds"])
        cheapest = min(range(len(row["costs"])), key=lambda i: row["costs"][i])
        print(
            f"    {choice:<12} {bounds}; cheapest #{cheapest} {row['bounds'][cheapest]:.1%},"
            f" youngest #{len(row['bounds']) - 1} {row['bounds'][-1]:.1%},"
            f" best {max(row['bounds']):.1%}, worst {min(row['bounds']):.1%}"
        )
    aware, default = result["cache-aware"], result["default"]
    print(
        f"    cache-aware / default: hit rate {ratio(aware['hit_rate'], default['hit_rate']):.2f}x,"
        f" TTFT p50 {ratio(aware['ttft_p50'], default['ttft_p50']):.2f}x,"
        f" TTFT p99 {ratio(aware['ttft_p99'], default['ttft_p99']):.2f}x"
    )
    print(f"\nload average {load_text}")


async def main_async(args: argparse.Namespace) -> int:
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    load_before = os.getloadavg()
    result = await run(args)
    load_after = os.getloadavg()
    load_text = (
        " ".join(f"{a:.2f}" for a in load_before)
        + " -> "
        + " ".join(f"{a:.2f}" for a in load_after)
    )
    report(result, args, load_text)
    if args.json:
        record = {"method": "scaledown-trace", "args": {k: str(v) for k, v in vars(args).items()},
                  "result": result, "load_average": load_text}  # fmt: skip
        await asyncio.to_thread(Path(args.json).write_text, json.dumps(record, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", type=Path, required=True, help="the trace file (read in place)")
    parser.add_argument("--warm-seconds", type=float, default=120.0, help="trace s before removal")
    parser.add_argument("--after-seconds", type=float, default=120.0, help="trace s measured")
    parser.add_argument(
        "--join-seconds",
        type=float,
        help="the youngest engine is down until this trace second (a scale-up before the"
        " scale-down); default: all engines serve from the start",
    )
    parser.add_argument(
        "--default-victim",
        choices=("youngest", "costliest"),
        default="youngest",
        help="the default setup's victim: the youngest engine, or the costliest (a uid pick"
        " among engines of one age bucket)",
    )
    parser.add_argument("--load", type=float, default=2.0, help="arrivals: trace time / X")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=3000, help="KV blocks (16 tokens) per engine")
    parser.add_argument("--block-tokens", type=int, default=128, help="tokens per 512-token block")
    parser.add_argument("--max-input-tokens", type=int, default=8000)
    parser.add_argument("--max-output-tokens", type=int, default=32)
    parser.add_argument("--profile", default="h200-llama-3.1-8b")
    parser.add_argument("--speedup", type=float, default=0.5, help="the engines' time divisor")
    parser.add_argument("--max-model-len", type=int, default=16384)
    parser.add_argument("--run-seconds", type=float, default=300.0, help="bound of one phase")
    parser.add_argument("--json", help="also write the result to this file")
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
