"""The scaling policy of one pool, normalised from a ServingCluster's `spec.autoscaling`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tandem.common.roles import Role
from tandem.operator.api import AutoscalingSpec


class PoolPolicy(BaseModel):
    """Targets and limits of one pool; every field has the meaning documented in docs/autoscaling.md.

    A signal whose target is None is not read. Prefill targets TTFT and waiting requests per
    replica; decode targets inter-token latency, KV-cache usage and waiting requests per replica.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    pool: Role
    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(8, ge=1)
    # Latency target of the pool's own latency signal: TTFT for prefill, ITL for decode.
    target_latency_s: float | None = Field(None, gt=0)
    # Mean `num_requests_waiting` per replica above which the pool is short of capacity.
    target_waiting_per_replica: float | None = Field(None, gt=0)
    # Mean `kv_cache_usage_perc` (0..1) above which the decode pool is short of KV memory.
    max_kv_usage: float | None = Field(None, gt=0, le=1)
    # Which latency quantile is compared with the target (0.9 = p90).
    quantile: float = Field(0.9, gt=0, lt=1)
    # A signal within ±tolerance of its target does not move the pool (as HPA's 10 %).
    tolerance: float = Field(0.1, ge=0, lt=1)
    # A latency below this fraction of its target lets the pool shrink (rule 1 of decision.py).
    latency_scale_down_ratio: float = Field(0.5, gt=0, le=1)
    # One step may grow the pool to at most max(ceil(n * scale_up_max_factor), n + scale_up_max_pods).
    scale_up_max_factor: float = Field(2.0, ge=1)
    scale_up_max_pods: int = Field(4, ge=1)
    # The pool shrinks only to the highest recommendation seen over this many seconds.
    scale_down_stabilization_s: float = Field(300.0, ge=0)
    # Range of the PromQL rate() windows for latency quantiles and request rate.
    metrics_window_s: float = Field(60.0, gt=0)

    @model_validator(mode="after")
    def _min_below_max(self) -> PoolPolicy:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"{self.pool}: min ({self.min_replicas}) exceeds max ({self.max_replicas})"
            )
        return self


def pool_policies(autoscaling: AutoscalingSpec | Mapping[str, Any]) -> dict[Role, PoolPolicy]:
    """Both pools' policies from `spec.autoscaling` (the API model, or its camelCase dict)."""
    spec = (
        autoscaling
        if isinstance(autoscaling, AutoscalingSpec)
        else AutoscalingSpec.model_validate(autoscaling)
    )
    shared: dict[str, Any] = {
        "quantile": spec.quantile,
        "tolerance": spec.tolerance,
        "scale_up_max_factor": spec.scale_up_max_factor,
        "scale_up_max_pods": spec.scale_up_max_pods,
        "scale_down_stabilization_s": spec.scale_down_stabilization_seconds,
        "metrics_window_s": spec.metrics_window_seconds,
    }
    return {
        "prefill": PoolPolicy(
            pool="prefill",
            min_replicas=spec.prefill.min,
            max_replicas=spec.prefill.max,
            target_latency_s=spec.prefill.target_ttft_seconds,
            target_waiting_per_replica=spec.prefill.target_waiting_per_replica,
            **shared,
        ),
        "decode": PoolPolicy(
            pool="decode",
            min_replicas=spec.decode.min,
            max_replicas=spec.decode.max,
            target_latency_s=spec.decode.target_itl_seconds,
            target_waiting_per_replica=spec.decode.target_waiting_per_replica,
            max_kv_usage=spec.decode.max_kv_usage,
            **shared,
        ),
    }
