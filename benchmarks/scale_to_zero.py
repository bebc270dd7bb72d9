"""Scale-from-zero time to first token with `tandem up` and emulator engines, on 127.0.0.1.

Runs one ServingCluster with `scaleToZero` (idle window `--idle` seconds) and, for `--cycles`
rounds: waits until both pools are at zero, sends one streamed chat request with a prompt no
engine has seen (held by the router while the decode engine starts), then one more right after
(warm). Prints each round's TTFT from zero and warm, their medians and ratio, and the load
average. A cold request is timed from sending to its first content chunk, so it includes the
wake decision (the local loop reads the router every 0.5 s), the engine process's start and the
router's health check of it.

    python benchmarks/scale_to_zero.py                       # 5 rounds, the P/D example
    python benchmarks/scale_to_zero.py --cycles 3 --speedup 1
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tandem.bench.first_token import OutputLines, first_content_s  # noqa: E402
from tandem.common.ports import free_port  # noqa: E402


def first_token_s(port: int, prompt: str) -> tuple[float, str]:
    seconds, headers = first_content_s(port, "llama-8b", prompt)
    return seconds, headers["x-tandem-route"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--manifest", type=Path, default=ROOT / "examples" / "llama-8b-pd.yaml")
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--idle", type=float, default=3.0)
    parser.add_argument("--speedup", type=float, default=1.0)
    parser.add_argument("--prompt-words", type=int, default=600)
    args = parser.parse_args()
    port = free_port()
    command = [
        sys.executable, "-m", "tandem.cli", "up", str(args.manifest), "--port", str(port),
        "--prefill", "1", "--decode", "1", "--speedup", f"{args.speedup:g}",
        "--set", "spec.autoscaling.scaleToZero.enabled=true",
        "--set", f"spec.autoscaling.scaleToZero.idleSeconds={args.idle:g}",
        "--set", "spec.autoscaling.scaleToZero.wakeTimeoutSeconds=120",
    ]  # fmt: skip
    env = os.environ | {"COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    up = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT
    )
    wait_for = OutputLines(up).wait_for

    words = " ".join(["token"] * args.prompt_words)
    cold: list[float] = []
    warm: list[float] = []
    loads: list[float] = []
    try:
        wait_for("ready", 180)
        first_token_s(port, f"warm-up {words}")
        for cycle in range(args.cycles):
            wait_for("decode: 1 -> 0", args.idle + 60)
            time.sleep(1.0)  # the pools' processes are gone
            cold_s, cold_route = first_token_s(port, f"cold {cycle} {words}")
            warm_s, warm_route = first_token_s(port, f"warm {cycle} {words}")
            loads.append(os.getloadavg()[0])
            cold.append(cold_s)
            warm.append(warm_s)
            print(
                f"round {cycle + 1}: TTFT from zero {cold_s:.3f}s ({cold_route}), "
                f"warm {warm_s:.3f}s ({warm_route}), load {loads[-1]:.1f}",
                flush=True,
            )
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)
    c, w = statistics.median(cold), statistics.median(warm)
    print(
        f"median TTFT from zero {c:.3f}s, warm {w:.3f}s, ratio {c / w:.1f}x over {len(cold)} rounds; "
        f"1-min load average {min(loads):.1f}-{max(loads):.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
