"""Several Tandem router replicas behind HAProxy (round robin per request) on one emulated pool.

Every replica is an independent `tandem router` process over the same engines (KV events on, or
`--no-kv-events`: each replica's approximate index from its own routing history). Prints, for 1,
2 and 4 replicas, the means of `--rounds` runs (other prompts and sessions each round, replica
counts in rotated order, so slow phases of a shared machine fall on every count):
  (i)  a shared-prefix workload (groups of long shared prefixes, streaming, concurrency 16) and
  (ii) a session workload (multi-turn conversations with x-session-id, each turn's prompt extends
       the previous one, several sessions at once):
       the engines' own prefix-cache hit rate (tandem.bench.stats.prompt_hit_rate, caches reset
       before every run), stickiness (sessions, or prefixes, whose requests all landed on one
       engine, from x-tandem-decode-engine) and distinct engines per session or prefix (how far
       replicas agree on placement, whatever the machine's timing does to the hit rate),
       max/mean requests per engine, TTFT p50/p99, errors, and the ratios
       against one replica;
  (iii) failover: 4 replicas under load, one SIGKILLed mid-run: requests that failed against the
       requests the killed replica had in flight (its own gauge, read just before the kill),
       failures after the kill, and how long a failed client waited past the kill.
Every load loop is bounded in request count and in time; every client has a timeout.

    .venv/bin/python benchmarks/router_replicas.py [--quick] [--no-kv-events] [--replicas 1,2,4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from router_bench import (
    MODEL,
    WORDS,
    Proc,
    cache_delta,
    emulated_pool_flags,
    engine_counters,
    pct,
    reset_caches,
    router_argv,
    shared_prefix_bodies,
    start_engine,
)

from tandem.common.ports import free_port
from tandem.router.rendezvous import hrw_order

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the HAProxy helper the replica tests use
from haproxy_process import HAProxy  # noqa: E402

DEBUG = {"x-tandem-debug": "1", "content-type": "application/json"}
NAN = float("nan")
GROUPS, PER_GROUP, SESSIONS, AT_ONCE, TURNS = 24, 8, 48, 24, 4


def start_replica(engines: list[Proc], kv_events: bool, extra: list[str]) -> Proc:
    port = free_port()
    flags = [*emulated_pool_flags(engines, kv_events), "--trust-all-clients", *extra]
    return Proc("replica", router_argv("tandem", port, [e.url for e in engines], flags), port)


# -- load --------------------------------------------------------------------------------------


@dataclass
class Outcome:
    start: float
    end: float
    ok: bool
    ttft: float | None = None
    engine: str = ""


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)
    sessions: dict[str, list[Outcome]] = field(default_factory=lambda: defaultdict(list))

    @property
    def good(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.ok]


async def stream(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]
) -> Outcome:
    """One streaming completion; ok only with status 200 and the closing `data: [DONE]`."""
    start = time.monotonic()
    ttft = None
    try:
        async with session.post(url + "/v1/completions", data=body, headers=headers) as response:
            done = False
            async for line in response.content:
                if ttft is None and line.startswith(b"data: {"):
                    ttft = time.monotonic() - start
                done = done or line.startswith(b"data: [DONE]")
            engine = response.headers.get("x-tandem-decode-engine", "")
            return Outcome(start, time.monotonic(), response.status == 200 and done, ttft, engine)
    except (TimeoutError, aiohttp.ClientError):
        return Outcome(start, time.monotonic(), False)


def client(timeout_s: float) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=timeout_s, sock_read=10),
        cookie_jar=aiohttp.DummyCookieJar(),
    )


async def shared_prefix_load(url: str, bodies: list[bytes], time_limit: float) -> Tally:
    tally = Tally()
    queue = list(reversed(bodies))
    deadline = time.monotonic() + time_limit
    async with client(60) as session:

        async def worker() -> None:
            while queue and time.monotonic() < deadline:
                body = queue.pop()
                outcome = await stream(session, url, body, DEBUG)
                tally.outcomes.append(outcome)
                group = re.search(rb"\[group (\d+)\]", body)
                assert group is not None
                tally.sessions[f"prefix-{int(group[1])}"].append(outcome)

        await asyncio.gather(*(worker() for _ in range(16)))
    return tally


def turn_body(prompt: str) -> bytes:
    return json.dumps(
        {"model": MODEL, "prompt": prompt, "max_tokens": 16, "ignore_eos": True,
         "stream": True, "temperature": 0}
    ).encode()  # fmt: skip


async def session_load(
    url: str, sessions: int, turns: int, at_once: int, time_limit: float, seed: int
) -> Tally:
    """`sessions` conversations, `at_once` of them running together, turns one after another."""
    tally = Tally()
    rng = random.Random(seed)
    todo = list(range(sessions))
    deadline = time.monotonic() + time_limit
    async with client(60) as session:

        async def conversation(sid: str) -> None:
            prompt = f"system: conversation {sid}. " + " ".join(rng.choices(WORDS, k=300))
            for turn in range(turns):
                if time.monotonic() >= deadline:
                    return
                prompt += f"\nuser {turn}: " + " ".join(rng.choices(WORDS, k=60))
                outcome = await stream(
                    session, url, turn_body(prompt + "\nassistant:"), DEBUG | {"x-session-id": sid}
                )
                tally.outcomes.append(outcome)
                if outcome.ok:
                    tally.sessions[sid].append(outcome)
                prompt += "\nassistant: " + " ".join(rng.choices(WORDS, k=16))

        async def worker() -> None:
            while todo and time.monotonic() < deadline:
                await conversation(f"s-{seed}-{todo.pop()}")

        await asyncio.gather(*(worker() for _ in range(at_once)))
    return tally


# -- runs --------------------------------------------------------------------------------------


@dataclass
class Row:
    replicas: int
    hit_rate: float
    sticky: float  # sessions (prefixes) whose requests all landed on one engine
    engines_per_key: float  # distinct engines per session (prefix), mean
    on_top: float  # turns on their session's first engine in HRW order
    max_mean: float
    ttft_p50: float
    ttft_p99: float
    requests: int
    errors: int


async def with_replicas(
    engines: list[Proc], n: int, kv_events: bool, extra: list[str]
) -> tuple[list[Proc], HAProxy]:
    replicas = [start_replica(engines, kv_events, extra) for _ in range(n)]
    try:
        await asyncio.gather(*(r.wait_ready("/v1/models") for r in replicas))
        return replicas, HAProxy([r.port for r in replicas], timeout_s=60)
    except BaseException:
        for replica in replicas:
            replica.stop()
        raise


async def measure(
    engines: list[Proc],
    n: int,
    kv_events: bool,
    extra: list[str],
    workload: str,
    scale: float,
    seed: int,
) -> Row:
    await reset_caches(engines)
    replicas, balancer = await with_replicas(engines, n, kv_events, extra)
    try:
        before = await engine_counters(engines)
        if workload == "shared-prefix":
            bodies = shared_prefix_bodies(
                GROUPS, max(int(PER_GROUP * scale), 2), 1200, 16, seed=11 + seed
            )
            tally = await shared_prefix_load(balancer.url, bodies, 120)
        else:
            count = max(int(SESSIONS * scale), AT_ONCE)
            tally = await session_load(balancer.url, count, TURNS, AT_ONCE, 120, seed=12 + seed)
        after = await engine_counters(engines)
    finally:
        balancer.stop()
        for replica in replicas:
            replica.stop()
    hits, queries, loads = cache_delta(before, after)
    ttfts = [o.ttft for o in tally.good if o.ttft is not None]
    sessions = tally.sessions
    distinct = [len({o.engine for o in outcomes}) for outcomes in sessions.values()]
    sticky = sum(n == 1 for n in distinct) / len(distinct) if distinct else NAN
    spread = sum(distinct) / len(distinct) if distinct else NAN
    urls = [e.url for e in engines]
    turns = (
        [(sid, o.engine) for sid, outcomes in sessions.items() for o in outcomes]
        if workload == "sessions"
        else []
    )
    on_top = (
        sum(engine == hrw_order(sid, urls, str)[0] for sid, engine in turns) / len(turns)
        if turns
        else NAN
    )
    return Row(
        n,
        hits / queries if queries else 0.0,
        sticky,
        spread,
        on_top,
        max(loads) / (sum(loads) / len(loads)) if sum(loads) else float("nan"),
        pct(ttfts, 0.5),
        pct(ttfts, 0.99),
        len(tally.good),
        len(tally.outcomes) - len(tally.good),
    )


def pooled(rows: list[Row]) -> Row:
    """Rounds of one replica count: the mean of each figure, requests and errors summed."""

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    return Row(
        rows[0].replicas,
        mean([r.hit_rate for r in rows]),
        mean([r.sticky for r in rows]),
        mean([r.engines_per_key for r in rows]),
        mean([r.on_top for r in rows]),
        mean([r.max_mean for r in rows]),
        mean([r.ttft_p50 for r in rows]),
        mean([r.ttft_p99 for r in rows]),
        sum(r.requests for r in rows),
        sum(r.errors for r in rows),
    )


async def in_flight_of(replica: Proc) -> float:
    async with (
        aiohttp.ClientSession() as session,
        session.get(replica.url + "/metrics", timeout=aiohttp.ClientTimeout(total=2)) as r,
    ):
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("tandem_router_engine_in_flight{")
    )


async def failover(engines: list[Proc], kv_events: bool, extra: list[str]) -> dict[str, float]:
    """4 replicas, 16 streams at a time for 12 s at most, replica 3 SIGKILLed after 4 s."""
    await reset_caches(engines)
    replicas, balancer = await with_replicas(engines, 4, kv_events, extra)
    doomed = replicas[3]
    tally = Tally()
    try:
        rng = random.Random(13)
        bodies = [
            json.dumps({"model": MODEL, "prompt": " ".join(rng.choices(WORDS, k=200)),
                        "max_tokens": 48, "ignore_eos": True, "stream": True}).encode()
            for _ in range(2000)
        ]  # fmt: skip
        deadline = time.monotonic() + 12.0
        async with client(20) as session:

            async def worker() -> None:
                while bodies and time.monotonic() < deadline:
                    tally.outcomes.append(await stream(session, balancer.url, bodies.pop(), DEBUG))

            load = asyncio.gather(*(worker() for _ in range(16)))
            await asyncio.sleep(4.0)
            doomed_in_flight = await in_flight_of(doomed)
            killed_at = time.monotonic()
            os.kill(doomed.proc.pid, signal.SIGKILL)
            await load
    finally:
        balancer.stop()
        for replica in replicas:
            replica.stop()
    failed = [o for o in tally.outcomes if not o.ok]
    return {
        "requests": len(tally.outcomes),
        "failed": len(failed),
        "killed_in_flight": doomed_in_flight,
        "failed_in_flight_at_kill": sum(o.start <= killed_at <= o.end for o in failed),
        "failed_started_after_kill": sum(o.start > killed_at for o in failed),
        "ok_started_after_kill": sum(o.ok and o.start > killed_at for o in tally.outcomes),
        "max_wait_past_kill_s": max((o.end - killed_at for o in failed), default=0.0),
    }


# -- report ------------------------------------------------------------------------------------


def percent(value: float) -> str:
    return "-" if value != value else f"{value:.0%}"


def print_table(title: str, rows: list[Row]) -> None:
    base = rows[0]
    print(f"\n{title}")
    print(
        f"    {'replicas':>8} {'hit rate':>9} {'vs 1':>6} {'sticky':>7} {'eng/key':>8} {'HRW top':>8} {'max/mean':>9} {'vs 1':>6} "
        f"{'TTFT p50':>9} {'p99':>8} {'req':>5} {'err':>4}"
    )
    for row in rows:
        print(
            f"    {row.replicas:8d} {row.hit_rate:9.1%} {row.hit_rate / base.hit_rate:6.3f} "
            f"{percent(row.sticky):>7} {row.engines_per_key:8.2f} {percent(row.on_top):>8} {row.max_mean:9.2f} {row.max_mean / base.max_mean:6.3f} "
            f"{row.ttft_p50 * 1e3:7.0f}ms {row.ttft_p99 * 1e3:6.0f}ms {row.requests:5d} {row.errors:4d}"
        )


async def main_async(args: argparse.Namespace) -> int:
    counts = [int(n) for n in args.replicas.split(",")]
    extra = args.router_args.split()
    scale = 0.5 if args.quick else 1.0
    kv_events = not args.no_kv_events
    # Each engine holds ~9 prefixes (900 blocks x 16 tokens), as in router_bench.py part (c).
    engines = [start_engine(speedup=8.0, profile="llm-d-h100-8b", blocks=900) for _ in range(4)]
    started = time.monotonic()
    try:
        await asyncio.gather(*(e.wait_ready("/health") for e in engines))
        tables = {}
        for workload in args.workloads.split(","):
            rounds: dict[int, list[Row]] = defaultdict(list)
            for r in range(args.rounds):
                for n in counts[r % len(counts) :] + counts[: r % len(counts)]:
                    row = await measure(engines, n, kv_events, extra, workload, scale, seed=r)
                    rounds[n].append(row)
            tables[workload] = [pooled(rounds[n]) for n in counts]
        kill = await failover(engines, kv_events, extra) if args.failover else None
    finally:
        for engine in engines:
            engine.stop()
    index = "exact index (KV events)" if kv_events else "approximate index (--no-kv-events)"
    print(
        f"\n4 emulated engines, {index}, router flags: {args.router_args or '(defaults)'}, "
        f"means of {args.rounds} rounds"
    )
    if "shared-prefix" in tables:
        print_table(
            f"(i) shared prefix: {GROUPS} prefixes of ~1500 tokens, streaming, concurrency 16",
            tables["shared-prefix"],
        )
    if "sessions" in tables:
        print_table(
            f"(ii) sessions: {TURNS} turns each, every turn extends the last, {AT_ONCE} sessions at once",
            tables["sessions"],
        )
    if kill:
        print("\n(iii) failover: 4 replicas, 16 streams at a time, one replica SIGKILLed after 4 s")
        for key, value in kill.items():
            print(f"    {key:<28} {value:g}")
    print(f"\nwall {time.monotonic() - started:.0f} s; load average {os.getloadavg()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", default="1,2,4")
    parser.add_argument("--workloads", default="shared-prefix,sessions")
    parser.add_argument("--no-kv-events", action="store_true", help="approximate index only")
    parser.add_argument("--no-failover", dest="failover", action="store_false")
    parser.add_argument("--quick", action="store_true", help="fewer requests (smoke run)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="runs per workload and replica count, each with other prompts and sessions, in"
        " rotated order; the table shows their means",
    )
    parser.add_argument("--router-args", default="", help="extra flags for every replica")
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
