"""Resource monitoring during a run: what was busy, not only that it got slower.

Sources, all sampled on the sampler's clock and stored as time series in the record:

* GPU utilisation and memory under dcgm-exporter's names (DCGM_FI_DEV_GPU_UTIL in %,
  DCGM_FI_DEV_FB_USED / _FB_FREE in MiB), from any sampled /metrics page that carries them (a
  dcgm-exporter, or the emulator's emulated GPU), from a Prometheus that scrapes dcgm-exporter
  (`--prometheus URL`), or from NVML for the GPUs of this machine (nvidia-ml-py, when installed);
* CPU (% of one core) and resident memory of local processes (engines, router: `--pid`), by psutil;
* the engines' KV-cache usage and preemptions, from their vLLM metrics.

`summarize_resources` turns the series into baseline (the first sample, taken before the load
starts), mean, p99 and peak per resource, and the time each one first reached its saturation
threshold; the earliest of those is the resource that saturated first.
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

import aiohttp
import numpy as np
import psutil

from tandem.bench.records import ResourceSummary, SampleRecord

GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
FB_USED = "DCGM_FI_DEV_FB_USED"
FB_FREE = "DCGM_FI_DEV_FB_FREE"
DCGM_NAMES = (GPU_UTIL, FB_USED, FB_FREE)
PROCESS_CPU = "process_cpu_percent"
PROCESS_RSS = "process_resident_memory_mib"
KV_USAGE = "vllm:kv_cache_usage_perc"
PREEMPTIONS = "vllm:num_preemptions_total"
# Saturation thresholds: a share of the resource's capacity.
GPU_UTIL_SATURATED = 0.90
MEMORY_SATURATED = 0.95
KV_SATURATED = 0.95
CPU_SATURATED = 0.90  # of one core: the engines' and the router's event loops are single-threaded
GPU_KEY = re.compile(r"^(DCGM_FI_DEV_\w+)\{gpu=(.*)\}$")


def dcgm_key(name: str, gpu: str) -> str:
    """The flattened sample name of one GPU's DCGM gauge."""
    return f"{name}{{gpu={gpu}}}"


class LocalProbe:
    """NVML for this machine's GPUs and psutil for local processes; each read is a few
    hundred microseconds, cheap enough for the sampler's loop."""

    def __init__(self, processes: dict[str, int], nvml: bool = True) -> None:
        self._processes: dict[str, psutil.Process] = {}
        for name, pid in processes.items():
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(pid)
                process.cpu_percent(None)  # the first call only starts the interval
                self._processes[name] = process
        self._nvml: Any = None
        self._handles: list[Any] = []
        if nvml:
            self._start_nvml()

    def _start_nvml(self) -> None:
        try:  # nvidia-ml-py: optional, present where there are NVIDIA GPUs
            pynvml: Any = importlib.import_module("pynvml")
        except ImportError:
            return
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self._nvml = pynvml
        except pynvml.NVMLError:
            self._handles = []

    @property
    def active(self) -> bool:
        return bool(self._processes or self._handles)

    def read(self) -> dict[str, dict[str, float]]:
        """{source: values}: source "nvml" for the GPUs, "process:NAME" for each process."""
        out: dict[str, dict[str, float]] = {}
        if self._handles:
            nvml, gpus = self._nvml, {}
            for index, handle in enumerate(self._handles):
                with contextlib.suppress(nvml.NVMLError):
                    util = nvml.nvmlDeviceGetUtilizationRates(handle).gpu
                    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                    gpus[dcgm_key(GPU_UTIL, str(index))] = float(util)
                    gpus[dcgm_key(FB_USED, str(index))] = memory.used / 2**20
                    gpus[dcgm_key(FB_FREE, str(index))] = memory.free / 2**20
            if gpus:
                out["nvml"] = gpus
        for name, process in list(self._processes.items()):
            try:
                with process.oneshot():
                    out[f"process:{name}"] = {
                        PROCESS_CPU: process.cpu_percent(None),
                        PROCESS_RSS: process.memory_info().rss / 2**20,
                    }
            except psutil.Error:  # the process ended
                del self._processes[name]
        return out


