"""The router's Prometheus metrics: per-stage latency histograms, decision and prefix-hit counters.

Histograms and counters here are a small lock-free implementation (one event loop thread writes
them; the scrape reads): an observation is a bisect and two additions, several times cheaper than
prometheus_client's locked values, which matters at a few observations per proxied request.
Exposition still goes through prometheus_client's registry and text format.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

_LATENCY = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
_ROUTING = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01)


class HistogramChild:
    __slots__ = ("buckets", "counts", "sum")

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value


class CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class _Family:
    def __init__(self, name: str, documentation: str, labelnames: Iterable[str] = ()):
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.children: dict[tuple[str, ...], Any] = {}

    def _new(self) -> Any:
        raise NotImplementedError

    def labels(self, *values: str) -> Any:
        child = self.children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}")
            child = self.children[values] = self._new()
        return child


class Histogram(_Family):
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Iterable[str] = (),
        buckets: tuple[float, ...] = _LATENCY,
    ):
        super().__init__(name, documentation, labelnames)
        self.buckets = tuple(sorted(buckets))

    def _new(self) -> HistogramChild:
        return HistogramChild(self.buckets)

    def observe(self, value: float) -> None:
        self.labels().observe(value)

    def collect(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self.children.items()):
            running = 0
            buckets = []
            for bound, count in zip((*self.buckets, float("inf")), child.counts, strict=True):
                running += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
            family.add_metric(list(values), buckets, child.sum)
        return family


class Counter(_Family):
    def _new(self) -> CounterChild:
        return CounterChild()

    def inc(self, amount: float = 1.0) -> None:
        self.labels().inc(amount)

    def collect(self) -> Metric:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self.children.items()):
            family.add_metric(list(values), child.value)
        return family


class _Collector(Collector):
    def __init__(self, families: list[_Family], gauges: list[Callable[[], Iterable[Metric]]]):
        self.families = families
        self.gauges = gauges

    def collect(self) -> Iterator[Metric]:
        for family in self.families:
            yield family.collect()  # type: ignore[attr-defined]
        for read in self.gauges:
            yield from read()


class RouterMetrics:
    def __init__(self) -> None:
        self.queue = Histogram(
            "tandem_router_queue_seconds",
            "Time waiting in the router's admission queue.",
            ["priority"],
        )
        self.prefill = Histogram(
            "tandem_router_prefill_seconds",
            "Prefill request on a prefill pod (max_tokens=1).",
            ["endpoint"],
        )
        self.kv_handoff = Histogram(
            "tandem_router_kv_handoff_seconds",
            "From the prefill pod's answer to the decode pod's first body byte (KV pull + first step).",
            ["endpoint"],
        )
        self.ttft = Histogram(
            "tandem_router_ttft_seconds",
            "Request arrival to the first body byte sent to the client.",
            ["pool", "endpoint"],
        )
        self.itl = Histogram(
            "tandem_router_inter_token_seconds",
            "Gap between consecutive streamed chunks.",
            ["endpoint"],
            buckets=_ITL,
        )
        self.e2e = Histogram(
            "tandem_router_e2e_seconds",
            "Request arrival to the last byte sent.",
            ["pool", "endpoint"],
        )
        self.routing = Histogram(
            "tandem_router_decision_seconds",
            "Tokenize, index lookup and scoring.",
            buckets=_ROUTING,
        )
        self.requests = Counter(
            "tandem_router_requests_total",
            "Requests answered, by route and HTTP status.",
            ["route", "status"],
        )
        self.decisions = Counter(
            "tandem_router_decisions_total",
            "Routing decisions: disaggregated, local or fallback.",
            ["decision"],
        )
        self.prefix_query_blocks = Counter(
            "tandem_router_prefix_query_blocks_total", "Full prompt blocks looked up.", ["index"]
        )
        self.prefix_hit_blocks = Counter(
            "tandem_router_prefix_hit_blocks_total",
            "Prompt blocks already cached on the chosen decode engine.",
            ["index"],
        )
        self.prefix_hits = Counter(
            "tandem_router_prefix_hit_requests_total",
            "Requests routed to an engine with a prefix hit.",
            ["index"],
        )
        self.retries = Counter(
            "tandem_router_retries_total",
            "Upstream attempts retried on another engine.",
            ["pool", "reason"],
        )
        self.upstream_errors = Counter(
            "tandem_router_upstream_errors_total",
            "Failed upstream requests.",
            ["pool", "endpoint", "kind"],
        )
        self.rejected = Counter(
            "tandem_router_rejected_total", "Requests refused before routing.", ["reason"]
        )
        self.disconnects = Counter(
            "tandem_router_client_disconnects_total", "Clients that went away mid-request."
        )
        self.tokenize_fallbacks = Counter(
            "tandem_router_tokenize_fallbacks_total",
            "Requests the router could not tokenize exactly (routed on the approximation).",
            ["reason"],
        )
        self.stripped = Counter(
            "tandem_router_stripped_kv_transfer_params_total",
            "Client requests that carried kv_transfer_params (removed).",
        )
        self.handoff_rejected = Counter(
            "tandem_router_kv_handoff_rejected_total",
            "Prefill answers whose kv_transfer_params did not name the answering engine (502).",
            ["endpoint"],
        )
        self.kv_event_errors = Counter(
            "tandem_router_kv_event_errors_total",
            "KV-event batches or subscriptions that failed (the subscriber logs and resubscribes).",
            ["endpoint", "kind"],
        )
        families = [v for v in vars(self).values() if isinstance(v, _Family)]
        self._families = families
        self._gauges: list[Callable[[], Iterable[Metric]]] = []
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(families, self._gauges))

    def child(self, metric: _Family, *labels: str) -> Any:
        """`metric.labels(*labels)` (kept as one call site for the hot path)."""
        return metric.labels(*labels)

    def forget_endpoint(self, endpoint: str) -> None:
        """Drops every series labelled with `endpoint` (the engine left the pool)."""
        for family in self._families:
            if "endpoint" not in family.labelnames:
                continue
            at = family.labelnames.index("endpoint")
            for values in [v for v in family.children if v[at] == endpoint]:
                del family.children[values]

    def add_gauges(self, read: Callable[[], Iterable[Metric]]) -> None:
        self._gauges.append(read)

    def render(self) -> bytes:
        return generate_latest(self.registry)
