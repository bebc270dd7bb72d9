"""Small PromQL builders shared by the rules and the dashboards (strings in, strings out)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tandem.observability.names import CLUSTER, NAMESPACE

BY_CLUSTER: tuple[str, ...] = (NAMESPACE, CLUSTER)


def selector(metric: str, matchers: Mapping[str, str] | str = "") -> str:
    """`metric{a="x",...}`; a string is taken as the matchers' text (e.g. `le="1.0"`)."""
    if isinstance(matchers, str):
        text = matchers
    else:
        text = ",".join(f'{name}="{value}"' for name, value in matchers.items())
    return f"{metric}{{{text}}}" if text else metric


def by(labels: Sequence[str]) -> str:
    return ", ".join(labels)


def sum_rate(series: str, window: str, labels: Sequence[str] = BY_CLUSTER) -> str:
    """sum by (labels) (rate(series[window]))."""
    return f"sum by ({by(labels)}) (rate({series}[{window}]))"


def ratio(numerator: str, denominator: str) -> str:
    return f"{numerator}\n/\n{denominator}"


def zero_if_absent(expr: str, like: str) -> str:
    """`expr`, or 0 for every series of `like` that `expr` lacks: a counter that has not been
    incremented yet (no 5xx so far) reads as a rate of 0 instead of no data."""
    return f"({expr} or {like} * 0)"


def histogram_quantile(q: float, bucket_rate: str, labels: Sequence[str] = ()) -> str:
    """histogram_quantile(q, sum by (labels, le) (bucket_rate))."""
    return f"histogram_quantile({q:g}, sum by ({by([*labels, 'le'])}) ({bucket_rate}))"
