"""The Kubernetes building blocks of the ServingCluster API (the subset of core/v1 it exposes)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from tandem.operator.api_model import CrossFieldRule, Quantity, SpecModel


class ResourceRequirements(SpecModel):
    """CPU, memory and accelerator requests and limits of one container."""

    requests: dict[str, Quantity] = Field(default_factory=dict)
    """Minimum resources the scheduler reserves, e.g. {cpu: "4", memory: 32Gi}."""
    limits: dict[str, Quantity] = Field(default_factory=dict)
    """Maximum resources; accelerators such as nvidia.com/gpu are set here."""


class Toleration(SpecModel):
    """A core/v1 Toleration: lets pods schedule onto nodes with a matching taint."""

    key: str | None = None
    """Taint key the toleration applies to; empty with operator Exists matches every taint."""
    operator: Literal["Exists", "Equal"] | None = None
    """Exists (any value) or Equal (the value below); Kubernetes defaults to Equal."""
    value: str | None = None
    """Taint value to match when the operator is Equal."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to match; empty matches every effect."""
    toleration_seconds: int | None = Field(None, alias="tolerationSeconds")
    """For NoExecute: how long the pod stays bound after the taint appears."""


class EnvVar(SpecModel):
    """A core/v1 EnvVar: a literal value or a reference (valueFrom) to a Secret, ConfigMap or field."""

    name: str = Field(min_length=1)
    """Environment variable name."""
    value: str | None = None
    """Literal value."""
    value_from: dict[str, Any] | None = Field(None, alias="valueFrom")
    """Source of the value (secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef)."""


class SecretKeyRef(SpecModel):
    """One key of a Secret in the ServingCluster's namespace (never created or deleted by Tandem)."""

    name: str = Field(min_length=1)
    """Secret name."""
    key: str = "token"
    """Key inside the Secret."""


class ProbeOverride(SpecModel):
    """Timing of one probe; unset fields keep Tandem's defaults."""

    initial_delay_seconds: int | None = Field(None, ge=0, alias="initialDelaySeconds")
    """Seconds after start before the first probe."""
    period_seconds: int | None = Field(None, ge=1, alias="periodSeconds")
    """Seconds between probes."""
    timeout_seconds: int | None = Field(None, ge=1, alias="timeoutSeconds")
    """Seconds before one probe times out."""
    failure_threshold: int | None = Field(None, ge=1, alias="failureThreshold")
    """Consecutive failures before the probe counts as failed."""
    success_threshold: int | None = Field(None, ge=1, alias="successThreshold")
    """Consecutive successes before the probe counts as passed (1 for liveness and startup)."""


class Probes(SpecModel):
    """Engine health probes, all on GET /health of the http port."""

    startup_budget_seconds: int = Field(1800, ge=10, alias="startupBudgetSeconds")
    """Longest time a pod may take to load the model and answer /health before it is restarted."""
    startup: ProbeOverride = Field(default_factory=ProbeOverride)
    """Overrides of the startup probe (period 10 s; the failure threshold comes from the budget)."""
    readiness: ProbeOverride = Field(default_factory=ProbeOverride)
    """Overrides of the readiness probe (period 5 s, timeout 3 s, 3 failures)."""
    liveness: ProbeOverride = Field(default_factory=ProbeOverride)
    """Overrides of the liveness probe (period 10 s, timeout 5 s, 6 failures)."""


class RolloutStrategy(SpecModel):
    """How a pool's Deployment replaces pods when the spec changes."""

    max_surge: Quantity = Field(0, alias="maxSurge")
    """Extra pods during a rollout; 0 by default because a GPU node rarely has a spare GPU."""
    max_unavailable: Quantity = Field(1, alias="maxUnavailable")
    """Pods that may be down during a rollout."""

    cel_rules = (
        CrossFieldRule(
            cel="!(string(self.maxSurge) in ['0', '0%'] && string(self.maxUnavailable) in ['0', '0%'])",
            message="maxSurge and maxUnavailable cannot both be 0",
            field="maxUnavailable",
            check=lambda s: (
                not (str(s.max_surge) in {"0", "0%"} and str(s.max_unavailable) in {"0", "0%"})
            ),
        ),
    )


class DrainSpec(SpecModel):
    """How a pod of the pool leaves when Kubernetes removes it (scale-down, rollout, eviction, node
    drain): out of routing first, then vLLM's own drain, within terminationGracePeriodSeconds."""

    pre_stop_seconds: int = Field(5, ge=0, le=300, alias="preStopSeconds")
    """Seconds between the pod's removal and vLLM's SIGTERM (a preStop sleep). The router drops a
    terminating pod from its pool as soon as its watch shows the deletion; meanwhile the engine
    keeps serving, so a request already on its way still lands. 0 sends SIGTERM at once."""
