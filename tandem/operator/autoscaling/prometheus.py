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
    """One element of an instant vector: its labels and its value (NaN kept as NaN)."""

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
        return _samples(body["data"])

    async def value(self, promql: str) -> float | None:
        """The single value of an aggregated query; None when the vector is empty or the value NaN."""
        samples = await self.query(promql)
        if not samples or math.isnan(samples[0].value):
            return None
        return samples[0].value


def _samples(data: dict[str, Any]) -> list[Sample]:
    result_type = data.get("resultType")
    result = data.get("result")
    if result_type == "vector":
        return [
            Sample(labels=item["metric"], value=float(item["value"][1])) for item in result or []
        ]
    if result_type == "scalar" and result is not None:
        return [Sample(labels={}, value=float(result[1]))]
    raise PrometheusUnavailable(f"unexpected result type {result_type!r} for an instant query")
