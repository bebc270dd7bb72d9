"""The monitoring section of the ServingCluster API: the Prometheus Operator monitors."""

from __future__ import annotations

from pydantic import Field

from tandem.operator.api_model import SpecModel


class MonitoringSpec(SpecModel):
    """Prometheus Operator objects (rendered only when the monitoring.coreos.com CRDs exist)."""

    enabled: bool = True
    """Render a ServiceMonitor for the router and a PodMonitor for the engines."""
    interval: str = Field("15s", pattern=r"^[0-9]+(ms|s|m|h)$")
    """Scrape interval."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Extra labels on the monitors (to match a Prometheus' selector, e.g. release: prometheus)."""
