"""Lock-free Prometheus primitives: fixed-bucket histograms, counters and labelled families of them.

One event loop thread writes them and the scrape reads them, so an observation is a bisect and
two additions, several times cheaper than prometheus_client's locked values; exposition still goes
through prometheus_client's metric families and text format. The router and the emulator both
count with these.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

_INF = float("inf")


class Histogram:
    """Counts per bucket (`counts[i]` for values <= `bounds[i]`, the last one +Inf) and their sum."""

    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(sorted(float(b) for b in bounds))
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        """(le label, count of values <= le) per bucket, +Inf last: the exposition's buckets."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*self.bounds, _INF), self.counts, strict=True):
            running += count
            out.append((floatToGoString(bound), float(running)))  # type: ignore[no-untyped-call]
        return out


class Counter:
    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


Child = TypeVar("Child", Histogram, Counter)


class Family(Generic[Child]):
    """One metric name with label names; a child per combination of label values, made on first use."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Iterable[str],
        new_child: Callable[[], Child],
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.children: dict[tuple[str, ...], Child] = {}
        self._new_child: Callable[[], Child] = new_child

    def labels(self, *values: str) -> Child:
        child = self.children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}")
            child = self.children[values] = self._new_child()
        return child


class HistogramFamily(Family[Histogram]):
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Iterable[str] = (),
        *,
        buckets: Sequence[float],
    ) -> None:
        bounds = tuple(sorted(buckets))
        super().__init__(name, documentation, labelnames, lambda: Histogram(bounds))

    def observe(self, value: float) -> None:
        self.labels().observe(value)

    def collect(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self.children.items()):
            family.add_metric(list(values), child.cumulative(), child.sum)
        return family


class CounterFamily(Family[Counter]):
    def __init__(self, name: str, documentation: str, labelnames: Iterable[str] = ()) -> None:
        super().__init__(name, documentation, labelnames, Counter)

    def inc(self, amount: float = 1.0) -> None:
        self.labels().inc(amount)

    def collect(self) -> CounterMetricFamily:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self.children.items()):
            family.add_metric(list(values), child.value)
        return family
