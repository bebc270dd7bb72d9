"""Two models on their own GPUs, or sharing one: split memory or vLLM's sleep mode, side by side.

Two models' traffic is replayed at once, open loop at the traces' own timestamps, through three
(or four) placements of two emulated Llama-3.1-8B engines (H200 profile):

  own       one GPU each: two engines, default memory (gpuMemoryUtilization 0.9)
  split     one GPU, two engines with half the memory each (0.45: a smaller KV cache) taking
            turns on the GPU's compute (`tandem emulate --shared-gpu`): a step of one engine
            never overlaps a step of the other
  sleep     one GPU, two engines with the whole memory each and `--enable-sleep-mode`, one awake
            at a time; a switcher in front of them holds requests for the sleeping model and
            swaps (POST /sleep?level=L&mode=wait on the awake engine, then /wake_up on the other)
            when the awake model has nothing in flight or has held the GPU for `--quantum`
            seconds while the other waits (level 1 here; `sleep-l2`: level 2, a reload on wake)

Scenarios (each `--seconds` of emulated time):

  light     both models steady at `--light` times their trace's rate
  heavy     both models steady at `--heavy` times their trace's rate
  idle      model A steady at 1x; model B at 1x only during the first `--burst` seconds of
            every `--period` (idle the rest of the time)

Model A ("code") replays the Azure code trace (long prompts, short answers), model B ("chat") the
Mooncake conversation trace (prefix reuse, longer answers); both with each 512-token block
scaled to `--block-tokens` tokens and outputs capped at `--max-output`. Per placement: TTFT and
TPOT p50/p99 per model (emulated ms), GPU-seconds held (GPUs x run time) and busy (the engines'
simulated step time), and for sleep mode the switches and the time spent switching. The engines
run at `--speedup` of the H200's pace and every figure is converted back to emulated time.

    .venv/bin/python benchmarks/gpu_sharing.py \\
        --code-trace /path/to/azure_llm_2023_code.csv \\
        --chat-trace /path/to/mooncake_conversation_trace.jsonl \\
        --json docs/records/gpu-sharing-X.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from router_bench import Proc

from tandem.bench.records import BenchRecord
from tandem.bench.runner import RunOptions, Target, run_target
from tandem.bench.spec import Trace
from tandem.bench.traces import read_trace
from tandem.common.ports import free_port

MODELS = ("code", "chat")
SETUPS = ("own", "split", "sleep", "sleep-l2")
SCENARIOS = ("light", "heavy", "idle")


# -- workloads ------------------------------------------------------------------------------------


def write_window(
    source: Path,
    dest: Path,
    seconds: float,
    rate: float,
    burst: tuple[float, float] | None = None,
) -> int:
    """The first `seconds` of emulated time of `source` at `rate` times its pace, as a `tandem`
    trace; with burst = (on, period) only rows in the first `on` seconds of every period."""
    rows = []
    for row in read_trace(source):
        at = row.at_s / rate
        if at >= seconds:
            break
        if burst is not None and at % burst[1] >= burst[0]:
            continue
        rows.append(
            {
                "at_s": at,
                "input_tokens": row.input_tokens,
                "output_tokens": row.output_tokens,
                "hash_ids": list(row.hash_ids),
            }
        )
    dest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


# -- the sleep-mode switcher ----------------------------------------------------------------------


@dataclass
class SleepSwitcher:
    """Holds each request until its model is the awake one; swaps models by sleep and wake.

    A swap to model M starts when M has a request waiting and the awake model has nothing in
    flight and nothing waiting, or has been awake for `quantum_s` (then its new requests wait
    too, and `mode=wait` lets its in-flight ones finish before the sleep).
    """

    engines: dict[str, str]
    active: str
    level: int
    quantum_s: float
    in_flight: dict[str, int] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)
    switching: bool = False
    since: float = 0.0
    switches: int = 0
    switch_s: float = 0.0
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    task: asyncio.Task[None] | None = None

    def _may_switch(self, model: str, now: float) -> bool:
        active = self.active
        idle = not self.in_flight.get(active) and not self.waiting.get(active)
        return idle or now - self.since >= self.quantum_s

    async def admit(self, model: str) -> None:
        loop = asyncio.get_running_loop()
        async with self.changed:
            self.waiting[model] = self.waiting.get(model, 0) + 1
            try:
                while self.switching or self.active != model:
                    if not self.switching and self._may_switch(model, loop.time()):
                        self.switching = True
                        self.task = loop.create_task(self._switch(model))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.changed.wait(), 0.05)
                self.in_flight[model] = self.in_flight.get(model, 0) + 1
            finally:
                self.waiting[model] -= 1

    async def release(self, model: str) -> None:
        async with self.changed:
            self.in_flight[model] -= 1
            self.changed.notify_all()

    async def _switch(self, model: str) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            params = {"level": str(self.level), "mode": "wait"}
            async with session.post(self.engines[self.active] + "/sleep", params=params) as r:
                r.raise_for_status()
            async with session.post(self.engines[model] + "/wake_up") as r:
                r.raise_for_status()
        async with self.changed:
            self.active = model
            self.since = loop.time()
            self.switching = False
            self.switches += 1
            self.switch_s += loop.time() - start
            self.changed.notify_all()


class SwitcherProxy:
    """One port per model; /v1/* is forwarded once the switcher (if any) admits it. Every
    placement is measured through it, so that all pay the same extra hop."""

    def __init__(self, engines: dict[str, str], switcher: SleepSwitcher | None) -> None:
        self.engines = engines
        self.switcher = switcher
        self.runners: list[web.AppRunner] = []
        self.urls: dict[str, str] = {}
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900))
        for model in self.engines:
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", self._handler(model))
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            self.runners.append(runner)
            self.urls[model] = f"http://127.0.0.1:{port}"

    def _handler(self, model: str) -> Any:
        async def forward(request: web.Request) -> web.StreamResponse:
            assert self.session is not None
            body = await request.read()
            switcher = self.switcher
            generate = request.path.startswith("/v1/") and request.method == "POST"
            if switcher is not None and generate:
                await switcher.admit(model)
            try:
                url = self.engines[model] + request.path_qs
                headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
                async with self.session.request(
                    request.method, url, data=body, headers=headers
                ) as upstream:
                    content_type = upstream.headers.get("Content-Type", "application/json")
                    response = web.StreamResponse(
                        status=upstream.status, headers={"Content-Type": content_type}
                    )
                    await response.prepare(request)
                    async for chunk in upstream.content.iter_any():
                        await response.write(chunk)
                    await response.write_eof()
                    return response
            finally:
                if switcher is not None and generate:
                    await switcher.release(model)

        return forward

    async def stop(self) -> None:
        for runner in self.runners:
            await runner.cleanup()
        if self.session is not None:
            await self.session.close()


# -- one placement --------------------------------------------------------------------------------


def start_engine(model: str, speedup: float, extra: list[str], env: dict[str, str]) -> Proc:
    port = free_port()
    argv = [
        sys.executable, "-m", "tandem.cli", "emulate", "--served-model-name", model,
        "--host", "127.0.0.1", "--port", str(port), "--block-size", "16",
        "--max-model-len", "32768", "--speedup", str(speedup), "--log-level", "warning", *extra,
    ]  # fmt: skip
    return Proc(f"engine-{model}", argv, port, {"PYTHONHASHSEED": "0", **env})


async def emulator_stats(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(url + "/emulator/stats") as r:
        data: dict[str, Any] = await r.json()
        return data


def figures(record: BenchRecord, speedup: float) -> dict[str, Any]:
    s = record.summary

    def emulated(value: float | None) -> float | None:
        return None if value is None else round(value * speedup, 1)

    return {
        "requests": s.requests,
        "failed": s.failed,
        "ttft_p50": emulated(s.ttft_ms.p50),
        "ttft_p99": emulated(s.ttft_ms.p99),
        "tpot_p50": emulated(s.tpot_ms.p50),
        "tpot_p99": emulated(s.tpot_ms.p99),
        "errors": sorted({r.error[:120] for r in record.requests if not r.ok})[:3],
    }


async def run_setup(
    setup: str, traces: dict[str, Path], scratch: Path, args: argparse.Namespace
) -> dict[str, Any]:
    speedup = args.speedup
    shared = setup != "own"
    sleep_level = {"sleep": 1, "sleep-l2": 2}.get(setup)
    extra = []
    env: dict[str, str] = {}
    if shared:
        extra += ["--shared-gpu", str(scratch / f"{setup}.lock")]
    if setup == "split":
        extra += ["--gpu-memory-utilization", "0.45"]
    if sleep_level is not None:
        extra += ["--enable-sleep-mode"]
        env["VLLM_SERVER_DEV_MODE"] = "1"
    engines = {m: start_engine(m, speedup, extra, env) for m in MODELS}
    proxy: SwitcherProxy | None = None
    switcher: SleepSwitcher | None = None
    try:
        await asyncio.gather(*(e.wait_ready("/health") for e in engines.values()))
        urls = {m: e.url for m, e in engines.items()}
        if sleep_level is not None:
            async with aiohttp.ClientSession() as session:
                params = {"level": str(sleep_level)}
                async with session.post(urls["chat"] + "/sleep", params=params) as r:
                    r.raise_for_status()
            switcher = SleepSwitcher(
                engines=urls,
                active="code",
                level=sleep_level,
                quantum_s=args.quantum / speedup,
                since=asyncio.get_running_loop().time(),
            )
        proxy = SwitcherProxy(urls, switcher)
        await proxy.start()
        targets = proxy.urls
        before = {m: await emulator_stats(u) for m, u in urls.items()}
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def replay(model: str) -> BenchRecord:
            workload = Trace(
                path=str(traces[model]),
                format="tandem",
                speedup=speedup,
                block_tokens=args.block_tokens,
                max_output_tokens=args.max_output,
                warmup_requests=0,
                max_duration_s=args.seconds / speedup + 120,
            )
            options = RunOptions(
                model=model, progress=False, nvml=False, request_timeout_s=900 / speedup + 60
            )
            return await run_target(Target(model, targets[model]), workload, options)

        records = dict(zip(MODELS, await asyncio.gather(*map(replay, MODELS)), strict=True))
        wall = loop.time() - start
        after = {m: await emulator_stats(u) for m, u in urls.items()}
    finally:
        if proxy is not None:
            await proxy.stop()
        for engine in engines.values():
            engine.stop()
    gpus = 1 if shared else 2
    busy = sum(after[m]["simulated_s"] - before[m]["simulated_s"] for m in MODELS)
    row: dict[str, Any] = {m: figures(records[m], speedup) for m in MODELS}
    row["run_s"] = round(wall * speedup, 1)
    row["gpu_s_held"] = round(gpus * wall * speedup, 1)
    row["gpu_s_busy"] = round(busy, 1)
    row["busy_fraction"] = round(busy / (gpus * wall * speedup), 3)
    if switcher is not None:
        row["switches"] = switcher.switches
        row["switch_s"] = round(switcher.switch_s * speedup, 1)
    return row


# -- report ---------------------------------------------------------------------------------------


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def print_table(scenario: str, rows: dict[str, dict[str, Any]]) -> None:
    print(f"\n{scenario}: emulated ms; GPU-s over the run")
    head = (
        f"{'placement':<9} {'model':<5} {'reqs':>5} {'fail':>4} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'TPOT p50':>9} {'TPOT p99':>9} {'GPU-s held':>10} {'busy':>6} {'switches':>8}"
    )
    print(head)
    for setup, row in rows.items():
        for model in MODELS:
            f = row[model]
            tail = (
                f"{row['gpu_s_held']:>10.0f} {row['busy_fraction']:>6.0%} "
                f"{row.get('switches', '-'):>8}"
                if model == MODELS[0]
                else ""
            )
            print(
                f"{setup:<9} {model:<5} {f['requests']:>5} {f['failed']:>4} "
                f"{ms(f['ttft_p50']):>9} {ms(f['ttft_p99']):>9} {ms(f['tpot_p50']):>9} "
                f"{ms(f['tpot_p99']):>9} {tail}"
            )


def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each shared placement's figures over own pools' (GPU-s held, TTFT/TPOT p99 per model)."""
    own = rows.get("own")
    found: dict[str, dict[str, float | None]] = {}
    if own is None:
        return found

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else round(a / b, 2)

    for setup, row in rows.items():
        if setup == "own":
            continue
        found[setup] = {"gpu_s_held": ratio(row["gpu_s_held"], own["gpu_s_held"])}
        for model in MODELS:
            for key in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99"):
                found[setup][f"{model}_{key}"] = ratio(row[model][key], own[model][key])
    return found


async def main_async(args: argparse.Namespace) -> int:
    scenarios = [s for s in args.scenarios.split(",") if s]
    setups = [s for s in args.setups.split(",") if s]
    bad = sorted(set(scenarios) - set(SCENARIOS)) + sorted(set(setups) - set(SETUPS))
    if bad:
        raise SystemExit(f"unknown scenarios or setups: {bad}")
    started = datetime.now(UTC)
    load_before = os.getloadavg()
    tables: dict[str, dict[str, dict[str, Any]]] = {}
    counts: dict[str, dict[str, int]] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-sharing-") as tmp:
        scratch = Path(tmp)
        for scenario in scenarios:
            rate = {"light": args.light, "heavy": args.heavy, "idle": 1.0}[scenario]
            traces = {m: scratch / f"{scenario}-{m}.jsonl" for m in MODELS}
            counts[scenario] = {
                "code": write_window(args.code_trace, traces["code"], args.seconds, rate),
                "chat": write_window(
                    args.chat_trace,
                    traces["chat"],
                    args.seconds,
                    rate,
                    (args.burst, args.period) if scenario == "idle" else None,
                ),
            }
            rows: dict[str, dict[str, Any]] = {}
            for setup in setups:
                if setup == "sleep-l2" and scenario != "idle":
                    continue
                rows[setup] = await run_setup(setup, traces, scratch, args)
                print(f"  {scenario}/{setup}: {json.dumps(rows[setup])[:400]}", flush=True)
            tables[scenario] = rows
    load_after = os.getloadavg()
    load_text = " ".join(f"{a:.2f}" for a in load_before) + " -> "
    load_text += " ".join(f"{a:.2f}" for a in load_after)
    found = {}
    for scenario, rows in tables.items():
        print_table(f"{scenario} ({counts[scenario]} requests)", rows)
        found[scenario] = ratios(rows)
        for setup, r in found[scenario].items():
            print(f"  {setup} / own: " + ", ".join(f"{k} {v}" for k, v in r.items()))
    print(f"\nload average {load_text}")
    if args.json:
        record = {
            "method": "gpu-sharing",
            "created_at": started.isoformat(),
            "code_trace": str(args.code_trace),
            "chat_trace": str(args.chat_trace),
            "seconds": args.seconds,
            "light": args.light,
            "heavy": args.heavy,
            "burst_period": [args.burst, args.period],
            "quantum_s": args.quantum,
            "block_tokens": args.block_tokens,
            "max_output": args.max_output,
            "engine_speedup": args.speedup,
            "requests": counts,
            "tables": tables,
            "ratios_to_own": found,
            "load_average": load_text,
            "cpus": len(os.sched_getaffinity(0)),
        }
        await asyncio.to_thread(Path(args.json).write_text, json.dumps(record, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--code-trace", type=Path, required=True, help="Azure code CSV, in place")
    parser.add_argument("--chat-trace", type=Path, required=True, help="Mooncake JSONL, in place")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--seconds", type=float, default=120.0, help="emulated seconds per run")
    parser.add_argument("--light", type=float, default=0.5, help="light load: x the trace rate")
    parser.add_argument("--heavy", type=float, default=2.0, help="heavy load: x the trace rate")
    parser.add_argument("--burst", type=float, default=15.0, help="idle scenario: seconds on")
    parser.add_argument("--period", type=float, default=60.0, help="idle scenario: period")
    parser.add_argument("--quantum", type=float, default=30.0, help="sleep: least time awake")
    parser.add_argument("--block-tokens", type=int, default=128)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--speedup", type=float, default=2.0, help="engines' pace vs the H200")
    parser.add_argument("--json", default="", help="write the record here")
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
