"""Samples engines' and routers' Prometheus `/metrics` during a run: gauges over time, counters at the edges."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp

from tandem.bench.resources import LocalProbe, dcgm_key, query_prometheus
from tandem.observability.names import ENGINE_PROMPT_TOKENS_BY_SOURCE

# Families worth keeping: vLLM's (the engines, real or emulated), Tandem's own (the router) and
# dcgm-exporter's GPU gauges (kept per GPU as `NAME{gpu=GPU}`).
KEPT_PREFIXES = ("vllm:", "tandem_", "DCGM_")
# Histograms whose buckets are kept (as `name{le=BOUND}` keys), for engine-side percentiles.
KEPT_BUCKETS = ("vllm:inter_token_latency_seconds_bucket",)
# Counters kept per value of one label (as `name{label=VALUE}` keys).
KEPT_BY_LABEL = {ENGINE_PROMPT_TOKENS_BY_SOURCE: "source"}
BASELINE_IDLE_S = 1.0


def flatten(text: str) -> dict[str, float]:
    """{sample name: value summed over label sets} for kept families; histogram buckets are left
    out except those of KEPT_BUCKETS, kept as `name{le=BOUND}`, and the families of
    KEPT_BY_LABEL are summed per value of their label, as `name{label=VALUE}`.

    A line scan of the Prometheus text format rather than a full parser: the sampler runs on the
    client's event loop during the run, and a full parse of an engine's page (~550 lines) costs
    tens of milliseconds on a busy core, which would delay the timestamps of streamed tokens.
    Summing over labels merges engines behind one /metrics (data-parallel ranks, model names),
    which is what a per-source time series wants.
    """
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(KEPT_PREFIXES):
            continue
        brace = line.find("{")
        if brace >= 0:
            name = line[:brace]
            rest = line[line.rindex("}") + 1 :].split()
        else:
            name, *rest = line.split()
        if not rest or name.endswith("_created"):
            continue
        if name.startswith("DCGM_"):
            start = line.find('gpu="', brace) + 5
            name = dcgm_key(name, line[start : line.index('"', start)] if start > 4 else "0")
        elif name.endswith("_bucket"):
            if name not in KEPT_BUCKETS:
                continue
            start = line.find('le="', brace) + 4
            bound = line[start : line.index('"', start)]
            name = f"{name}{{le={bound}}}"
        elif name in KEPT_BY_LABEL:
            label = KEPT_BY_LABEL[name]
            start = line.find(f'{label}="', brace) + len(label) + 2
            end = line.index('"', start)
            name = f"{name}{{{label}={line[start:end]}}}"
        try:
            value = float(rest[0])
        except ValueError:
            continue
        values[name] = values.get(name, 0.0) + value
    return values


@dataclass(slots=True)
class MetricSample:
    t_s: float  # seconds since the run's start
    source: str
    values: dict[str, float]


@dataclass
class Sampler:
    """Polls every source every `interval_s`; `first`/`last` hold the snapshots bounding the run.

    Besides the /metrics pages: a Prometheus to ask for dcgm-exporter's GPU gauges (source
    "prometheus") and a local probe (NVML, processes; see tandem.bench.resources).
    """

    sources: dict[str, str]  # name -> /metrics URL
    interval_s: float = 0.5
    prometheus: str | None = None
    probe: LocalProbe | None = None
    samples: list[MetricSample] = field(default_factory=list)
    first: dict[str, dict[str, float]] = field(default_factory=dict)
    last: dict[str, dict[str, float]] = field(default_factory=dict)
    unreachable: set[str] = field(default_factory=set)
    _task: asyncio.Task[None] | None = None
    _t0: float = 0.0

    async def _scrape(
        self, session: aiohttp.ClientSession, name: str, url: str
    ) -> dict[str, float] | None:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as response:
                if response.status != 200:
                    self.unreachable.add(name)
                    return None
                return flatten(await response.text())
        except (TimeoutError, aiohttp.ClientError, ValueError):
            self.unreachable.add(name)
            return None

    async def _prometheus(self, session: aiohttp.ClientSession) -> dict[str, float] | None:
        assert self.prometheus is not None
        try:
            return await query_prometheus(session, self.prometheus) or None
        except (TimeoutError, aiohttp.ClientError, ValueError):
            self.unreachable.add("prometheus")
            return None

    async def scrape_all(self, session: aiohttp.ClientSession) -> dict[str, dict[str, float]]:
        names = list(self.sources)
        scraped = await asyncio.gather(*(self._scrape(session, n, self.sources[n]) for n in names))
        out = {n: v for n, v in zip(names, scraped, strict=True) if v is not None}
        if self.prometheus:
            gpus = await self._prometheus(session)
            if gpus:
                out["prometheus"] = gpus
        if self.probe is not None:
            out.update(self.probe.read())
        return out

    async def _loop(self, session: aiohttp.ClientSession) -> None:
        while True:
            tick = time.perf_counter()
            for name, values in (await self.scrape_all(session)).items():
                self.samples.append(MetricSample(tick - self._t0, name, values))
                self.last[name] = values
            await asyncio.sleep(max(0.0, self.interval_s - (time.perf_counter() - tick)))

    async def start(self, session: aiohttp.ClientSession, t0: float) -> None:
        self._t0 = t0
        if not self.active:
            return
        if self.probe is not None:
            # CPU shares are measured between two reads, and GPU utilisation averages about a
            # second: an idle interval before the baseline
            self.probe.read()
            await asyncio.sleep(max(self.interval_s, BASELINE_IDLE_S))
            self._t0 = time.perf_counter()
        self.first = await self.scrape_all(session)
        for name, values in self.first.items():  # the baseline: before the load starts
            self.samples.append(MetricSample(0.0, name, values))
        self.unreachable -= set(self.first)
        self._task = asyncio.create_task(self._loop(session))

    async def stop(self, session: aiohttp.ClientSession) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.active:
            self.last.update(await self.scrape_all(session))

    @property
    def t0(self) -> float:
        """The run's time origin (moved past the idle interval before the baseline)."""
        return self._t0

    @property
    def active(self) -> bool:
        return bool(self.sources or self.prometheus or (self.probe and self.probe.active))

    def delta(self, name: str) -> float:
        """Increase of counter `name` over the run, summed across sources."""
        return sum(
            last.get(name, 0.0) - self.first.get(src, {}).get(name, 0.0)
            for src, last in self.last.items()
        )
