"""A small async client for Prometheus's instant-query HTTP API (`GET /api/v1/query`)."""

from __future__ import annotations

import math
from types import TracebackType
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict


class PrometheusUnavailable(Exception):
    """Prometheus could not be reached or refused the query; the message says which."""


class Sample(BaseModel):
    """One element of an instant vector: its labels and its value (finite, or NaN for "no value")."""

    model_config = ConfigDict(frozen=True)

    labels: dict[str, str]
    value: float


class PrometheusClient:
    """Instant queries against one Prometheus; one pooled HTTP connection, bounded by `timeout_s`."""

    def __init__(self, base_url: str, timeout_s: float = 5.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s)

    async def __aenter__(self) -> PrometheusClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def query(self, promql: str) -> list[Sample]:
        """Evaluate `promql` now; a scalar result comes back as one sample without labels."""
        try:
            response = await self._http.get("/api/v1/query", params={"query": promql})
        except httpx.HTTPError as exc:
            raise PrometheusUnavailable(
                f"{self.base_url} unreachable: {exc.__class__.__name__}: {exc}"
            ) from exc
        try:
            body: dict[str, Any] = response.json()
        except ValueError as exc:
            raise PrometheusUnavailable(
                f"{self.base_url} answered HTTP {response.status_code} without JSON"
            ) from exc
        if response.status_code != 200 or body.get("status") != "success":
            raise PrometheusUnavailable(
                f"{self.base_url} refused {promql!r}: HTTP {response.status_code} "
                f"{body.get('errorType', '')} {body.get('error', '')}".rstrip()
            )
        try:
            return _samples(body["data"])
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise PrometheusUnavailable(
                f"{self.base_url} answered {promql!r} with a malformed result: {exc}"
            ) from exc

    async def value(self, promql: str) -> float | None:
        """The single value of an aggregated query; None when the vector is empty or the value NaN."""
        samples = await self.query(promql)
        if not samples or math.isnan(samples[0].value):
            return None
        return samples[0].value


def sample_value(raw: Any) -> float:
    """A sample's value as Prometheus writes it (a decimal string). NaN stays NaN (an empty ratio,
    e.g. a quantile of no requests); +Inf, -Inf, non-numbers and values beyond MAX_SAMPLE raise
    ValueError: no signal the autoscaler reads can be that, so the reading is not trusted."""
    if not isinstance(raw, str | int | float) or isinstance(raw, bool):
        raise ValueError(f"sample value {raw!r} is not a number")
    value = float(raw)
    if math.isnan(value):
        return value
    if not math.isfinite(value) or abs(value) > MAX_SAMPLE:
        raise ValueError(f"sample value {raw!r} is not a finite number below {MAX_SAMPLE:g}")
    return value


# Far above any latency (s), queue length, KV usage or request rate a pool can have, far below
# the point where a ratio of it overflows a float in the scaling arithmetic.
MAX_SAMPLE = 1e12


def _samples(data: dict[str, Any]) -> list[Sample]:
    result_type = data.get("resultType")
    result = data.get("result")
    if result_type == "vector":
        return [
            Sample(labels=item["metric"], value=sample_value(item["value"][1]))
            for item in result or []
        ]
    if result_type == "scalar" and result is not None:
        return [Sample(labels={}, value=sample_value(result[1]))]
    raise PrometheusUnavailable(f"unexpected result type {result_type!r} for an instant query")
