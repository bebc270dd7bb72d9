"""Reproduce the study's serving findings on local emulated clusters and plot them (docs/findings.md).

    .venv/bin/python benchmarks/findings.py                    # all three, H200 profile, ~6 min
    .venv/bin/python benchmarks/findings.py --only prefix      # one of: queue, prefix, pd

Each experiment starts ServingClusters from the example manifests with `tandem up`'s runtime
(emulated engines with the H200-measured timing profile, the real router) and measures them with
`tandem bench`'s client, one configuration after the other on the same machine:

1. queue   — queueing's share of end-to-end latency as the offered load rises (one engine).
2. prefix  — TTFT with prefix caching on vs off, as the shared part of each prompt grows.
3. pd      — prefill/decode disaggregation vs colocated engines, same GPU count, on a mix of long
             documents and short chats: inter-token latency and TTFT.

Records (the full `tandem bench` JSON of every run) go under --records; PNGs under --plots.
Tables and plots give emulated-H200 milliseconds: measured times multiplied by --speedup.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import matplotlib.ticker as ticker
import numpy as np
import uvloop
from matplotlib.axis import Axis
from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table

from tandem.bench.records import BenchRecord
from tandem.bench.runner import RunOptions, Target, run_target
from tandem.bench.spec import SLO, FixedQPS, LengthDist, Mixed, SharedPrefix
from tandem.local.cluster import DEFAULT_PROFILE, LocalCluster, free_port, load_cluster
from tandem.local.plan import LocalOptions

ROOT = Path(__file__).resolve().parents[1]
PD_EXAMPLE = ROOT / "examples" / "llama-8b-pd.yaml"
COLOCATED_EXAMPLE = ROOT / "examples" / "llama-8b-colocated.yaml"
console = Console()
STALL_MS = 100  # an inter-token pause a reader notices


def plain_log_axis(axis: Axis) -> None:
    """Label a log axis with plain numbers (40, 60, 100, ...) rather than powers of ten."""
    plain = ticker.FuncFormatter(lambda v, _: f"{v:g}")
    axis.set_major_formatter(plain)
    axis.set_minor_formatter(plain)


def all_gaps(record: BenchRecord) -> np.ndarray:
    """Every inter-token gap (ms) of the run's successful requests."""
    return np.asarray([g for r in record.requests if r.ok for g in r.itl_ms], dtype=float)


def stalled_share(record: BenchRecord, klass: str, threshold_ms: float) -> float:
    """Fraction of a class's requests whose stream paused longer than `threshold_ms` at least once."""
    requests = [r for r in record.requests if r.ok and r.klass == klass and r.itl_ms]
    return sum(max(r.itl_ms) > threshold_ms for r in requests) / len(requests) if requests else 0.0


