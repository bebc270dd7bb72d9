"""Replay a day-shaped, time-compressed trace against the P:D planner, today's independent
autoscaler and every fixed P:D split, on the emulator's H200 timing profile (benchmarks/pd_sim.py).

    .venv/bin/python benchmarks/planner_replay.py --trace TRACES/azure_llm_2023_code.csv

The trace's requests (prompt and output tokens, in their order and with their local burstiness)
are tiled until the day holds `peak-rps * mean(shape) * day-s` of them, and their arrival times
are warped so that the rate follows the day curve shape(hour) = trough + (1 - trough) *
sin^2(pi * (hour - peak + 12) / 24) (highest at `peak`, 15:00 by default, lowest 12 hours
away), the whole day compressed into `day-s` seconds. `--also` mixes in a second trace on its
own curve (say conversations peaking at 21:00), so that the traffic mix, not only its volume,
changes over the day. Every evaluation calls the real decision functions: `decide` of
tandem/operator/autoscaling/decision.py per pool, and `plan` of planner.py, on the metrics the
simulation produces, with the same targets.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pd_sim import Policy, PoolWindow, Request, Result, Role, SimConfig, Simulation

from tandem.bench.traces import TraceRow, read_trace
from tandem.common.capacity import StepCost
from tandem.emulator.profile import load_profile
from tandem.operator.api import AutoscalingSpec
from tandem.operator.autoscaling.decision import ScalingMemory, decide
from tandem.operator.autoscaling.planner import (
    PlannerMemory,
    PlannerPolicy,
    plan,
)
from tandem.operator.autoscaling.planner_signals import PlannerSignals, PoolLoad
from tandem.operator.autoscaling.policy import pool_policies
from tandem.operator.autoscaling.signals import PoolSignals


def day_shape(hour: np.ndarray, trough: float, peak_hour: float = 15.0) -> np.ndarray:
    return trough + (1 - trough) * np.sin(np.pi * (hour - peak_hour + 12) / 24) ** 2


def day_requests(
    rows: Sequence[TraceRow],
    day_s: float,
    peak_rps: float,
    trough: float,
    peak_hour: float = 15.0,
) -> list[Request]:
    """The trace tiled and time-warped onto the day curve (see the module docstring)."""
    grid = np.linspace(0.0, day_s, 20001)
    rate = day_shape(grid / day_s * 24, trough, peak_hour)
    cumulative = np.concatenate([[0.0], np.cumsum((rate[1:] + rate[:-1]) / 2 * np.diff(grid))])
    count = round(peak_rps * cumulative[-1])
    span = rows[-1].at_s + (rows[-1].at_s / max(len(rows) - 1, 1))
    positions = []
    for index in range(count):
        tile, row = divmod(index, len(rows))
        positions.append((tile * span + rows[row].at_s, rows[row]))
    total = positions[-1][0] if positions else 1.0
    share = np.array([p for p, _ in positions]) / max(total, 1e-9)
    arrivals = np.interp(share * cumulative[-1], cumulative, grid)
    return [
        Request(arrival=float(at), prompt=row.input_tokens, output=row.output_tokens)
        for at, (_, row) in zip(arrivals, positions, strict=True)
    ]


@dataclass(frozen=True)
class Targets:
    ttft_s: float  # end-to-end SLO
    tpot_s: float
    prefill_ttft_target_s: float  # what the autoscalers aim the prefill pool's TTFT at
    itl_target_s: float


def autoscaling_spec(args: argparse.Namespace, targets: Targets) -> AutoscalingSpec:
    return AutoscalingSpec.model_validate(
        {
            "enabled": True,
            "intervalSeconds": args.interval,
            "metricsWindowSeconds": args.window,
            "scaleDownStabilizationSeconds": args.stabilization,
            "prefill": {
                "min": 1,
                "max": args.max_prefill,
                "targetTTFTSeconds": targets.prefill_ttft_target_s,
            },
            "decode": {"min": 1, "max": args.max_decode, "targetITLSeconds": targets.itl_target_s},
        }
    )


def independent(spec: AutoscalingSpec) -> Policy:
    """Today's autoscaler: `decide` per pool on that pool's own signals."""
    policies = pool_policies(spec)
    states: dict[Role, ScalingMemory] = {}

    def evaluate(now: float, windows: dict[Role, PoolWindow]) -> dict[Role, int]:
        sizes = {}
        for pool, w in windows.items():
            signals = PoolSignals(
                pool=pool,
                engines=w.engines,
                latency_s=w.latency_quantile_s,
                waiting=w.waiting,
                running=w.running,
                kv_usage=w.kv_usage,
                request_rate=w.request_rate,
            )
            decision, states[pool] = decide(
                policies[pool], signals, w.current, w.ready, states.get(pool, ScalingMemory()), now
            )
            sizes[pool] = decision.desired
        return sizes

    return evaluate


def planner(policy: PlannerPolicy) -> Policy:
    """The planner: `plan` for both pools on the offered load and the pools' operating points."""
    memory = PlannerMemory()

    def evaluate(now: float, windows: dict[Role, PoolWindow]) -> dict[Role, int]:
        nonlocal memory
        p, d = windows["prefill"], windows["decode"]
        signals = PlannerSignals(
            prompt_tokens_per_s=p.tokens_per_s,
            output_tokens_per_s=d.tokens_per_s,
            prompt_tokens_per_request=p.tokens_per_request,
            output_tokens_per_request=d.tokens_per_request,
            prefill=PoolLoad(
                engines=p.engines,
                waiting=p.waiting,
                running=p.running,
                latency_s=p.latency_mean_s,
                queue_s=p.queue_mean_s,
            ),
            decode=PoolLoad(
                engines=d.engines, waiting=d.waiting, running=d.running, latency_s=d.latency_mean_s
            ),
        )
        result, memory = plan(
            policy, signals, {"prefill": p.current, "decode": d.current}, memory, now
        )
        return {pool: decision.desired for pool, decision in result.decisions.items()}

    return evaluate


