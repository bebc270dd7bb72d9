"""PNG plots of runs: latency CDFs, queue/KV/latency time series and per-stage breakdown bars."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a display

import matplotlib.pyplot as plt
import matplotlib.ticker as ticker
import numpy as np
from matplotlib.axes import Axes

from tandem.bench.records import BenchRecord
from tandem.bench.resources import first_saturated

GAUGES = [
    ("vllm:num_requests_waiting", "waiting requests"),
    ("vllm:num_requests_running", "running requests"),
    ("vllm:kv_cache_usage_perc", "KV-cache usage"),
]


def _cdf(ax: Axes, values: Sequence[float], label: str) -> None:
    if not values:
        return
    data = np.sort(np.asarray(values))
    ax.plot(data, np.arange(1, data.size + 1) / data.size, label=label)


def _log_ticks(ax: Axes) -> None:
    """Plain-number ticks on a log axis, denser when the data spans fewer decades."""
    low, high = ax.get_xlim()
    decades = np.log10(high / low) if low > 0 else 3.0
    subs = (
        (1.0,)
        if decades > 3
        else (1.0, 2.0, 5.0)
        if decades > 1
        else tuple(float(i) for i in range(1, 10))
    )
    ax.xaxis.set_major_locator(ticker.LogLocator(base=10, subs=subs))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())


def latency_cdfs(records: Sequence[BenchRecord], path: Path) -> Path:
    """TTFT, inter-token and end-to-end CDFs, one line per run (and per class of a mixed run)."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for record in records:
        ok = [r for r in record.requests if r.ok]
        classes = sorted({r.klass for r in ok}) if record.workload.kind == "mixed" else [None]
        for klass in classes:
            chosen = [r for r in ok if klass is None or r.klass == klass]
            label = record.label if klass is None else f"{record.label} ({klass})"
            _cdf(axes[0], [r.ttft_ms for r in chosen if r.ttft_ms is not None], label)
            _cdf(axes[1], [g for r in chosen for g in r.itl_ms], label)
            _cdf(axes[2], [r.e2e_ms for r in chosen if r.e2e_ms is not None], label)
    for ax, title in zip(
        axes, ("time to first token", "inter-token latency", "end-to-end latency"), strict=True
    ):
        ax.set_title(title)
        ax.set_xlabel("ms (log scale)")
        ax.set_xscale("log")
        _log_ticks(ax)
        ax.set_ylabel(
            "fraction of requests" if title != "inter-token latency" else "fraction of token gaps"
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def timeseries(records: Sequence[BenchRecord], path: Path) -> Path:
    """Engine gauges per /metrics source over the run, and each request's TTFT and E2E by start."""
    fig, axes = plt.subplots(len(GAUGES) + 1, 1, figsize=(12, 2.6 * (len(GAUGES) + 1)), sharex=True)
    for record in records:
        sources = sorted({s.source for s in record.samples})
        for ax, (metric, title) in zip(axes, GAUGES, strict=False):
            for source in sources:
                points = [
                    (s.t_s, s.values[metric])
                    for s in record.samples
                    if s.source == source and metric in s.values
                ]
                if points:
                    xs, ys = zip(*points, strict=True)
                    label = source if len(records) == 1 else f"{record.label}: {source}"
                    ax.plot(xs, ys, label=label, linewidth=1.2)
            ax.set_ylabel(title)
        ok = sorted((r for r in record.requests if r.ok), key=lambda r: r.start_s)
        last = axes[-1]
        last.scatter(
            [r.start_s for r in ok], [r.ttft_ms for r in ok], s=6, label=f"{record.label} TTFT"
        )
        last.scatter(
            [r.start_s for r in ok],
            [r.e2e_ms for r in ok],
            s=6,
            marker="x",
            label=f"{record.label} E2E",
        )
    for ax in axes[:-1]:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper right", ncol=2)
        ax.grid(True, alpha=0.3)
    axes[-1].set_yscale("log")
    axes[-1].set_ylabel("latency (ms)")
    axes[-1].set_xlabel("seconds since the measured run started")
    axes[-1].legend(fontsize=7, loc="upper right", ncol=2)
    axes[-1].grid(True, alpha=0.3)
    if records and records[0].workload.kind == "burst":
        clock = 0.0
        for phase in records[0].workload.phases[:-1]:
            clock += phase.duration_s
            for ax in axes:
                ax.axvline(clock, color="grey", linestyle="--", linewidth=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def stages(record: BenchRecord) -> dict[str, float]:
    """Mean milliseconds per request of each known stage: router headers, then engine histograms."""
    found = {
        f"router {name}": p.mean
        for name, p in record.summary.breakdown_ms.items()
        if p.mean is not None
    }
    engine = record.engine
    if not found:  # no headers: the router's own histograms say the same per request
        found = {f"router {name}": ms for name, ms in engine.router_ms_per_request.items()}
    for name, value in (
        ("engine queue", engine.queue_ms_per_request),
        ("engine prefill", engine.prefill_ms_per_request),
        ("engine decode", engine.decode_ms_per_request),
        ("KV transfer", engine.kv_transfer_ms_per_request),
    ):
        if value is not None:
            found[name] = value
    if record.summary.ttft_ms.mean is not None:
        found["client TTFT"] = record.summary.ttft_ms.mean
    if record.summary.e2e_ms.mean is not None:
        found["client end-to-end"] = record.summary.e2e_ms.mean
    return found


# Bars in the order a request lives them: waiting, deciding, prefilling, handing over the KV
# cache, first token, decoding, and the totals last. Stages not named here go before the totals.
STAGE_ORDER = [
    "router queue", "router schedule", "router decision", "engine queue", "router prefill",
    "engine prefill", "router kv_handoff", "KV transfer", "router upstream", "router ttft",
    "client TTFT", "engine decode",
    "router inter_token", "router e2e", "client end-to-end",
]  # fmt: skip


def _stage_rank(name: str) -> int:
    if name in STAGE_ORDER:
        return STAGE_ORDER.index(name)
    return STAGE_ORDER.index("router ttft")


def breakdown_bars(records: Sequence[BenchRecord], path: Path) -> Path:
    """Grouped horizontal bars: mean ms per request of each stage, one colour per run."""
    per_run = [stages(r) for r in records]
    names = sorted(dict.fromkeys(name for found in per_run for name in found), key=_stage_rank)
    fig, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * max(1, len(names)) * max(1, len(records))))
    height = 0.8 / max(1, len(records))
    y = np.arange(len(names))
    for i, (record, found) in enumerate(zip(records, per_run, strict=True)):
        values = [found.get(name, 0.0) for name in names]
        bars = ax.barh(y + i * height, values, height, label=record.label)
        ax.bar_label(
            bars,
            labels=[f"{v:,.0f}" if v >= 10 else f"{v:.1f}" for v in values],
            fontsize=7,
            padding=2,
        )
    ax.set_yticks(y + height * (len(records) - 1) / 2, names)
    ax.invert_yaxis()
    ax.set_xlabel("mean ms per request")
    ax.set_title("where the time went")
    ax.legend(fontsize=8)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


