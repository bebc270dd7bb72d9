"""What the autoscaler observed about one pool: the values of its signals at one evaluation."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from tandem.common.roles import Role


class PoolSignals(BaseModel):
    """One pool's metrics, already aggregated over its engines by PromQL.

    `latency_s` is the pool's latency quantile over the rate window (TTFT for prefill, inter-token
    latency for decode); it is None when no request finished in the window. `waiting`, `running`
    are sums over the pool's engines; `kv_usage` is their mean (0..1); `request_rate` is finished
    requests per second over the window.

    Bounds are what each signal can physically be, so a corrupt reading fails validation instead
    of steering a pool: engines a whole count, latency and rate non-negative, queues
    non-negative, KV usage in 0..1 (a hair above 1 tolerated for rounding).
    """

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    pool: Role
    engines: int = Field(ge=0)  # engines whose metrics Prometheus holds right now
    latency_s: float | None = Field(None, ge=0)
    waiting: float = Field(0.0, ge=0)
    running: float = Field(0.0, ge=0)
    kv_usage: float | None = Field(None, ge=0, le=1.01)
    request_rate: float | None = Field(None, ge=0)

    @property
    def idle(self) -> bool:
        """No request finished in the window, none runs, none waits."""
        return not self.request_rate and self.waiting == 0 and self.running == 0