@dataclass(frozen=True)
class Row:
    name: str
    result: Result
    targets: Targets
    day_s: float

    @property
    def attainment(self) -> float:
        return self.result.attainment(self.targets.ttft_s, self.targets.tpot_s)

    def cells(self) -> list[str]:
        served = [r for r in self.result.requests if r.done >= 0 and not r.dropped]
        ttft = sorted(r.ttft for r in served)
        tpot = sorted(r.tpot for r in served if r.output > 1)
        n = len(self.result.requests)
        ttft_ok = sum(1 for r in served if r.ttft <= self.targets.ttft_s) / n
        tpot_ok = sum(1 for r in served if r.tpot <= self.targets.tpot_s) / n
        sizes = self.result.sizes
        p = [s[1] for s in sizes] or [0]
        d = [s[2] for s in sizes] or [0]
        return [
            self.name,
            f"{self.attainment:.1%}",
            f"{ttft_ok:.1%}",
            f"{tpot_ok:.1%}",
            f"{_q(ttft, 0.5):.2f} / {_q(ttft, 0.9):.2f} / {_q(ttft, 0.99):.2f}",
            f"{_q(tpot, 0.9) * 1000:.1f}",
            f"{self.result.gpu_seconds:,.0f}",
            f"{self.result.gpu_seconds / self.day_s:.2f}",
            str(self.result.failed),
            f"{statistics.fmean(p):.1f} ({max(p)})" if sizes else "-",
            f"{statistics.fmean(d):.1f} ({max(d)})" if sizes else "-",
        ]


HEADER = [
    "policy",
    "SLO attainment",
    "TTFT ok",
    "TPOT ok",
    "TTFT p50/p90/p99 (s)",
    "TPOT p90 (ms)",
    "GPU-s",
    "mean GPUs",
    "failed",
    "prefill pods mean (max)",
    "decode pods mean (max)",
]