RESOURCE_SERIES = (  # (sample name or DCGM prefix, panel, scale)
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilisation (%)", 1.0),
    ("vllm:kv_cache_usage_perc", "KV cache usage (%)", 100.0),
    ("process_cpu_percent", "process CPU (% of a core)", 1.0),
    ("DCGM_FI_DEV_FB_USED", "GPU memory used (MiB)", 1.0),
    ("process_resident_memory_mib", "process resident memory (MiB)", 1.0),
    ("vllm:num_preemptions_total", "preemptions (cumulative)", 1.0),
)


def resources_timeseries(records: Sequence[BenchRecord], path: Path) -> Path | None:
    """One panel per resource kind with a line per source (and GPU); the first saturation of
    each run is marked."""
    panels = [
        (prefix, title, scale)
        for prefix, title, scale in RESOURCE_SERIES
        if any(k.startswith(prefix) for r in records for s in r.samples for k in s.values)
    ]
    if not panels:
        return None
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(12, 2.4 * len(panels)), sharex=True, squeeze=False
    )
    for record in records:
        for ax, (prefix, title, scale) in zip(axes[:, 0], panels, strict=True):
            series: dict[str, list[tuple[float, float]]] = {}
            for sample in record.samples:
                for key, value in sample.values.items():
                    if key.startswith(prefix):
                        suffix = key[len(prefix) :].replace("{gpu=", " gpu ").rstrip("}")
                        series.setdefault(f"{sample.source}{suffix}", []).append(
                            (sample.t_s, value * scale)
                        )
            for name, points in series.items():
                xs, ys = zip(*points, strict=True)
                label = name if len(records) == 1 else f"{record.label}: {name}"
                ax.plot(xs, ys, label=label, linewidth=1.2)
            ax.set_ylabel(title, fontsize=8)
            ax.grid(True, alpha=0.3)
        first = first_saturated(record.resources)
        if first is not None and first.saturated_at_s is not None:
            for ax in axes[:, 0]:
                ax.axvline(first.saturated_at_s, color="red", linestyle=":", linewidth=1)
            axes[0, 0].set_title(
                f"{record.label}: first to saturate — {first.name} ({first.source}) at "
                f"{first.saturated_at_s:.1f} s",
                fontsize=9,
            )
    for ax in axes[:, 0]:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper right", ncol=2)
    axes[-1, 0].set_xlabel("seconds since the measured run started")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(records: Sequence[BenchRecord], directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = [
        latency_cdfs(records, directory / "latency_cdf.png"),
        timeseries(records, directory / "timeseries.png"),
        breakdown_bars(records, directory / "breakdown.png"),
    ]
    resources = resources_timeseries(records, directory / "resources.png")
    return [*written, resources] if resources else written
