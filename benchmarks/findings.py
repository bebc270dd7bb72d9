"""Reproduce the study's serving findings on local emulated clusters and plot them (docs/findings.md).

    .venv/bin/python benchmarks/findings.py                    # all six, H200 profile, ~15 min
    .venv/bin/python benchmarks/findings.py --only prefix      # queue, prefix, pd, spec, batching,
                                                               # kv-reservation

Each experiment starts ServingClusters from the example manifests with `tandem up`'s runtime
(emulated engines with the H200-measured timing profile, the real router) and measures them with
`tandem bench`'s client, one configuration after the other on the same machine:

1. queue   — queueing's share of end-to-end latency as the offered load rises (one engine).
2. prefix  — TTFT with prefix caching on vs off, as the shared part of each prompt grows.
3. pd      — prefill/decode disaggregation vs colocated engines, same GPU count, on a mix of long
             documents and short chats: inter-token latency and TTFT.
4. spec    — speculative decoding (EAGLE head, k = 4) vs plain decoding: decode speed-up by draft
             acceptance rate and batch size, beside the speed-up the H200 profile predicts.
5. batching — static batching (no joining mid-flight) vs continuous batching, on short dynamic
             load and on uniform long load: throughput and TTFT.
6. kv-reservation — gpuMemoryUtilization x maxNumSeqs against short chats and long documents:
             peak concurrency, preemptions, TTFT p99.

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
from matplotlib.axes import Axes
from matplotlib.axis import Axis
from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table

from tandem.bench.records import BenchRecord
from tandem.bench.runner import RunOptions, Target, run_target
from tandem.bench.spec import SLO, FixedQPS, LengthDist, Mixed, SharedPrefix
from tandem.common.ports import free_port
from tandem.emulator.profile import load_profile
from tandem.local.cluster import DEFAULT_PROFILE, LocalCluster, load_cluster
from tandem.local.plan import LocalOptions

ROOT = Path(__file__).resolve().parents[1]
PD_EXAMPLE = ROOT / "examples" / "llama-8b-pd.yaml"
COLOCATED_EXAMPLE = ROOT / "examples" / "llama-8b-colocated.yaml"
console = Console()
STALL_MS = 100  # an inter-token pause a reader notices
# A static batcher's wait for a fuller batch: long enough that a closed loop's 32 requests, which
# reach the engine over a few hundred ms through the router on a loaded 2-core machine, make one.
STATIC_BATCH_WAIT_S = 0.5


def plain_log_axis(axis: Axis) -> None:
    """Label a log axis with plain numbers (40, 60, 100, ...) rather than powers of ten."""
    plain = ticker.FuncFormatter(lambda v, _: f"{v:g}")
    axis.set_major_formatter(plain)
    axis.set_minor_formatter(plain)


def paired_bars(
    ax: Axes, ticks: Sequence[str], series: Sequence[tuple[str, Sequence[float]]], title: str,
    fontsize: int = 7,
) -> None:  # fmt: skip
    """Two bar series side by side at each tick, labelled with their values; TTFT panels on a
    log scale."""
    x = np.arange(len(ticks))
    for offset, (label, values) in zip((-0.2, 0.2), series, strict=True):
        bars = ax.bar(x + offset, values, 0.4, label=label)
        ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize=fontsize)
    ax.set_xticks(x, ticks)
    ax.set_title(title, fontsize=10)
    if "TTFT" in title:
        ax.set_yscale("log")
        plain_log_axis(ax.yaxis)


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
        cluster = LocalCluster(sc, options, run_dir)
        async with cluster as plan:
            processes = {c.spec.name: c.pid for c in cluster.supervisor.children}
            config = {"manifest": str(manifest.relative_to(ROOT)), "sets": list(sets), "engine_args": list(engine_args),
                      "timing_profile": self.args.profile, "speedup": self.args.speedup}  # fmt: skip
            for number, workload in enumerate(workloads):
                target = Target(
                    label=f"{label}-{number}",
                    url=plan.endpoint,
                    metrics=plan.metrics_urls(),
                    config=config,
                    processes=processes,
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

    # --- 4. speculative decoding ----------------------------------------------------------------

    async def spec(self) -> None:
        """One engine; closed loops of B concurrent requests (1k-token prompts, 256 output tokens)
        with plain decoding, then with an EAGLE head proposing k = 4 tokens at acceptance rates
        standing for hard reasoning (0.3), chat (0.6) and locally regular text such as code and
        summaries (0.8). Decode speed = time per output token; speed-up = plain / speculative."""
        batches = [1, 8, 32, 96]
        rates = [0.3, 0.6, 0.8]
        k = 4

        def workload(batch: int) -> FixedQPS:
            return FixedQPS(
                qps=1000 * self.args.speedup, num_requests=max(6, 2 * batch), seed=21, warmup_requests=2,
                max_concurrency=batch, input=LengthDist(kind="fixed", mean=1024),
                output=LengthDist(kind="fixed", mean=256),
            )  # fmt: skip

        workloads = [workload(b) for b in batches]
        sets = ["spec.decode.replicas=1", "spec.decode.maxNumSeqs=128"]
        plain = await self.measure(COLOCATED_EXAMPLE, sets, "spec-off", workloads)
        speculative = [
            "spec.decode.speculative.method=eagle",
            "spec.decode.speculative.model=yuhuili/EAGLE-LLaMA3.1-Instruct-8B",
            f"spec.decode.speculative.numSpeculativeTokens={k}",
        ]
        runs = {
            rate: await self.measure(COLOCATED_EXAMPLE, sets + speculative, f"spec-{rate:g}",
                                     workloads, ["--spec-acceptance-rate", str(rate)])
            for rate in rates
        }  # fmt: skip
        profile = load_profile(self.args.profile)

        def predicted(rate: float, batch: int) -> float:
            """Tokens per verify step over the step's cost relative to a plain decode step."""
            context = batch * (1024 + 128)
            decode = profile.step_seconds([], batch, context)
            spec = decode + profile.speculative.seconds("eagle", k, batch, context)
            tokens = sum(rate**i for i in range(k + 1))
            return tokens * decode / spec

        def tpot(record: BenchRecord) -> float:
            return self.h200(record.summary.tpot_ms.p50)

        fig, ax = plt.subplots(figsize=(8, 4.8))
        grid = np.linspace(1, 128, 128)
        for rate, color in zip(rates, ("tab:red", "tab:orange", "tab:green"), strict=True):
            ax.plot(grid, [predicted(rate, int(b)) for b in grid], "--", color=color, linewidth=1,
                    label=f"profile prediction, acceptance {rate:g}")  # fmt: skip
            measured = [tpot(p) / tpot(s) for p, s in zip(plain, runs[rate], strict=True)]
            ax.plot(batches, measured, "o-", color=color, label=f"measured, acceptance {rate:g}")
        ax.axhline(1.0, color="grey", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent sequences (batch size)")
        ax.set_ylabel("decode speed-up (plain TPOT / speculative TPOT)")
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(
            f"Speculative decoding (EAGLE head, k = {k}): gains need high acceptance and small batches\n"
            "(one emulated H200 engine, Llama-3.1-8B profile with H200-measured verify steps)"
        )
        self.save(fig, "findings-speculative.png")
        rows = []
        for number, batch in enumerate(batches):
            base = tpot(plain[number])
            row = [str(batch), f"{base:.2f}"]
            for rate in rates:
                ms = tpot(runs[rate][number])
                row.append(f"{ms:.2f} ({base / ms:.2f}x, pred {predicted(rate, batch):.2f}x)")
            rows.append(tuple(row))
        self.table(
            "speculative decoding: TPOT p50 (ms) and speed-up",
            ["batch", "plain", *[f"acceptance {r:g}" for r in rates]],
            rows,
        )

    # --- 5. static vs continuous batching -------------------------------------------------------

    async def batching(self) -> None:
        """One engine with 32 sequence slots, run once with continuous batching and once with
        static batching (--batching static, batches formed after a 0.5 s wait). Short dynamic
        load: Poisson arrivals of short chats with widely spread output lengths. Uniform long
        load: 2k-token prompts, 512 output tokens each, a closed loop of 32."""
        short = FixedQPS(
            qps=12 * self.args.speedup, num_requests=120, seed=31, warmup_requests=4,
            input=LengthDist(kind="lognormal", mean=200, sigma=0.5, low=32, high=1000),
            output=LengthDist(kind="lognormal", mean=96, sigma=0.9, low=8, high=1024),
        )  # fmt: skip
        uniform = FixedQPS(
            qps=1000 * self.args.speedup, num_requests=64, seed=32, warmup_requests=4,
            max_concurrency=32, input=LengthDist(kind="fixed", mean=2048),
            output=LengthDist(kind="fixed", mean=512),
        )  # fmt: skip
        sets = ["spec.decode.replicas=1", "spec.decode.maxNumSeqs=32"]
        continuous = await self.measure(COLOCATED_EXAMPLE, sets, "continuous", [short, uniform])
        static_args = ["--batching", "static", "--static-batch-wait", str(STATIC_BATCH_WAIT_S)]
        static = await self.measure(
            COLOCATED_EXAMPLE, sets, "static", [short, uniform], static_args
        )
        loads = ["short, dynamic", "uniform, long"]
        metrics: list[tuple[str, Callable[[BenchRecord], float]]] = [
            ("output tokens/s", lambda r: r.summary.output_tok_s / self.args.speedup),
            ("TTFT p50 (ms)", lambda r: self.h200(r.summary.ttft_ms.p50)),
            ("TTFT p99 (ms)", lambda r: self.h200(r.summary.ttft_ms.p99)),
            ("E2E p50 (ms)", lambda r: self.h200(r.summary.e2e_ms.p50)),
        ]
        fig, axes = plt.subplots(1, 3, figsize=(13, 4.5))
        for ax, (name, read) in zip(axes, metrics[:3], strict=True):
            series = [(label, [read(r) for r in runs]) for label, runs in
                      (("continuous", continuous), ("static", static))]  # fmt: skip
            paired_bars(ax, loads, series, name)
        axes[0].legend(fontsize=8)
        fig.suptitle(
            "Static vs continuous batching: the gap is large on short dynamic load, small on uniform long load\n"
            "(one emulated H200 engine, 32 sequence slots, Llama-3.1-8B profile)"
        )
        self.save(fig, "findings-batching.png")
        rows = []
        for name, read in metrics:
            for number, load in enumerate(loads):
                c, st = read(continuous[number]), read(static[number])
                rows.append((name, load, f"{c:,.1f}", f"{st:,.1f}", f"{c / st if st else 0:.2f}x"))
        self.table(
            "static vs continuous batching",
            ["metric", "load", "continuous", "static", "continuous / static"],
            rows,
        )

    # --- 6. KV reservation ----------------------------------------------------------------------

    async def kv_reservation(self) -> None:
        """One engine per (gpuMemoryUtilization, maxNumSeqs); the KV pool follows the utilisation
        as vLLM's memory profiling sizes it (the profile's memory model). Short chats: ~400-token
        prompts, ~150 output tokens at 30 req/s. Long documents: ~6k-token prompts, 200 output
        tokens at 5 req/s."""
        utilisations = [0.35, 0.6, 0.9]
        max_seqs = [16, 128]
        chat = FixedQPS(
            qps=30 * self.args.speedup, num_requests=150, seed=41, warmup_requests=4,
            input=LengthDist(kind="lognormal", mean=400, sigma=0.5, low=32, high=2000),
            output=LengthDist(kind="lognormal", mean=150, sigma=0.5, low=16, high=600),
        )  # fmt: skip
        documents = FixedQPS(
            qps=5 * self.args.speedup, num_requests=40, seed=42, warmup_requests=2,
            input=LengthDist(kind="lognormal", mean=6000, sigma=0.3, low=3000, high=12000),
            output=LengthDist(kind="fixed", mean=200),
        )  # fmt: skip
        profile = load_profile(self.args.profile)
        results: dict[tuple[float, int], list[BenchRecord]] = {}
        for util in utilisations:
            for seqs in max_seqs:
                sets = ["spec.decode.replicas=1", f"spec.decode.maxNumSeqs={seqs}",
                        f"spec.decode.gpuMemoryUtilization={util}"]  # fmt: skip
                results[(util, seqs)] = await self.measure(
                    COLOCATED_EXAMPLE, sets, f"kv-{util:g}-{seqs}", [chat, documents]
                )

        def peak_running(record: BenchRecord) -> float:
            return max(
                (s.values.get("vllm:num_requests_running", 0.0) for s in record.samples),
                default=0.0,
            )

        loads = ["short chat", "long documents"]
        fig, axes = plt.subplots(1, 3, figsize=(14, 4.5))
        labels = [f"{u:g} / {n}" for u, n in results]
        panels: list[tuple[str, Callable[[BenchRecord], float]]] = [
            ("peak running sequences", peak_running),
            ("preemptions", lambda r: r.engine.preemptions or 0.0),
            ("TTFT p99 (ms)", lambda r: self.h200(r.summary.ttft_ms.p99)),
        ]
        for ax, (name, read) in zip(axes, panels, strict=True):
            series = [
                (load, [read(runs[n]) for runs in results.values()]) for n, load in enumerate(loads)
            ]
            paired_bars(ax, labels, series, name, fontsize=6)
            ax.tick_params(axis="x", labelrotation=30, labelsize=8)
            ax.set_xlabel("gpuMemoryUtilization / maxNumSeqs")
        axes[0].legend(fontsize=8)
        fig.suptitle(
            "KV reservation: the setting that binds depends on the request lengths\n"
            "(one emulated H200 engine, Llama-3.1-8B profile; KV pool sized from gpuMemoryUtilization)"
        )
        self.save(fig, "findings-kv-reservation.png")
        rows = []
        for (util, seqs), runs in results.items():
            blocks = profile.num_gpu_blocks(16, util, 8192)
            for number, load in enumerate(loads):
                r = runs[number]
                rows.append((
                    f"{util:g}", str(seqs), f"{blocks * 16 / 1000:,.0f}k", load, f"{peak_running(r):.0f}",
                    f"{r.engine.preemptions or 0:.0f}", f"{100 * (r.engine.max_kv_usage or 0):.0f}%",
                    f"{self.h200(r.summary.ttft_ms.p50):,.0f}", f"{self.h200(r.summary.ttft_ms.p99):,.0f}",
                    f"{r.summary.output_tok_s / self.args.speedup:,.0f}",
                ))  # fmt: skip
        self.table(
            "KV reservation sweep",
            [
                "gpuMemUtil",
                "maxNumSeqs",
                "KV tokens",
                "load",
                "peak running",
                "preemptions",
                "peak KV",
                "TTFT p50",
                "TTFT p99",
                "out tok/s",
            ],
            rows,
        )

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
        choices=["queue", "prefix", "pd", "spec", "batching", "kv-reservation"],
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
        for name in args.only or ["queue", "prefix", "pd", "spec", "batching", "kv-reservation"]:
            console.rule(name)
            await getattr(study, name.replace("-", "_"))()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(run())
    console.print(f"done in {time.monotonic() - started:.0f} s; records under {study.records_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