def _q(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else math.nan


def markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _fresh(requests: list[Request]) -> list[Request]:
    return [Request(r.arrival, r.prompt, r.output) for r in requests]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--profile", default="h200-llama-3.1-8b")
    parser.add_argument("--day-s", type=float, default=1800.0, help="the day, compressed")
    parser.add_argument("--peak-rps", type=float, default=120.0)
    parser.add_argument("--trough", type=float, default=0.25, help="night rate / peak rate")
    parser.add_argument("--startup", type=float, default=30.0, help="pod start-up seconds")
    parser.add_argument("--interval", type=float, default=15.0)
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("--stabilization", type=float, default=120.0)
    parser.add_argument("--max-prefill", type=int, default=16)
    parser.add_argument("--max-decode", type=int, default=8)
    parser.add_argument("--slo-ttft", type=float, default=1.0)
    parser.add_argument("--slo-tpot", type=float, default=0.05)
    parser.add_argument("--target-ttft", type=float, default=0.75, help="prefill pool target")
    parser.add_argument("--target-itl", type=float, default=0.05)
    parser.add_argument(
        "--also",
        type=Path,
        help="a second trace mixed in on its own day curve (e.g. conversations in the evening)",
    )
    parser.add_argument("--also-peak-rps", type=float, default=5.0)
    parser.add_argument("--also-peak-hour", type=float, default=21.0)
    parser.add_argument("--fixed-decode", default="1,2,3", help="decode sizes of the fixed grid")
    parser.add_argument("--no-fixed", action="store_true", help="skip the fixed-split grid")
    parser.add_argument(
        "--start", default="1:1", help="prefill:decode pods the autoscalers start the day with"
    )
    parser.add_argument(
        "--planners",
        default="0.8:1.28:0.3",
        help="planner variants targetUtilization:forecastSigmas:alpha, comma-separated",
    )
    args = parser.parse_args(argv)

    profile = load_profile(args.profile)
    requests = day_requests(read_trace(args.trace), args.day_s, args.peak_rps, args.trough)
    if args.also is not None:
        requests += day_requests(
            read_trace(args.also), args.day_s, args.also_peak_rps, args.trough, args.also_peak_hour
        )
        requests.sort(key=lambda r: r.arrival)
    config = SimConfig(
        profile=profile,
        startup_s=args.startup,
        interval_s=args.interval,
        metrics_window_s=args.window,
        kv_tokens=profile.num_gpu_blocks(16, 0.9, 8192) * 16,
    )
    targets = Targets(args.slo_ttft, args.slo_tpot, args.target_ttft, args.target_itl)
    spec = autoscaling_spec(args, targets)
    seeded = PlannerPolicy(
        prefill_max=args.max_prefill,
        decode_max=args.max_decode,
        target_ttft_s=targets.prefill_ttft_target_s,
        target_itl_s=targets.itl_target_s,
        step=StepCost.model_validate(profile.step.model_dump()),
        kv_tokens=config.kv_tokens,
        horizon_s=args.startup + args.interval,
        tolerance=spec.tolerance,
        scale_down_stabilization_s=args.stabilization,
    )
    print(
        f"{len(requests)} requests over a {args.day_s:g} s day (peak {args.peak_rps:g} req/s), "
        f"mean prompt {statistics.fmean(r.prompt for r in requests):.0f}, "
        f"mean output {statistics.fmean(r.output for r in requests):.0f} tokens",
        flush=True,
    )
    rows: list[Row] = []
    started = time.monotonic()
    variants = [tuple(float(x) for x in v.split(":")) for v in args.planners.split(",")]
    policies = [
        (
            f"planner u={u:g} k={k:g} a={a:g}",
            planner(
                seeded.model_copy(
                    update={"target_utilization": u, "forecast_sigmas": k, "alpha": a}
                )
            ),
        )
        for u, k, a in variants
    ]
    for name, policy in [*policies, ("independent", independent(spec))]:
        start_p, start_d = (int(n) for n in args.start.split(":"))
        initial: dict[Role, int] = {"prefill": start_p, "decode": start_d}
        result = Simulation(config, _fresh(requests), initial, policy).run()
        rows.append(Row(name, result, targets, args.day_s))
        print(f"  {name}: {time.monotonic() - started:.0f} s", flush=True)
    fixed: list[Row] = []
    peak = max(max(s[1] for s in r.result.sizes) for r in rows)
    for d in () if args.no_fixed else (int(x) for x in args.fixed_decode.split(",")):
        for p in range(1, peak + 3):
            result = Simulation(config, _fresh(requests), {"prefill": p, "decode": d}, None).run()
            fixed.append(Row(f"fixed {p}P:{d}D", result, targets, args.day_s))
    print(f"  {len(fixed)} fixed splits: {time.monotonic() - started:.0f} s", flush=True)
    budget = rows[0].result.gpu_seconds
    affordable = [r for r in fixed if r.result.gpu_seconds <= budget]
    table = [r.cells() for r in rows]
    if affordable:
        best = max(affordable, key=lambda r: (r.attainment, -r.result.gpu_seconds))
        table.append([*best.cells()[:1], *best.cells()[1:]])
        table[-1][0] = f"best fixed at <= planner GPU-s: {best.name}"
    matching = [r for r in fixed if r.attainment >= rows[0].attainment]
    if matching:
        cheapest = min(matching, key=lambda r: r.result.gpu_seconds)
        table.append(cheapest.cells())
        table[-1][0] = f"cheapest fixed at >= planner SLO: {cheapest.name}"
    if fixed:
        best_any = max(fixed, key=lambda r: (r.attainment, -r.result.gpu_seconds))
        table.append(best_any.cells())
        table[-1][0] = f"best fixed overall: {best_any.name}"
    print(markdown(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