async def query_prometheus(session: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    """The DCGM gauges of every GPU a Prometheus knows, keyed `NAME{gpu=HOST/GPU}`."""
    names = "|".join(DCGM_NAMES)
    url = base_url.rstrip("/") + "/api/v1/query"
    async with session.get(
        url,
        params={"query": f'{{__name__=~"{names}"}}'},
        timeout=aiohttp.ClientTimeout(total=2),
    ) as response:
        body = await response.json()
    values: dict[str, float] = {}
    for item in body.get("data", {}).get("result", []):
        metric = item.get("metric", {})
        gpu = metric.get("gpu", metric.get("UUID", "0"))
        host = metric.get("Hostname") or metric.get("instance") or ""
        key = dcgm_key(metric.get("__name__", ""), f"{host}/{gpu}" if host else gpu)
        with contextlib.suppress(ValueError, IndexError, TypeError):
            values[key] = float(item["value"][1])
    return values


def _series(
    samples: Sequence[SampleRecord], source: str, key: str
) -> tuple[np.ndarray, np.ndarray]:
    points = [(s.t_s, s.values[key]) for s in samples if s.source == source and key in s.values]
    if not points:
        return np.zeros(0), np.zeros(0)
    times, values = zip(*points, strict=True)
    return np.asarray(times, dtype=float), np.asarray(values, dtype=float)


def _summary(
    name: str,
    source: str,
    unit: str,
    times: np.ndarray,
    values: np.ndarray,
    capacity: float | None,
    threshold: float | None,
) -> ResourceSummary:
    saturated_at = None
    if capacity and threshold is not None:
        over = np.nonzero(values >= threshold * capacity)[0]
        saturated_at = float(times[over[0]]) if over.size else None
    return ResourceSummary(
        name=name,
        source=source,
        unit=unit,
        baseline=float(values[0]),
        mean=float(values.mean()),
        p99=float(np.percentile(values, 99)),
        peak=float(values.max()),
        capacity=capacity,
        saturation_threshold=threshold,
        saturated_at_s=saturated_at,
    )


def _gpus(samples: Sequence[SampleRecord], source: str) -> list[str]:
    found = {
        m.group(2)
        for s in samples
        if s.source == source
        for key in s.values
        if (m := GPU_KEY.match(key))
    }
    return sorted(found)


def _resources_of(samples: Sequence[SampleRecord], source: str) -> Iterator[ResourceSummary]:
    gpus = _gpus(samples, source)
    for gpu in gpus:
        label = f"GPU {gpu}" if len(gpus) > 1 or gpu != "0" else "GPU"
        times, util = _series(samples, source, dcgm_key(GPU_UTIL, gpu))
        if times.size:
            yield _summary(
                f"{label} utilisation", source, "%", times, util, 100.0, GPU_UTIL_SATURATED
            )
        times, used = _series(samples, source, dcgm_key(FB_USED, gpu))
        _, free = _series(samples, source, dcgm_key(FB_FREE, gpu))
        if times.size:
            capacity = float((used + free).max()) if free.size == used.size else None
            yield _summary(
                f"{label} memory", source, "MiB", times, used, capacity, MEMORY_SATURATED
            )
    times, kv = _series(samples, source, KV_USAGE)
    if times.size:
        yield _summary("KV cache", source, "%", times, 100 * kv, 100.0, KV_SATURATED)
    times, preemptions = _series(samples, source, PREEMPTIONS)
    if times.size:
        # counted from the run's start; "saturated" when the first request was preempted
        preempted = preemptions - preemptions[0]
        yield _summary("preemptions", source, "count", times, preempted, 1.0, 1.0)
    times, cpu = _series(samples, source, PROCESS_CPU)
    if times.size:
        yield _summary("CPU", source, "% of a core", times, cpu, 100.0, CPU_SATURATED)
    times, rss = _series(samples, source, PROCESS_RSS)
    if times.size:
        yield _summary("resident memory", source, "MiB", times, rss, None, None)


def summarize_resources(samples: Sequence[SampleRecord]) -> list[ResourceSummary]:
    """Every resource of every source (in the order sources first appear)."""
    sources = list(dict.fromkeys(s.source for s in samples))
    return [summary for source in sources for summary in _resources_of(samples, source)]


def first_saturated(resources: Sequence[ResourceSummary]) -> ResourceSummary | None:
    """The resource that reached its saturation threshold earliest, if any did."""
    saturated = [r for r in resources if r.saturated_at_s is not None]
    return min(saturated, key=lambda r: r.saturated_at_s or 0.0) if saturated else None


def by_unit(resources: Sequence[ResourceSummary]) -> dict[str, list[ResourceSummary]]:
    """Resources grouped by unit, for plotting like with like."""
    groups: dict[str, list[ResourceSummary]] = defaultdict(list)
    for resource in resources:
        groups[resource.unit].append(resource)
    return dict(groups)