class Study:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        self.records_dir: Path = args.records / self.stamp
        self.options = RunOptions(progress=not args.quiet, slo=SLO(ttft_ms=1000, itl_ms=50))
        # 1-minute load average when each cluster started: this machine is shared, and emulated
        # engines are sensitive to CPU contention, so every table says how busy it was.
        self.load: dict[str, float] = {}

    async def measure(
        self,
        manifest: Path,
        sets: Sequence[str],
        label: str,
        workloads: Sequence[FixedQPS | Mixed | SharedPrefix],
        engine_args: Sequence[str] = (),
    ) -> list[BenchRecord]:
        """Start one cluster, run each workload against its router in turn, stop it."""
        sc = load_cluster(manifest, list(sets))
        options = LocalOptions(
            timing_profile=self.args.profile,
            speedup=self.args.speedup,
            router_port=free_port(),
            engine_extra_args=tuple(engine_args),
        )
        run_dir = self.records_dir / "clusters" / label
        records = []
        self.load[label] = os.getloadavg()[0]
        async with LocalCluster(sc, options, run_dir) as plan:
            config = {"manifest": str(manifest.relative_to(ROOT)), "sets": list(sets), "engine_args": list(engine_args),
                      "timing_profile": self.args.profile, "speedup": self.args.speedup}  # fmt: skip
            for number, workload in enumerate(workloads):
                target = Target(
                    label=f"{label}-{number}",
                    url=plan.endpoint,
                    metrics=plan.metrics_urls(),
                    config=config,
                )
                record = await run_target(target, workload, self.options, console)
                record.save(self.records_dir / f"{record.label}.json")
                records.append(record)
        return records

    # --- 1. queueing share vs load -------------------------------------------------------------

    async def queue(self) -> None:
        """One engine limited to 16 concurrent sequences; Poisson load from light to overload."""
        rates = [2.0, 6.0, 10.0, 13.0, 16.0, 19.0]
        workloads = [
            FixedQPS(
                qps=qps * self.args.speedup,
                num_requests=max(30, int(qps * 8)),
                seed=11,
                warmup_requests=4,
                input=LengthDist(kind="lognormal", mean=1024, sigma=0.5, low=64, high=4096),
                output=LengthDist(kind="lognormal", mean=128, sigma=0.4, low=16, high=512),
            )
            for qps in rates
        ]
        sets = ["spec.decode.replicas=1", "spec.decode.maxNumSeqs=16"]
        records = await self.measure(COLOCATED_EXAMPLE, sets, "queue", workloads)
        shares = [100 * (r.queue_share or 0.0) for r in records]
        fig, ax = plt.subplots(figsize=(8, 4.5))
        ax.bar(
            [f"{q:g}" for q in rates],
            shares,
            color="tab:red",
            alpha=0.75,
            label="queueing share of mean E2E",
        )
        ax.axhline(40, color="grey", linestyle="--", linewidth=1)
        ax.text(0, 41, "40%", color="grey", fontsize=8)
        ax.set_xlabel("offered load (requests/s, Poisson)")
        ax.set_ylabel("queueing share of end-to-end latency (%)")
        ax.set_ylim(0, 100)
        twin = ax.twinx()
        twin.plot(
            range(len(rates)),
            [self.h200(r.summary.e2e_ms.p50) for r in records],
            "o-",
            color="tab:blue",
            label="E2E p50",
        )
        twin.plot(
            range(len(rates)),
            [self.h200(r.summary.ttft_ms.p99) for r in records],
            "s--",
            color="tab:purple",
            label="TTFT p99",
        )
        twin.set_yscale("log")
        plain_log_axis(twin.yaxis)
        twin.set_ylabel("latency (ms)")
        handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        ax.legend(handles=handles, loc="upper left", fontsize=8)
        ax.set_title(
            "Queueing dominates end-to-end latency as load rises\n(one emulated H200 engine, Llama-3.1-8B profile, max 16 sequences)"
        )
        self.save(fig, "findings-queue-share.png")
        rows = [
            (f"{q:g}", f"{r.summary.request_rate:.2f}", f"{s:.0f}%", f"{self.h200(r.summary.ttft_ms.p50):.0f}", f"{self.h200(r.summary.ttft_ms.p99):.0f}",
             f"{self.h200(r.summary.e2e_ms.p50):.0f}", f"{r.engine.max_waiting or 0:.0f}")
            for q, r, s in zip(rates, records, shares, strict=True)
        ]  # fmt: skip
        self.table(
            "queueing share vs load",
            [
                "offered qps",
                "served req/s",
                "queue share",
                "TTFT p50",
                "TTFT p99",
                "E2E p50",
                "peak waiting",
            ],
            rows,
        )

    # --- 2. prefix caching vs share ratio ------------------------------------------------------

    async def prefix(self) -> None:
        """4k-token prompts in 4 groups; the group's shared system prompt is `ratio` of each."""
        ratios = [0.0, 0.25, 0.5, 0.75, 0.9, 0.97]

        def workload(i: int, ratio: float) -> SharedPrefix:
            return SharedPrefix(
                qps=3 * self.args.speedup, num_requests=30, groups=4, share_ratio=ratio, seed=100 + i, warmup_requests=8,
                input=LengthDist(kind="fixed", mean=4096), output=LengthDist(kind="fixed", mean=16),
            )  # fmt: skip

        workloads = [workload(i, r) for i, r in enumerate(ratios)]
        sets = ["spec.decode.replicas=1"]
        cached = await self.measure(COLOCATED_EXAMPLE, sets, "prefix-on", workloads)
        uncached = await self.measure(
            COLOCATED_EXAMPLE, sets, "prefix-off", workloads, ["--no-enable-prefix-caching"]
        )
        on = [self.h200(r.summary.ttft_ms.p50) for r in cached]
        off = [self.h200(r.summary.ttft_ms.p50) for r in uncached]
        gains = [o / c if c else 0.0 for o, c in zip(off, on, strict=True)]
        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
        x = [100 * r for r in ratios]
        left.plot(x, off, "s--", label="prefix caching off")
        left.plot(x, on, "o-", label="prefix caching on")
        left.set_xlabel("shared part of each 4k-token prompt (%)")
        left.set_ylabel("TTFT p50 (ms)")
        left.set_yscale("log")
        plain_log_axis(left.yaxis)
        left.legend(fontsize=8)
        left.grid(True, which="both", alpha=0.3)
        right.bar([f"{v:g}%" for v in x], gains, color="tab:green")
        right.bar_label(right.containers[0], labels=[f"{g:.1f}x" for g in gains], fontsize=8)
        right.set_xlabel("shared part of each prompt")
        right.set_ylabel("TTFT gain (off / on)")
        fig.suptitle(
            "Prefix caching: multi-fold TTFT gains only when prefixes are really shared\n(one emulated H200 engine, Llama-3.1-8B profile, 3 req/s)"
        )
        self.save(fig, "findings-prefix-caching.png")
        rows = [
            (
                f"{100 * r:g}%",
                f"{o:.0f}",
                f"{c:.0f}",
                f"{g:.1f}x",
                f"{100 * (rec.engine.prefix_hit_rate or 0):.0f}%",
            )
            for r, o, c, g, rec in zip(ratios, off, on, gains, cached, strict=True)
        ]
        self.table(
            "prefix caching vs share ratio",
            ["shared", "TTFT p50 off", "TTFT p50 on", "gain", "hit rate (on)"],
            rows,
        )

    # --- 3. P/D vs colocated --------------------------------------------------------------------

    async def pd(self) -> None:
        """Two GPUs either way: 1 prefill + 1 decode engine (P/D) or 2 colocated engines.

        Half the requests are ~8k-token documents, half short chats; the router sends only the
        documents through a prefill engine (minUncachedTokens 1024), as its auto mode intends.
        """
        workload = Mixed(
            qps=3 * self.args.speedup, num_requests=self.args.pd_requests, seed=7, warmup_requests=6, long_fraction=0.5,
            short_input=LengthDist(kind="lognormal", mean=200, sigma=0.4, low=32, high=600),
            long_input=LengthDist(kind="lognormal", mean=8000, sigma=0.2, low=4096, high=15000),
            output=LengthDist(kind="fixed", mean=128), long_output=LengthDist(kind="fixed", mean=128),
        )  # fmt: skip
        pd_sets = [
            "spec.prefill.replicas=1",
            "spec.decode.replicas=1",
            "spec.router.disaggregation.minUncachedTokens=1024",
        ]
        colocated = (
            await self.measure(
                COLOCATED_EXAMPLE, ["spec.decode.replicas=2"], "colocated", [workload]
            )
        )[0]
        pd = (await self.measure(PD_EXAMPLE, pd_sets, "pd", [workload]))[0]
        fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
        for record, style in ((colocated, "-"), (pd, "--")):
            gaps = np.sort(self.h200_array(all_gaps(record)))
            left.plot(
                gaps,
                np.arange(1, gaps.size + 1) / gaps.size,
                style,
                label=record.label.rsplit("-", 1)[0],
            )
        left.set_xscale("log")
        left.set_ylim(0.9, 1.0005)
        left.set_xlim(left=1)
        plain_log_axis(left.xaxis)
        left.set_xlabel("inter-token latency (ms)")
        left.set_ylabel("fraction of token gaps (top 10%)")
        left.grid(True, which="both", alpha=0.3)
        left.legend(fontsize=8)
        left.set_title("inter-token latency tail, all requests")
        metrics: list[tuple[str, Callable[[BenchRecord], float | None]]] = [
            ("ITL p50", lambda r: r.summary.itl_ms.p50),
            ("ITL p99", lambda r: r.summary.itl_ms.p99),
            ("ITL p99.9", lambda r: float(np.percentile(all_gaps(r), 99.9))),
            ("engine-side ITL p99", lambda r: r.engine.itl_ms_p99),
            ("TTFT p50 long", lambda r: r.by_class["long"].ttft_ms.p50),
            ("TTFT p90 long", lambda r: r.by_class["long"].ttft_ms.p90),
            ("TTFT p50 short", lambda r: r.by_class["short"].ttft_ms.p50),
            ("TTFT p90 short", lambda r: r.by_class["short"].ttft_ms.p90),
            ("E2E p50", lambda r: r.summary.e2e_ms.p50),
        ]
        y = np.arange(len(metrics))
        for offset, record, name in ((-0.2, colocated, "colocated"), (0.2, pd, "P/D")):
            values = [self.h200(read(record)) for _, read in metrics]
            bars = right.barh(y + offset, values, 0.4, label=name)
            right.bar_label(
                bars,
                labels=[f"{v:,.0f}" if v >= 10 else f"{v:.1f}" for v in values],
                fontsize=7,
                padding=2,
            )
        right.set_yticks(y, [m for m, _ in metrics])
        right.invert_yaxis()
        right.set_xscale("log")
        right.set_xlabel("ms")
        right.legend(fontsize=8)
        right.set_title("latency by request class")
        fig.suptitle(
            "P/D disaggregation vs colocated on long prompts (2 emulated H200 engines each; half the requests ~8k-token documents)"
        )
        self.save(fig, "findings-pd-vs-colocated.png")
        rows = []
        for m, read in metrics:
            a, b = self.h200(read(colocated)), self.h200(read(pd))
            rows.append((m, f"{a:.1f}", f"{b:.1f}", f"{b / a if a else 0:.2f}x"))
        stalls = [
            100 * float(np.mean(self.h200_array(all_gaps(r)) > STALL_MS)) for r in (colocated, pd)
        ]
        rows.append((f"token gaps > {STALL_MS} ms (%)", f"{stalls[0]:.2f}", f"{stalls[1]:.2f}", ""))
        for klass in ("short", "long"):
            hit = [
                100 * stalled_share(r, klass, STALL_MS / self.args.speedup) for r in (colocated, pd)
            ]
            rows.append(
                (
                    f"{klass} requests with a gap > {STALL_MS} ms (%)",
                    f"{hit[0]:.0f}",
                    f"{hit[1]:.0f}",
                    "",
                )
            )
        kv = self.h200(pd.engine.kv_transfer_ms_per_request)
        handoff = self.h200(pd.engine.router_ms_per_request.get("kv_handoff"))
        rows.append(
            (
                "P/D: NIXL transfer / router KV handoff per request",
                "",
                f"{kv:.1f} / {handoff:.1f}",
                "",
            )
        )
        rows.append(
            ("load average at start", f"{self.load['colocated']:.1f}", f"{self.load['pd']:.1f}", "")
        )
        self.table("P/D vs colocated", ["metric (ms)", "colocated", "P/D", "P/D / colocated"], rows)

    def h200(self, measured_ms: float | None) -> float:
        """Milliseconds of the emulated H200: what was measured times the emulator's speed-up."""
        return float((measured_ms or 0.0) * self.args.speedup)

    def h200_array(self, measured_ms: np.ndarray) -> np.ndarray:
        return np.asarray(measured_ms * float(self.args.speedup), dtype=float)

    # --- output --------------------------------------------------------------------------------

    def save(self, fig: Figure, name: str) -> None:
        self.args.plots.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(self.args.plots / name, dpi=110)
        plt.close(fig)
        console.print(f"wrote {self.args.plots / name}")

    def table(self, title: str, columns: list[str], rows: Sequence[Sequence[str]]) -> None:
        table = Table(title=title, title_justify="left")
        for column in columns:
            table.add_column(column, justify="right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
        summary = self.records_dir / "summary.json"
        data = json.loads(summary.read_text()) if summary.is_file() else {}
        data[title] = {
            "columns": columns,
            "rows": [list(r) for r in rows],
            "load_average": dict(self.load),
        }
        console.print(
            "1-minute load average when each cluster started: "
            + ", ".join(f"{k} {v:.1f}" for k, v in self.load.items())
        )
        summary.write_text(json.dumps(data, indent=1))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only",
        choices=["queue", "prefix", "pd"],
        action="append",
        help="run only these experiments",
    )
    parser.add_argument("--profile", default=str(DEFAULT_PROFILE), help="emulator timing profile")
    parser.add_argument(
        "--speedup",
        type=float,
        default=1.0,
        help="emulator speed-up (1 = H200 real time); arrival rates scale with it so the emulated load "
        "stays the same and latencies divide by it; below 1 gives the CPU more headroom per emulated second",
    )
    parser.add_argument(
        "--pd-requests", type=int, default=120, help="requests of the P/D experiment"
    )
    parser.add_argument("--plots", type=Path, default=ROOT / "docs" / "img")
    parser.add_argument("--records", type=Path, default=ROOT / "out" / "findings")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    study = Study(args)
    study.records_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    async def run() -> None:
        for name in args.only or ["queue", "prefix", "pd"]:
            console.rule(name)
            await getattr(study, name)()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(run())
    console.print(f"done in {time.monotonic() - started:.0f} s; records under {study.records_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
