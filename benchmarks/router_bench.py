"""Tandem's router beside sglang-router 0.3.2 and vllm-router 0.1.17 on the same emulator pools.

Prints, for each router:
  (a) added latency p50/p99 over calling an engine directly, at concurrency 1 and 64
      (one fast engine behind every router, non-streaming, max_tokens=1);
  (b) requests per second per router CPU core (requests completed / router CPU seconds, the
      router's whole process tree, closed loop at concurrency 64, four fast engines);
  (c) a shared-prefix workload on four engines with a small KV cache each: TTFT p50/p90/p99,
      output tokens/s, prefix-cache hit rate (the engines' prompt tokens from cache, each request
      once: tandem.bench.stats.prompt_hit_rate) and
      max/mean requests per engine.
Router `tandem-predictive` is Tandem under `--policy predictive` beside `tandem` (its default
policy) in the same run, so what the predictive policy adds is read from one run; a Tandem router
named KIND@before runs from `--before-tree DIR` (a checkout of the commit before a change) beside
KIND, a before/after pair in one run.
Every load loop is bounded in request count and in time. The peers are installed into
~/.cache/tandem/peers (outside the repository) when missing.

`--method nginx` measures the routers' own cost instead, on a backend that costs nothing: nginx
engines answering a fixed completion, wrk as the client (`nginx_wrk.py`), each router pinned with
taskset to the same `--cores` budget (whole physical cores; nginx and wrk on the other CPUs),
Tandem with `--processes` equal to the budget, the peers round-robin. Per budget and router:
added p50/p99 over nginx direct at concurrency 1 and 64, req/s at 64, the router's CPU seconds
(its whole process tree) and requests per CPU second, medians of interleaved rounds, ratios to
vllm-router; `--before-tree DIR` adds Tandem from another source tree on one core (before/after).

    .venv/bin/python benchmarks/router_bench.py [--quick] [--routers tandem,sglang,vllm]
    .venv/bin/python benchmarks/router_bench.py --parts ab --routers tandem,tandem-predictive
    .venv/bin/python benchmarks/router_bench.py --parts ab \
        --routers tandem,tandem-predictive,tandem-predictive@before --before-tree DIR
    .venv/bin/python benchmarks/router_bench.py --method nginx --cores 1,2,4 [--before-tree DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import nginx_wrk
from router_trace_report import BEFORE, router_kind

from tandem.bench.sampler import flatten
from tandem.bench.stats import prompt_cache_tokens
from tandem.common.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
PEERS = Path.home() / ".cache" / "tandem" / "peers"
PEER_PACKAGES = ["vllm-router==0.1.17", "sglang-router==0.3.2"]
ENGINE_BLOCK_TOKENS = 16  # the emulated engines' KV block size
SUCCESS = "vllm:request_success_total"
MODEL = "tiny"
# Tandem's router kinds: its default policy, and the predictive one beside it in the same run
TANDEM_POLICIES = {"tandem": [], "tandem-predictive": ["--policy", "predictive"]}


def ensure_peers() -> None:
    if (PEERS / "bin" / "vllm-router").exists() and (PEERS / "bin" / "python").exists():
        return
    print(f"installing {' '.join(PEER_PACKAGES)} into {PEERS} ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(PEERS)], check=True)
    subprocess.run([str(PEERS / "bin" / "pip"), "install", "-q", *PEER_PACKAGES], check=True)


# -- processes ---------------------------------------------------------------------------------


class Proc:
    def __init__(
        self,
        name: str,
        argv: list[str],
        port: int,
        env: dict[str, str] | None = None,
        tree: Path = ROOT,
    ):
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.kv_events = ""  # `--kv-events` value of an engine: URL=PUB,REPLAY
        self.log_path = Path("/tmp") / f"router-bench-{name}-{port}.log"
        self.log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            argv,
            cwd=tree,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    async def wait_ready(self, path: str, limit_s: float = 90.0) -> None:
        deadline = time.monotonic() + limit_s
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited: {self.log_path.read_text()[-2000:]}")
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(
                        self.url + path, timeout=aiohttp.ClientTimeout(total=2)
                    ) as r:
                        if r.status == 200:
                            return
                await asyncio.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready: {self.log_path.read_text()[-2000:]}")

    def cpu_seconds(self) -> float:
        """User+system CPU of the process and all its descendants (threads included)."""
        tick = os.sysconf("SC_CLK_TCK")
        children: dict[int, list[int]] = {}
        stats: dict[int, float] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                children.setdefault(int(fields[1]), []).append(int(entry))
                stats[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
        total, todo = 0.0, [self.proc.pid]
        while todo:
            pid = todo.pop()
            total += stats.get(pid, 0.0)
            todo.extend(children.get(pid, []))
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()
        with contextlib.suppress(OSError):
            self.log_path.unlink()


def start_engine(
    speedup: float,
    profile: str | None,
    blocks: int | None,
    extra_args: list[str] | None = None,
    extra_env: dict[str, str] | None = None,
) -> Proc:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "tandem.cli",
        "emulate",
        "--served-model-name",
        MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--block-size",
        str(ENGINE_BLOCK_TOKENS),
        "--max-model-len",
        "16384",
        "--enable-prefix-caching",
        "--speedup",
        str(speedup),
        "--log-level",
        "warning",
    ]
    if profile:
        argv += ["--timing-profile", profile]
    if blocks:
        argv += ["--num-gpu-blocks-override", str(blocks)]
    # KV events as vLLM publishes them; only Tandem's router subscribes to them.
    events, replay = free_port(), free_port()
    argv += ["--kv-events-config", json.dumps({
        "enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv-events",
        "endpoint": f"tcp://*:{events}", "replay_endpoint": f"tcp://*:{replay}",
    })]  # fmt: skip
    # dev mode serves POST /reset_prefix_cache, so every router starts on cold caches
    env = {"PYTHONHASHSEED": "0", "VLLM_SERVER_DEV_MODE": "1", **(extra_env or {})}
    engine = Proc("engine", argv + (extra_args or []), port, env)
    engine.kv_events = f"{engine.url}=tcp://127.0.0.1:{events},tcp://127.0.0.1:{replay}"
    return engine


def router_argv(kind: str, port: int, urls: list[str], tandem_args: list[str]) -> list[str]:
    """The command line of one router over `urls` (`tandem_args`: Tandem's further flags)."""
    if kind in TANDEM_POLICIES:
        argv = [sys.executable, "-m", "tandem.cli", "router", "--host", "127.0.0.1", "--port", str(port),
                "--model", MODEL, "--log-level", "warning"]  # fmt: skip
        for url in urls:
            argv += ["--worker", url]
        return argv + TANDEM_POLICIES[kind] + tandem_args
    # flags both peers share (they come from one code base); ports set explicitly, see docs/protocols.md §6
    shared = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
              "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # fmt: skip
    if kind == "sglang":
        return [str(PEERS / "bin" / "python"), "-m", "sglang_router.launch_router", *shared,
                "--policy", SGLANG_POLICY, "--log-level", "warn"]  # fmt: skip
    if kind == "vllm":
        return [str(PEERS / "bin" / "vllm-router"), *shared, "--policy", VLLM_POLICY,
                "--log-level", "warning"]  # fmt: skip
    raise ValueError(kind)


def ready_path(kind: str) -> str:
    """The path that answers 200 once a router of `kind` serves."""
    return "/v1/models" if kind in TANDEM_POLICIES else "/health"


def emulated_pool_flags(engines: list[Proc], kv_events: bool = True) -> list[str]:
    """Tandem's flags for a pool of emulators. They tokenize with the emulator's fallback (no
    tokenizer.json): the router's matching tokenization keys its exact index on their KV events."""
    flags = ["--block-size", "16", "--tokenizer", "tandem-fallback"]
    if not kv_events:
        return [*flags, "--no-kv-events"]
    for engine in engines:
        flags += ["--kv-events", engine.kv_events]
    return flags


def start_router(name: str, engines: list[Proc]) -> Proc:
    """The router `name` over `engines`: a router kind, or a Tandem kind's KIND@before."""
    port = free_port()
    flags = emulated_pool_flags(engines) + TANDEM_EXTRA_ARGS
    kind = router_kind(name)
    argv = router_argv(kind, port, [e.url for e in engines], flags)
    tree = BEFORE_TREE if name.endswith(BEFORE) and BEFORE_TREE is not None else ROOT
    return Proc(kind, argv, port, tree=tree)


def check_before_tree(names: list[str], tree: Path | None, tandem_kinds: Collection[str]) -> None:
    """`@before` names only Tandem routers, and only with a `--before-tree` that holds Tandem."""
    before = [name for name in names if name.endswith(BEFORE)]
    if not before:
        return
    if tree is None or not (tree / "tandem" / "cli.py").is_file():
        raise SystemExit(f"{before[0]} needs --before-tree DIR, a Tandem source tree")
    other = [name for name in before if router_kind(name) not in tandem_kinds]
    if other:
        raise SystemExit(f"{other[0]}: only a Tandem router runs from --before-tree")


def medians(per_round: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per name, the median of each figure over the rounds; errors summed instead."""
    return {
        name: {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        | {"errors": sum(r["errors"] for r in rows)}
        for name, rows in per_round.items()
    }


# vllm-router's cache_aware policy asks every worker for POST /v1/completions/render per request;
# the emulator has no /render (see the printed note), so cache_aware is checked first and the
# benchmark falls back to the policy that works.
VLLM_POLICY = "cache_aware"
SGLANG_POLICY = "cache_aware"
TANDEM_EXTRA_ARGS: list[str] = []
BEFORE_TREE: Path | None = None  # `--before-tree`: where a KIND@before router runs from


# -- load --------------------------------------------------------------------------------------


@dataclass
class Sample:
    ok: bool
    latency: float
    ttft: float | None = None
    tokens: int = 0
    status: int = 0


@dataclass
class Run:
    samples: list[Sample] = field(default_factory=list)
    wall: float = 0.0

    @property
    def good(self) -> list[Sample]:
        return [s for s in self.samples if s.ok]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def one_request(
    session: aiohttp.ClientSession, url: str, body: bytes, stream: bool
) -> Sample:
    start = time.perf_counter()
    try:
        async with session.post(
            url + "/v1/completions", data=body, headers={"content-type": "application/json"}
        ) as response:
            if not stream:
                data = await response.read()
                latency = time.perf_counter() - start
                ok = response.status == 200
                tokens = json.loads(data)["usage"]["completion_tokens"] if ok else 0
                return Sample(ok, latency, latency, tokens, response.status)
            ttft = None
            tokens = 0
            async for line in response.content:
                if line.startswith(b"data: {"):
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    if b'"text"' in line:
                        tokens += 1
            return Sample(
                response.status == 200 and ttft is not None,
                time.perf_counter() - start,
                ttft,
                tokens,
                response.status,
            )
    except (TimeoutError, aiohttp.ClientError):
        return Sample(False, time.perf_counter() - start)


def load_session() -> aiohttp.ClientSession:
    """A load client's session: keep-alive connections without a limit, no cookies, bodies as
    sent."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=False),
        timeout=aiohttp.ClientTimeout(total=120),
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False,
    )


async def closed_loop(
    url: str, bodies: list[bytes], concurrency: int, stream: bool, time_limit: float
) -> Run:
    """Send `bodies` with `concurrency` in flight; stops early at `time_limit` seconds."""
    run = Run()
    queue = list(reversed(bodies))
    deadline = time.monotonic() + time_limit
    async with load_session() as session:

        async def worker() -> None:
            while queue and time.monotonic() < deadline:
                run.samples.append(await one_request(session, url, queue.pop(), stream))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        run.wall = time.perf_counter() - start
    return run


async def alternating(
    urls: dict[str, str], bodies: list[bytes], time_limit: float, seed: int
) -> dict[str, Run]:
    """Concurrency 1 on every URL at once: each body goes to each URL in turn, in an order shuffled
    per body, so a drift of the shared machine meets every router alike (a run of one URL after
    another put seconds between them, and the routers' c1 p50 moved by more than their gap)."""
    runs = {name: Run() for name in urls}
    order = list(urls)
    rng = random.Random(seed)
    deadline = time.monotonic() + time_limit
    async with contextlib.AsyncExitStack() as stack:
        sessions = {name: await stack.enter_async_context(load_session()) for name in urls}
        start = time.perf_counter()
        for body in bodies:
            if time.monotonic() >= deadline:
                break
            rng.shuffle(order)
            for name in order:
                runs[name].samples.append(
                    await one_request(sessions[name], urls[name], body, False)
                )
        wall = time.perf_counter() - start
    for run in runs.values():
        run.wall = wall
    return runs


def tiny_bodies(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [
        json.dumps(
            {
                "model": MODEL,
                "prompt": f"ping {rng.randrange(10**9)} hello",
                "max_tokens": 1,
                "temperature": 0,
            }
        ).encode()
        for _ in range(n)
    ]


WORDS = [
    "cache",
    "prefix",
    "router",
    "engine",
    "decode",
    "prefill",
    "token",
    "block",
    "stream",
    "batch",
    "model",
    "queue",
    "latency",
    "kubernetes",
    "operator",
    "request",
    "system",
    "policy",
    "answer",
    "question",
    "context",
    "memory",
]


def shared_prefix_bodies(
    groups: int, per_group: int, prefix_words: int, max_tokens: int, seed: int
) -> list[bytes]:
    rng = random.Random(seed)
    prefixes = [
        " ".join(rng.choice(WORDS) for _ in range(prefix_words)) + f" [group {g}]"
        for g in range(groups)
    ]
    bodies = []
    for i in range(groups * per_group):
        g = rng.randrange(groups)
        question = " ".join(rng.choice(WORDS) for _ in range(20))
        bodies.append(
            json.dumps(
                {
                    "model": MODEL,
                    "prompt": f"{prefixes[g]}\nQ{i}: {question}\nA:",
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                    "stream": True,
                    "temperature": 0,
                }
            ).encode()
        )
    return bodies


def pool_delta(before: list[dict[str, float]], after: list[dict[str, float]]) -> dict[str, float]:
    """Between two `engine_counters` readings: each counter's increase summed over the engines
    that export it."""
    totals: dict[str, float] = {}
    for a, b in zip(after, before, strict=True):
        for name, value in a.items():
            totals[name] = totals.get(name, 0.0) + value - b.get(name, 0.0)
    return totals


def cache_delta(
    before: list[dict[str, float]], after: list[dict[str, float]]
) -> tuple[float, float, list[float]]:
    """Between two `engine_counters` readings: the prompt tokens the pool's engines took from
    their prefix caches and those they computed or took from them (each request once,
    `tandem.bench.stats.prompt_cache_tokens`), and the requests each engine served."""
    totals = pool_delta(before, after)
    hits, queries = prompt_cache_tokens(totals.get) or (0.0, 0.0)
    served = [a.get(SUCCESS, 0.0) - b.get(SUCCESS, 0.0) for a, b in zip(after, before, strict=True)]
    return hits, queries, served


async def engine_counters(engines: list[Proc]) -> list[dict[str, float]]:
    """Each engine's vLLM counters (`tandem.bench.sampler.flatten`)."""
    out = []
    async with aiohttp.ClientSession() as session:
        for engine in engines:
            async with session.get(engine.url + "/metrics") as r:
                out.append(flatten(await r.text()))
    return out


async def reset_caches(engines: list[Proc]) -> None:
    async with aiohttp.ClientSession() as session:
        for engine in engines:
            async with session.post(engine.url + "/reset_prefix_cache") as r:
                if r.status != 200:
                    raise RuntimeError(
                        f"{engine.url}/reset_prefix_cache answered {r.status}: {await r.text()}"
                    )


# -- the three measurements --------------------------------------------------------------------


async def measure_overhead(
    kinds: list[str], n1: int, n64: int, time_limit: float, rounds: int = 3
) -> dict[str, dict[str, float]]:
    """Latency through each router and directly, interleaved over `rounds`; medians of the rounds.

    Every router runs beside the others in front of the same engine; at concurrency 1 each
    request goes to the engine directly and through every router in turn (`alternating`), at 64
    the rounds alternate direct -> tandem -> sglang -> vllm, so drifts of the shared machine hit
    all of them alike.
    """
    engine = start_engine(speedup=1000.0, profile=None, blocks=None)
    routers: dict[str, Proc] = {}
    per_round: dict[str, list[dict[str, float]]] = {}
    try:
        await engine.wait_ready("/health")
        for kind in kinds:
            routers[kind] = start_router(kind, [engine])
        for kind, router in routers.items():
            await router.wait_ready(ready_path(router_kind(kind)))
        urls = {"direct": engine.url} | {kind: router.url for kind, router in routers.items()}
        for url in urls.values():
            await closed_loop(url, tiny_bodies(200, 1), 8, False, time_limit)  # warm-up
        for round_ in range(rounds):
            c1_runs = await alternating(urls, tiny_bodies(n1, 10 + round_), time_limit, round_)
            for name, url in urls.items():
                c1 = c1_runs[name]
                c64 = await closed_loop(url, tiny_bodies(n64, 20 + round_), 64, False, time_limit)
                lat1 = [s.latency for s in c1.good]
                lat64 = [s.latency for s in c64.good]
                per_round.setdefault(name, []).append(
                    {
                        "c1_p50": pct(lat1, 0.5),
                        "c1_p99": pct(lat1, 0.99),
                        "c64_p50": pct(lat64, 0.5),
                        "c64_p99": pct(lat64, 0.99),
                        "errors": len(c1.samples) + len(c64.samples) - len(lat1) - len(lat64),
                    }
                )
    finally:
        for router in routers.values():
            router.stop()
        engine.stop()
    return medians(per_round)


async def measure_throughput(
    kinds: list[str], n: int, time_limit: float
) -> dict[str, dict[str, float]]:
    engines = [start_engine(speedup=1000.0, profile=None, blocks=None) for _ in range(4)]
    results: dict[str, dict[str, float]] = {}
    try:
        await asyncio.gather(*(e.wait_ready("/health") for e in engines))
        for kind in kinds:
            router = start_router(kind, engines)
            try:
                await router.wait_ready(ready_path(router_kind(kind)))
                await closed_loop(router.url, tiny_bodies(300, 4), 16, False, time_limit)  # warm-up
                cpu0 = router.cpu_seconds()
                run = await closed_loop(router.url, tiny_bodies(n, 5), 64, False, time_limit)
                cpu = max(router.cpu_seconds() - cpu0, 1e-3)
                good = len(run.good)
                results[kind] = {
                    "rps": good / run.wall,
                    "cpu_s": cpu,
                    "rps_per_core": good / cpu,
                    "errors": len(run.samples) - good,
                }
            finally:
                router.stop()
    finally:
        for engine in engines:
            engine.stop()
    return results


async def measure_shared_prefix(
    kinds: list[str],
    groups: int,
    per_group: int,
    concurrency: int,
    time_limit: float,
    rounds: int = 2,
) -> dict[str, dict[str, float]]:
    """The shared-prefix workload, each router once per round, the order rotating between rounds.

    Engines' prefix caches are reset before every run. TTFTs are pooled over the rounds; output
    tokens/s is the median of the runs; hit rate and per-engine loads are summed over them.
    """
    # Each engine holds ~9 prefixes (900 blocks x 16 tokens); the cold start costs every router the
    # same 8 misses, after that a router keeps hitting as long as it keeps groups together.
    engines = [start_engine(speedup=4.0, profile="llm-d-h100-8b", blocks=900) for _ in range(4)]
    bodies = shared_prefix_bodies(groups, per_group, prefix_words=1200, max_tokens=24, seed=7)
    ttfts: dict[str, list[float]] = {k: [] for k in kinds}
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    totals: dict[str, dict[str, float]] = {
        k: {"hits": 0, "queries": 0, "requests": 0, "errors": 0} for k in kinds
    }
    loads: dict[str, list[float]] = {k: [0.0] * len(engines) for k in kinds}
    try:
        await asyncio.gather(*(e.wait_ready("/health") for e in engines))
        for round_ in range(rounds):
            for kind in kinds[round_ % len(kinds) :] + kinds[: round_ % len(kinds)]:
                await reset_caches(engines)
                router = start_router(kind, engines)
                try:
                    await router.wait_ready(ready_path(router_kind(kind)))
                    before = await engine_counters(engines)
                    run = await closed_loop(router.url, bodies, concurrency, True, time_limit)
                    after = await engine_counters(engines)
                finally:
                    router.stop()
                hits, queries, served = cache_delta(before, after)
                totals[kind]["hits"] += hits
                totals[kind]["queries"] += queries
                totals[kind]["requests"] += len(run.good)
                totals[kind]["errors"] += len(run.samples) - len(run.good)
                for i, count in enumerate(served):
                    loads[kind][i] += count
                ttfts[kind].extend(s.ttft for s in run.good if s.ttft is not None)
                rates[kind].append(sum(s.tokens for s in run.good) / run.wall)
    finally:
        for engine in engines:
            engine.stop()
    results: dict[str, dict[str, float]] = {}
    for kind in kinds:
        t = totals[kind]
        results[kind] = {
            "ttft_p50": pct(ttfts[kind], 0.5),
            "ttft_p90": pct(ttfts[kind], 0.9),
            "ttft_p99": pct(ttfts[kind], 0.99),
            "out_tok_s": statistics.median(rates[kind]) if rates[kind] else float("nan"),
            "hit_rate": t["hits"] / t["queries"] if t["queries"] else 0.0,
            "max_mean_load": max(loads[kind]) / statistics.mean(loads[kind])
            if sum(loads[kind])
            else float("nan"),
            "requests": t["requests"],
            "errors": t["errors"],
        }
    return results


async def check_vllm_policy() -> str:
    """Whether vllm-router's cache_aware works on the emulator (it needs /render); else power_of_two."""
    engine = start_engine(speedup=1000.0, profile=None, blocks=None)
    router = None
    try:
        await engine.wait_ready("/health")
        router = start_router("vllm", [engine])
        await router.wait_ready("/health", limit_s=60)
        run = await closed_loop(router.url, tiny_bodies(5, 9), 1, False, 20)
        return "cache_aware" if len(run.good) == 5 else "power_of_two"
    except (RuntimeError, TimeoutError):
        return "power_of_two"
    finally:
        if router is not None:
            router.stop()
        engine.stop()


# -- the nginx-backend method ------------------------------------------------------------------


def router_variants(
    kinds: list[str], cores: int, before: Path | None
) -> dict[str, tuple[str, list[str], Path]]:
    """Routers of one core budget, name -> (kind, Tandem's flags, source tree): Tandem with one
    process per core, on one core also from the `before` tree (a before/after pair in one run);
    the peers as they are (neither has a thread-count flag: their tokio runtimes size themselves
    from the CPU affinity)."""
    variants: dict[str, tuple[str, list[str], Path]] = {}
    for kind in kinds:
        if kind not in TANDEM_POLICIES:
            variants[kind] = (kind, [], ROOT)
        elif kind != "tandem":  # another policy: one process, beside Tandem's default
            variants[kind] = (kind, ["--no-kv-events"], ROOT)
        elif cores == 1:
            variants["tandem"] = (kind, ["--no-kv-events"], ROOT)
            if before is not None:
                variants["tandem-before"] = (kind, ["--no-kv-events"], before)
        else:
            # several processes serve the merged /metrics on an admin port of their own
            flags = ["--no-kv-events", "--processes", str(cores), "--admin-port", str(free_port())]
            variants[f"tandem-p{cores}"] = (kind, flags, ROOT)
    return variants


def start_nginx(scratch: Path, cores: list[int]) -> Proc:
    """One nginx engine (nginx_wrk.py) on `cores`, its files in a directory under `scratch`."""
    port = free_port()
    prefix = scratch / str(port)
    prefix.mkdir()
    return Proc("nginx", nginx_wrk.nginx_argv(port, prefix, cores), port)


async def measure_nginx_budget(
    kinds: list[str], cores: int, backends: int, seconds: float, rounds: int, before: Path | None
) -> dict[str, dict[str, float]]:
    """Every router pinned to the same `cores` CPUs over `backends` nginx engines, nginx and wrk
    on other CPUs; wrk at concurrency 1 and 64 on each router and on nginx directly, interleaved
    over `rounds` (the order rotating), medians of the rounds. The router's CPU seconds (its whole
    process tree) are read over the concurrency-64 run."""
    router_cpus, nginx_cpus, wrk_cpus = nginx_wrk.core_plan(cores)
    scratch = Path(tempfile.mkdtemp(prefix="tandem-nginx-"))
    engines = [start_nginx(scratch, nginx_cpus) for _ in range(backends)]
    routers: dict[str, Proc] = {}
    per_round: dict[str, list[dict[str, float]]] = {}
    variants = router_variants(kinds, cores, before)
    try:
        await asyncio.gather(*(e.wait_ready("/health") for e in engines))
        urls = [e.url for e in engines]
        for name, (kind, extra, tree) in variants.items():
            port = free_port()
            argv = router_argv(kind, port, urls, extra + TANDEM_EXTRA_ARGS)
            env = {
                "PYTHONPATH": os.pathsep.join(
                    filter(None, [str(tree), os.environ.get("PYTHONPATH")])
                )
            }
            routers[name] = Proc(name, nginx_wrk.pinned(argv, router_cpus), port, env, tree)
        for name, router in routers.items():
            await router.wait_ready(ready_path(variants[name][0]))
        targets = {"direct": engines[0].url} | {n: r.url for n, r in routers.items()}
        for url in targets.values():  # warm-up: connections, caches, the JITs of nothing
            await asyncio.to_thread(nginx_wrk.wrk, url, 8, 1.0, 1, wrk_cpus)
        order = list(targets)
        for round_ in range(rounds):
            shift = round_ % len(order)
            for name in order[shift:] + order[:shift]:
                url, router = targets[name], routers.get(name)
                c1 = await asyncio.to_thread(nginx_wrk.wrk, url, 1, seconds, 1, wrk_cpus)
                cpu0 = router.cpu_seconds() if router else 0.0
                c64 = await asyncio.to_thread(
                    nginx_wrk.wrk, url, 64, seconds, len(wrk_cpus), wrk_cpus
                )
                cpu = router.cpu_seconds() - cpu0 if router else float("nan")
                per_round.setdefault(name, []).append(
                    {
                        "c1_p50": c1.p50_s,
                        "c1_p99": c1.p99_s,
                        "c64_p50": c64.p50_s,
                        "c64_p99": c64.p99_s,
                        "rps": c64.rps,
                        "cpu_s": cpu,
                        "cores_used": cpu / c64.seconds,
                        "rps_per_cpu_s": c64.requests / cpu if cpu > 0 else float("nan"),
                        "errors": c1.errors + c64.errors,
                    }
                )
    finally:
        for router in routers.values():
            router.stop()
        for engine in engines:
            engine.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    return medians(per_round)


def print_nginx_report(results: dict[str, dict[str, dict[str, float]]], load: str) -> None:
    keys = ("c1_p50", "c1_p99", "c64_p50", "c64_p99")
    for budget, rows in results.items():
        direct = rows["direct"]
        ref = rows.get("vllm")
        print(
            f"\nnginx backend, routers on {budget} core(s); added latency over nginx direct, "
            f"microseconds (absolute); req/s and router CPU at concurrency 64; load {load}"
        )
        header = "".join(f"{k.replace('_', ' '):>16}" for k in keys)
        print(
            f"    {'router':<10}{header} {'req/s':>8} {'cores':>6} {'req/cpu s':>10} {'err':>4}"
            "   c64 p99 vs vllm  req/cpu s vs vllm"
        )
        for name, row in rows.items():
            if name == "direct":
                cells = "".join(f"{'(' + format(row[k] * 1e6, '.0f') + ')':>16}" for k in keys)
                print(f"    {name:<10}{cells} {row['rps']:8.0f}")
                continue
            cells = "".join(
                f"{format((row[k] - direct[k]) * 1e6, '+.0f') + ' (' + format(row[k] * 1e6, '.0f') + ')':>16}"
                for k in keys
            )
            print(
                f"    {name:<10}{cells} {row['rps']:8.0f} {row['cores_used']:6.2f} "
                f"{row['rps_per_cpu_s']:10.0f} {int(row['errors']):4d}   "
                f"{ratio(row['c64_p99'], ref['c64_p99'] if ref else 0):>15}  "
                f"{ratio(row['rps_per_cpu_s'], ref['rps_per_cpu_s'] if ref else 0):>17}"
            )
    tandem = {
        budget: row
        for budget, rows in results.items()
        for name, row in rows.items()
        if name == "tandem" or re.fullmatch(r"tandem-p\d+", name)
    }
    one = results.get("1", {})
    if "tandem-before" in one and "tandem" in one:
        after, before = one["tandem"], one["tandem-before"]
        print(
            "\nTandem after/before on one core: req per router CPU second "
            f"{after['rps_per_cpu_s']:.0f}/{before['rps_per_cpu_s']:.0f} "
            f"{ratio(after['rps_per_cpu_s'], before['rps_per_cpu_s'])}, c64 p99 "
            f"{after['c64_p99'] * 1e6:.0f}/{before['c64_p99'] * 1e6:.0f} us "
            f"{ratio(after['c64_p99'], before['c64_p99'])}"
        )
    if len(tandem) > 1 and "1" in tandem:
        print("\nTandem req/s per pod by core budget (--processes = cores), concurrency 64")
        for budget, row in tandem.items():
            print(
                f"    {budget} core(s) {row['rps']:8.0f} req/s {ratio(row['rps'], tandem['1']['rps'])}"
            )


async def main_nginx(args: argparse.Namespace, kinds: list[str]) -> int:
    global SGLANG_POLICY, VLLM_POLICY
    # nginx serves no /render and has no KV cache: round-robin is the fair comparison.
    SGLANG_POLICY = VLLM_POLICY = "round_robin"
    budgets = [int(c) for c in args.cores.split(",")]
    before: Path | None = args.before_tree
    load_before = os.getloadavg()
    results = {
        str(cores): await measure_nginx_budget(
            kinds, cores, args.backends, args.seconds, args.rounds, before
        )
        for cores in budgets
    }
    load = (
        " ".join(f"{a:.2f}" for a in load_before)
        + " -> "
        + " ".join(f"{a:.2f}" for a in os.getloadavg())
    )
    print_nginx_report(results, load)
    if args.json:
        record = {
            "method": "nginx",
            "results": results,
            "load_average": load,
            "cpus": len(os.sched_getaffinity(0)),
            "seconds": args.seconds,
            "rounds": args.rounds,
            "backends": args.backends,
            "core_plans": {str(c): nginx_wrk.core_plan(c) for c in budgets},
            "tandem_args": TANDEM_EXTRA_ARGS,
            "versions": versions(),
        }
        await asyncio.to_thread(Path(args.json).write_text, json.dumps(record, indent=1))
    return 0


def versions() -> dict[str, str]:
    """The versions that shape the numbers: Python, uvloop, httptools, msgspec, nginx, wrk."""
    import httptools
    import msgspec
    import uvloop

    nginx = subprocess.run([nginx_wrk.NGINX, "-v"], capture_output=True, text=True, check=False)
    wrk = subprocess.run([nginx_wrk.WRK, "-v"], capture_output=True, text=True, check=False)
    return {
        "python": sys.version.split()[0],
        "uvloop": uvloop.__version__,
        "httptools": httptools.__version__,
        "msgspec": msgspec.__version__,
        "nginx": nginx.stderr.strip(),
        "wrk": (wrk.stdout + wrk.stderr).strip().splitlines()[0] if wrk.stdout + wrk.stderr else "",
    }


# -- report ------------------------------------------------------------------------------------


def ratio(value: float, base: float) -> str:
    return f"{value / base:5.2f}x" if base and base == base and value == value else "  n/a"


def print_report(
    kinds: list[str],
    overhead: dict[str, dict[str, float]],
    throughput: dict[str, dict[str, float]],
    prefix: dict[str, dict[str, float]],
) -> None:
    ref = "sglang" if "sglang" in kinds else kinds[0]
    print(
        "\n(a) added latency vs calling the engine directly (non-streaming, max_tokens=1; medians of "
        "interleaved rounds), microseconds: added (absolute)"
    )
    keys = ("c1_p50", "c1_p99", "c64_p50", "c64_p99")
    direct = overhead.get("direct", {})
    header = "".join(f"{k.replace('_', ' '):>19}" for k in keys)
    print(f"    {'router':<25}{header} {'errors':>6}   c1 p50 added vs {ref}")
    if direct:
        cells = "".join(f"{'(' + format(direct[k] * 1e6, '.0f') + ')':>19}" for k in keys)
        print(f"    {'direct':<25}{cells} {int(direct['errors']):6d}")
    for kind in kinds:
        row = overhead.get(kind)
        if not row:
            continue
        added = {k: (row[k] - direct.get(k, 0.0)) * 1e6 for k in keys}
        cells = "".join(
            f"{format(added[k], '+.0f') + ' (' + format(row[k] * 1e6, '.0f') + ')':>19}"
            for k in keys
        )
        base = (
            (overhead[ref]["c1_p50"] - direct.get("c1_p50", 0.0)) * 1e6
            if ref in overhead
            else float("nan")
        )
        print(f"    {kind:<25}{cells} {int(row['errors']):6d}   {ratio(added['c1_p50'], base)}")
    print("\n(b) throughput per router core (closed loop, concurrency 64, 4 engines)")
    print(
        f"    {'router':<25} {'req/s':>8} {'cpu s':>7} {'req/s/core':>11} {'errors':>6}   vs {ref}"
    )
    for kind in kinds:
        row = throughput.get(kind)
        if row:
            print(
                f"    {kind:<25} {row['rps']:8.0f} {row['cpu_s']:7.2f} {row['rps_per_core']:11.0f} "
                f"{int(row['errors']):6d}   {ratio(row['rps_per_core'], throughput.get(ref, {}).get('rps_per_core', 0))}"
            )
    print(
        "\n(c) shared-prefix workload (4 engines, 8 prefixes of ~1500 tokens, streaming, concurrency 16; "
        "rounds pooled)"
    )
    print(
        f"    {'router':<25} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'out tok/s':>10} {'hit rate':>9} "
        f"{'max/mean':>9} {'req':>5} {'err':>4}   TTFT p50 vs {ref}"
    )
    for kind in kinds:
        row = prefix.get(kind)
        if row:
            print(
                f"    {kind:<25} {row['ttft_p50'] * 1e3:7.0f}ms {row['ttft_p90'] * 1e3:6.0f}ms {row['ttft_p99'] * 1e3:6.0f}ms "
                f"{row['out_tok_s']:10.0f} {row['hit_rate']:9.1%} {row['max_mean_load']:9.2f} {int(row['requests']):5d} "
                f"{int(row['errors']):4d}   {ratio(row['ttft_p50'], prefix.get(ref, {}).get('ttft_p50', 0))}"
            )


async def main_async(args: argparse.Namespace) -> int:
    global VLLM_POLICY, BEFORE_TREE
    TANDEM_EXTRA_ARGS.extend(args.tandem_args.split())
    kinds = [k.strip() for k in args.routers.split(",") if k.strip()]
    if any(router_kind(k) not in TANDEM_POLICIES for k in kinds):
        ensure_peers()
    if args.method == "nginx":
        return await main_nginx(args, kinds)
    check_before_tree(kinds, args.before_tree, TANDEM_POLICIES)
    BEFORE_TREE = args.before_tree
    if "vllm" in kinds:
        VLLM_POLICY = await check_vllm_policy()
        if VLLM_POLICY != "cache_aware":
            print(
                "note: vllm-router's cache_aware policy needs POST /v1/completions/render on workers, which the "
                f"emulator does not serve; vllm-router runs with --policy {VLLM_POLICY} instead."
            )
    scale = 0.3 if args.quick else 1.0
    overhead = throughput = prefix = {}
    if "a" in args.parts:
        overhead = await measure_overhead(
            kinds, int(1000 * scale), int(4000 * scale), args.time_limit
        )
    if "b" in args.parts:
        throughput = await measure_throughput(kinds, int(6000 * scale), args.time_limit)
    if "c" in args.parts:
        prefix = await measure_shared_prefix(
            kinds,
            groups=8,
            per_group=int(40 * scale) or 4,
            concurrency=16,
            time_limit=args.time_limit,
        )
    print_report(kinds, overhead, throughput, prefix)
    if args.json:
        await asyncio.to_thread(
            Path(args.json).write_text,
            json.dumps(
                {
                    "overhead": overhead,
                    "throughput": throughput,
                    "shared_prefix": prefix,
                    "vllm_policy": VLLM_POLICY,
                },
                indent=1,
            ),
        )
    return 0


METHODS = ("emulator", "nginx", "replicas", "trace")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The replicas method is router_replicas.py: every other flag is that script's, including
    # the ones both scripts have (--quick, --rounds).
    method = argparse.ArgumentParser(add_help=False)
    method.add_argument("--method", choices=METHODS, default="emulator")
    chosen, rest = method.parse_known_args(argv)
    if chosen.method == "replicas":
        from router_replicas import main as replicas  # it imports this module: load it only here

        return replicas(rest)
    if chosen.method == "trace":
        from router_trace import main as trace  # it imports this module: load it only here

        return trace(rest)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--routers", default="tandem,sglang,vllm", help="of tandem, tandem-predictive, sglang, vllm"
    )
    parser.add_argument("--quick", action="store_true", help="fewer requests (smoke run)")
    parser.add_argument(
        "--time-limit", type=float, default=120.0, help="seconds per load loop at most"
    )
    parser.add_argument("--json", help="also write the numbers to this file")
    parser.add_argument("--tandem-args", default="", help="extra flags for `tandem router`")
    parser.add_argument("--parts", default="abc", help="which measurements to run (a, b, c)")
    parser.add_argument(
        "--method",
        choices=METHODS,
        default="emulator",
        help="emulator pools (a, b, c), nginx backends driven by wrk, Tandem's 1/2/4 replicas"
        " behind HAProxy (router_replicas.py), or every router on a production trace"
        " (router_trace.py); with replicas and trace the flags after it are that script's",
    )
    nginx = parser.add_argument_group("nginx method")
    nginx.add_argument("--cores", default="1", help="router core budgets, e.g. 1,2,4")
    nginx.add_argument("--backends", type=int, default=4, help="nginx engines")
    nginx.add_argument("--seconds", type=float, default=5.0, help="seconds per wrk run")
    nginx.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument(
        "--before-tree",
        type=lambda path: Path(path).resolve(),
        help="another Tandem source tree: a router named KIND@before (a Tandem KIND) runs from it;"
        " with nginx, Tandem also runs from it on one core (tandem-before)",
    )
    args = parser.parse_args(argv)
    try:
        import uvloop

        return uvloop.run(main_async(args))
    except ImportError:
        return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
