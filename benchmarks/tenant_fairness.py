"""Two tenants on shared pools behind `tandem gateway`: a quiet one, and one bursting 10x.

Two emulated engines (the H200 Llama-3.1-8B timing profile at `--speedup`, `--max-num-seqs`
streams each: the batch their KV memory allows) serve one model through three gateways started
side by side over the same engines, each with the tenants' two API keys:
  fair   tenancy on (fair shares, guaranteed share), maxInFlight = --max-in-flight
  fifo   tenancy off, the same maxInFlight: one first-come-first-served queue in the gateway
  open   tenancy off, maxInFlight 1024 (the default): the engines' own queues decide
The quiet tenant sends Poisson arrivals at --quiet-rate, the loud one at 10x that, for
--seconds per phase; streaming completions of ~--prompt-words words, --max-tokens output tokens
(ignore_eos). Phases: the quiet tenant alone (through `fair`), then both tenants through each
gateway, in --rounds rounds with the gateways in rotated order. Prints each variant's TTFT p50/p99
(client side, first streamed event) per tenant, requests refused (429), and the quiet tenant's
TTFT p99 over its p99 alone, with the load average. Every loop is bounded by a request count
and time; every client request has a timeout.

    .venv/bin/python benchmarks/tenant_fairness.py [--seconds 30] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from router_bench import MODEL, WORDS, Proc, pct, start_engine

from tandem.common.ports import free_port

KEYS = {"quiet": "sk-quiet-tenant", "loud": "sk-loud-tenant"}
VARIANTS = ("fair", "fifo", "open")


@dataclass
class Tally:
    ttft: dict[str, list[float]] = field(default_factory=lambda: {t: [] for t in KEYS})
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KEYS, 0))
    failed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KEYS, 0))
    sent: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KEYS, 0))


def gateway_config(engines: list[Proc], max_in_flight: int, tenancy: bool) -> dict[str, object]:
    return {
        "logLevel": "warning",
        "models": [
            {
                "servedModelName": MODEL,
                "apiKeys": list(KEYS.values()),
                "tenancy": {"enabled": tenancy},
                "tokenizer": "tandem-fallback",
                "kvEvents": False,
                "static": {"workers": [{"url": e.url} for e in engines]},
                "admission": {"maxInFlight": max_in_flight, "maxQueue": 64},
            }
        ],
    }


def start_gateway(config: dict[str, object], directory: Path) -> Proc:
    port = free_port()
    path = directory / f"gateway-{port}.yaml"
    path.write_text(json.dumps(config))
    argv = [sys.executable, "-m", "tandem.cli", "gateway", "--config", str(path)]
    return Proc("gateway", [*argv, "--host", "127.0.0.1", "--port", str(port)], port)


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def one(
    session: aiohttp.ClientSession, url: str, tenant: str, body: bytes, tally: Tally
) -> None:
    start = time.perf_counter()
    headers = {"authorization": f"Bearer {KEYS[tenant]}", "content-type": "application/json"}
    try:
        async with session.post(url + "/v1/completions", data=body, headers=headers) as response:
            if response.status == 429:
                tally.refused[tenant] += 1
                return
            if response.status != 200:
                tally.failed[tenant] += 1
                return
            async for line in response.content:
                if line.startswith(b"data: {"):
                    tally.ttft[tenant].append(time.perf_counter() - start)
                    break
            async for _ in response.content.iter_any():
                pass
    except (TimeoutError, aiohttp.ClientError):
        tally.failed[tenant] += 1


async def phase(url: str, tenants: list[str], args: argparse.Namespace, seed: int) -> Tally:
    """Poisson arrivals of each tenant for `args.seconds`, then every request to its end."""
    tally = Tally()
    rng = random.Random(seed)
    rates = {"quiet": args.quiet_rate, "loud": args.quiet_rate * args.burst}
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        tasks: list[asyncio.Task[None]] = []

        async def arrivals(tenant: str) -> None:
            stop = time.monotonic() + args.seconds
            for _ in range(int(rates[tenant] * args.seconds * 3)):  # bounded by count and time
                await asyncio.sleep(rng.expovariate(rates[tenant]))
                if time.monotonic() >= stop:
                    return
                body = {
                    "model": MODEL,
                    "prompt": prompt(rng, args.prompt_words),
                    "max_tokens": args.max_tokens,
                    "ignore_eos": True,
                    "stream": True,
                }
                tally.sent[tenant] += 1
                tasks.append(
                    asyncio.create_task(one(session, url, tenant, json.dumps(body).encode(), tally))
                )

        await asyncio.gather(*(arrivals(t) for t in tenants))
        await asyncio.gather(*tasks)
    return tally


def merge(into: Tally, other: Tally) -> None:
    for tenant in KEYS:
        into.ttft[tenant] += other.ttft[tenant]
        into.refused[tenant] += other.refused[tenant]
        into.failed[tenant] += other.failed[tenant]
        into.sent[tenant] += other.sent[tenant]


def ms(values: list[float], q: float) -> str:
    return f"{pct(values, q) * 1e3:7.0f}" if values else "      -"


async def main_async(args: argparse.Namespace) -> int:
    engines = [
        start_engine(args.speedup, None, None, ["--max-num-seqs", str(args.max_num_seqs)])
        for _ in range(2)
    ]
    directory = Path(tempfile.mkdtemp(prefix="tenant-fairness-"))
    gateways = {
        "fair": start_gateway(gateway_config(engines, args.max_in_flight, True), directory),
        "fifo": start_gateway(gateway_config(engines, args.max_in_flight, False), directory),
        "open": start_gateway(gateway_config(engines, 1024, False), directory),
    }
    try:
        for proc in (*engines, *gateways.values()):
            await proc.wait_ready("/health")
        print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        results = {name: Tally() for name in ("alone", *VARIANTS)}
        for round_ in range(args.rounds):
            order = VARIANTS[round_ % 3 :] + VARIANTS[: round_ % 3]
            merge(results["alone"], await phase(gateways["fair"].url, ["quiet"], args, round_))
            for name in order:
                tally = await phase(gateways[name].url, ["quiet", "loud"], args, 100 + round_)
                merge(results[name], tally)
            print(f"round {round_ + 1} done, load average {os.getloadavg()[0]:.2f}", flush=True)
        alone_p99 = pct(results["alone"].ttft["quiet"], 0.99)
        print(
            f"\n{'variant':8} {'quiet p50':>9} {'quiet p99':>9} {'loud p50':>9} {'loud p99':>9}"
            f" {'quiet 429':>9} {'loud 429':>9} {'quiet n':>8} {'loud n':>8}  quiet p99 / alone"
        )
        for name, tally in results.items():
            quiet, loud = tally.ttft["quiet"], tally.ttft["loud"]
            ratio = pct(quiet, 0.99) / alone_p99 if quiet else float("nan")
            print(
                f"{name:8} {ms(quiet, 0.5):>9} {ms(quiet, 0.99):>9} {ms(loud, 0.5):>9}"
                f" {ms(loud, 0.99):>9} {tally.refused['quiet']:>9} {tally.refused['loud']:>9}"
                f" {tally.sent['quiet']:>8} {tally.sent['loud']:>8}  {ratio:.2f}x"
                + (f"  (failed: {tally.failed})" if any(tally.failed.values()) else "")
            )
        print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        for proc in (*gateways.values(), *engines):
            proc.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=float, default=30.0, help="arrivals per phase")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quiet-rate", type=float, default=1.5, help="quiet tenant requests/s")
    p.add_argument("--burst", type=float, default=10.0, help="loud tenant's rate over quiet's")
    p.add_argument("--speedup", type=float, default=0.1, help="emulator time divisor")
    p.add_argument("--max-num-seqs", type=int, default=16, help="streams per engine")
    p.add_argument("--max-in-flight", type=int, default=16, help="fair/fifo gateways' maxInFlight")
    p.add_argument("--prompt-words", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--request-timeout", type=float, default=120.0)
    return asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
