"""One Prometheus exposition from several router processes' expositions.

Every sample gets a `process="<index>"` label, so the series of different processes stay apart
and `sum`/`rate` over them (the dashboards and rules sum over every label they do not name) add
up as they do over router replicas; each family's HELP and TYPE appear once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

PROCESS_LABEL = "process"


def merge_families(
    expositions: Sequence[tuple[str, str]], label: str = PROCESS_LABEL
) -> list[Metric]:
    """Families of `expositions` ((label value, exposition text) pairs), in order of first
    appearance, each with the samples of every exposition labelled `label` by its value (the
    process by default; the model in a gateway)."""
    merged: dict[str, Metric] = {}
    for process, text in expositions:
        for family in text_string_to_metric_families(text):
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation, family.type)
            for sample in family.samples:
                into.samples.append(sample._replace(labels={**sample.labels, label: process}))
    return list(merged.values())


class _Families(Collector):
    def __init__(self, families: Iterable[Metric]):
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def render_families(families: Iterable[Metric]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)
