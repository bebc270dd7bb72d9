"""Scheduler overhead of one emulator process holding N concurrent streams.

    .venv/bin/python benchmarks/emulator_scheduler_overhead.py            # 256 streams, ~40 s
    .venv/bin/python benchmarks/emulator_scheduler_overhead.py --streams 512 --profile llm-d-h100-8b

Starts `tandem emulate` (real time, speed-up 1, the default timing profile unless --profile), opens
N streaming completions at once and, once all N are decoding, samples the engine's own accounting
(`GET /emulator/stats`) over a window. It reports the scheduler's CPU time per step (schedule +
KV-cache bookkeeping + token sampling + output hand-off, measured with the engine thread's CPU clock)
as a ratio to the simulated step time, the target being <= 5 %, beside the whole process's CPU
(HTTP and SSE included) per wall second, for context. Waking the N HTTP handlers after each step
(the engine-to-frontend hand-off, a separate process in vLLM) is reported on its own line. Every
loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from tandem.common.ports import free_port

ROOT = Path(__file__).resolve().parents[1]


def process_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], stop: asyncio.Event
) -> int:
    """Read one SSE stream to its end (or until `stop`); returns the bytes received."""
    received = 0
    async with session.post(url, json=body) as response:
        response.raise_for_status()
        async for chunk in response.content.iter_any():
            received += len(chunk)
            if stop.is_set():
                break
    return received


async def stats(session: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    async with session.get(base + "/emulator/stats") as response:
        return dict(await response.json())


async def measure(
    base: str, pid: int, streams: int, prompt_words: int, window_s: float
) -> dict[str, Any]:
    prompt = " ".join(f"word{i % 97}" for i in range(prompt_words))
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": 4000,
        "stream": True,
        "ignore_eos": True,
    }
    stop = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=streams + 8)
    timeout = aiohttp.ClientTimeout(total=window_s * 4 + 120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = [
            asyncio.create_task(stream(session, base + "/v1/completions", body, stop))
            for _ in range(streams)
        ]
        deadline = time.monotonic() + 60
        while True:  # wait until every stream is decoding (all prefills done)
            s = await stats(session, base)
            if s["running"] >= streams and s["waiting"] == 0 and s["max_batch"] >= streams:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {s['running']} of {streams} streams running")
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)  # settle
        s0, cpu0, t0 = await stats(session, base), process_cpu_seconds(pid), time.monotonic()
        await asyncio.sleep(window_s)
        s1, cpu1, t1 = await stats(session, base), process_cpu_seconds(pid), time.monotonic()
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    steps = s1["steps"] - s0["steps"]
    sched_cpu = s1["scheduler_cpu_s"] - s0["scheduler_cpu_s"]
    handoff = s1["handoff_cpu_s"] - s0["handoff_cpu_s"]
    simulated = s1["simulated_s"] - s0["simulated_s"]
    tokens = s1["tokens"] - s0["tokens"]
    wall = t1 - t0
    return {
        "streams": streams,
        "window_s": round(wall, 2),
        "steps": steps,
        "tokens_per_step": round(tokens / steps, 1) if steps else 0,
        "simulated_step_ms": round(1000 * simulated / steps, 3) if steps else 0,
        "wall_step_ms": round(1000 * wall / steps, 3) if steps else 0,
        "scheduler_cpu_per_step_us": round(1e6 * sched_cpu / steps, 1) if steps else 0,
        "scheduler_overhead_ratio": round(sched_cpu / simulated, 4) if simulated else 0,
        "handoff_cpu_per_step_us": round(1e6 * handoff / steps, 1) if steps else 0,
        "scheduler_plus_handoff_ratio": round((sched_cpu + handoff) / simulated, 4)
        if simulated
        else 0,
        "process_cpu_per_wall_s": round((cpu1 - cpu0) / wall, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--prompt-words", type=int, default=200)
    parser.add_argument("--window", type=float, default=10.0, help="measurement window, seconds")
    parser.add_argument("--profile", default=None, help="timing profile (default: the emulator's)")
    parser.add_argument("--target", type=float, default=0.05)
    args = parser.parse_args()
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "tandem.cli",
        "emulate",
        "--served-model-name",
        "bench",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-num-seqs",
        str(max(256, args.streams)),
        "--max-model-len",
        "8192",
        "--log-level",
        "warning",
    ]
    if args.profile:
        argv += ["--timing-profile", args.profile]
    proc = subprocess.Popen(argv, cwd=ROOT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", port), timeout=0.5),
            ):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the emulator did not start")
            time.sleep(0.1)
        result = asyncio.run(measure(base, proc.pid, args.streams, args.prompt_words, args.window))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    print(json.dumps(result, indent=1))
    ratio = result["scheduler_overhead_ratio"]
    verdict = "OK" if ratio <= args.target else "ABOVE TARGET"
    print(
        f"scheduler CPU / simulated step time = {100 * ratio:.2f} % (target <= {100 * args.target:.0f} %): {verdict}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
