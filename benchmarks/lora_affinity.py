"""LoRA adapter placement: requests for N adapters over M emulated engines, through two Tandem
routers side by side on the same engines, one with the LoRA affinity scorer
(`--lora-affinity-weight 2`, the default) and one without (`0`).

Each engine runs --enable-lora --max-loras SLOTS with every adapter loaded at start (the
emulator's H200 profile; an adapter brought into a GPU slot costs --lora-swap-time, one not in
CPU memory --lora-load-time more). The load: `--requests` completions at concurrency
`--concurrency`, each for an adapter drawn with Zipf(1) popularity, every prompt distinct (no
prefix to share, so placement is the adapters' and the load's). Reported per router, the means of
`--rounds` rounds (routers in rotated order, engine state reset between runs by restarting them):
  active   the fraction of requests that landed on an engine where a request for the same adapter
           was already running (from the client's log: x-tandem-decode-engine and the times);
  waited   the fraction that waited for an adapter slot on their engine (the engine's count);
  swap-ins adapters brought into a GPU slot per request (the engines' count);
  TTFT p50 / p99 and the run's duration.
Every load loop is bounded in request count and in time; every client has a timeout.

    .venv/bin/python benchmarks/lora_affinity.py [--engines 4] [--adapters 8] [--requests 400]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from dataclasses import dataclass

import aiohttp
from router_bench import Proc, emulated_pool_flags, pct, router_argv, start_engine

from tandem.common.ports import free_port

DEBUG = {"x-tandem-debug": "1", "content-type": "application/json"}


@dataclass
class Sample:
    adapter: str
    engine: str
    start: float
    end: float
    ttft: float
    ok: bool


def zipf_adapters(count: int, adapters: int, rng: random.Random) -> list[str]:
    weights = [1.0 / (rank + 1) for rank in range(adapters)]
    return rng.choices([f"a{i}" for i in range(adapters)], weights, k=count)


async def one(
    session: aiohttp.ClientSession, url: str, adapter: str, prompt: str, max_tokens: int
) -> Sample:
    body = {
        "model": adapter,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.monotonic()
    ttft = float("nan")
    try:
        async with session.post(
            f"{url}/v1/completions", data=json.dumps(body), headers=DEBUG
        ) as response:
            engine = response.headers.get("x-tandem-decode-engine", "")
            async for _ in response.content:
                if ttft != ttft:
                    ttft = time.monotonic() - start
            return Sample(adapter, engine, start, time.monotonic(), ttft, response.status == 200)
    except (TimeoutError, aiohttp.ClientError):
        return Sample(adapter, "", start, time.monotonic(), ttft, False)


async def run_load(url: str, args: argparse.Namespace, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    adapters = zipf_adapters(args.requests, args.adapters, rng)
    prompts = [
        " ".join(f"w{rng.randrange(10**6)}" for _ in range(args.prompt_words))
        for _ in range(args.requests)
    ]
    queue = list(zip(adapters, prompts, strict=True))
    samples: list[Sample] = []
    deadline = time.monotonic() + args.limit_s
    timeout = aiohttp.ClientTimeout(total=120)

    async def worker(session: aiohttp.ClientSession) -> None:
        while queue and time.monotonic() < deadline:
            adapter, prompt = queue.pop()
            samples.append(await one(session, url, adapter, prompt, args.max_tokens))

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(args.concurrency)))
    return samples


def landed_active(samples: list[Sample]) -> float:
    """Requests whose engine already ran a request for their adapter when they were sent."""
    hits = 0
    for sample in samples:
        hits += any(
            other is not sample
            and other.engine == sample.engine
            and other.adapter == sample.adapter
            and other.start < sample.start < other.end
            for other in samples
        )
    return hits / len(samples) if samples else float("nan")


async def engine_stats(engines: list[Proc]) -> dict[str, float]:
    totals = {"lora_swap_ins": 0.0, "lora_waited": 0.0, "lora_loads": 0.0}
    async with aiohttp.ClientSession() as session:
        for engine in engines:
            async with session.get(f"{engine.url}/emulator/stats") as response:
                stats = await response.json()
            for key in totals:
                totals[key] += float(stats.get(key, 0))
    return totals


async def one_run(args: argparse.Namespace, weight: float, seed: int) -> dict[str, float]:
    adapters = [f"a{i}={'/adapters/a' + str(i)}" for i in range(args.adapters)]
    lora = [
        "--enable-lora", "--max-loras", str(args.slots), "--max-cpu-loras",
        str(args.cpu_slots), "--lora-modules", *adapters,
    ]  # fmt: skip
    engines = [start_engine(args.speedup, None, None, lora) for _ in range(args.engines)]
    router: Proc | None = None
    try:
        for engine in engines:
            await engine.wait_ready("/health")
        port = free_port()
        flags = [
            *emulated_pool_flags(engines),
            "--trust-all-clients",
            "--lora-affinity-weight",
            str(weight),
        ]
        router = Proc(
            f"router-{weight}", router_argv("tandem", port, [e.url for e in engines], flags), port
        )
        await router.wait_ready("/v1/models")
        await asyncio.sleep(2.5)  # the router reads every engine's adapters at its health pace
        began = time.monotonic()
        samples = await run_load(router.url, args, seed)
        duration = time.monotonic() - began
        stats = await engine_stats(engines)
    finally:
        if router is not None:
            router.stop()
        for engine in engines:
            engine.stop()
    ok = [s for s in samples if s.ok]
    ttfts = [s.ttft for s in ok]
    return {
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "active": landed_active(ok),
        "waited": stats["lora_waited"] / max(len(ok), 1),
        "swap_ins": stats["lora_swap_ins"] / max(len(ok), 1),
        "ttft_p50": pct(ttfts, 0.5),
        "ttft_p99": pct(ttfts, 0.99),
        "duration_s": duration,
    }


async def main_async(args: argparse.Namespace) -> None:
    variants = {"with scorer": 2.0, "without scorer": 0.0}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    names = list(variants)
    for round_ in range(args.rounds):
        order = names[round_ % 2 :] + names[: round_ % 2]
        for name in order:
            results[name].append(await one_run(args, variants[name], seed=round_))
    load = os.getloadavg()
    print(
        f"{args.engines} engines x {args.slots} adapter slots, {args.adapters} adapters (Zipf), "
        f"{args.requests} requests at concurrency {args.concurrency}, {args.rounds} rounds; "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    keys = ["active", "waited", "swap_ins", "ttft_p50", "ttft_p99", "duration_s", "errors"]
    print(f"{'':16}" + "".join(f"{k:>12}" for k in keys))
    means = {
        name: {k: sum(r[k] for r in runs) / len(runs) for k in keys}
        for name, runs in results.items()
    }
    for name, mean in means.items():
        print(f"{name:16}" + "".join(f"{mean[k]:12.3f}" for k in keys))
    base, scored = means["without scorer"], means["with scorer"]
    print(
        "ratios with/without: "
        + ", ".join(f"{k} {scored[k] / base[k]:.2f}x" for k in keys if base[k])
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--slots", type=int, default=2, help="--max-loras of every engine")
    p.add_argument("--cpu-slots", type=int, default=4, help="--max-cpu-loras of every engine")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-words", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--speedup", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--limit-s", type=float, default=120.0, help="bound of one run's load")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
