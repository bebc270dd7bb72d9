"""The ServingCluster's status: what the operator observed and wrote back."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Status(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, use_attribute_docstrings=True)


class PoolStatus(_Status):
    """Observed state of one Deployment."""

    desired: int = 0
    """Replicas asked for."""
    ready: int = 0
    """Pods passing readiness."""
    updated: int = 0
    """Pods running the current template."""
    summary: str = "0/0"
    """"ready/desired", for printer columns."""


class Condition(_Status):
    """A standard Kubernetes condition."""

    type: str
    """Ready, Progressing, Degraded, ExactTokenization or ScalingLimited."""
    status: Literal["True", "False", "Unknown"]
    """Whether the condition holds."""
    reason: str = ""
    """One CamelCase word saying why."""
    message: str = ""
    """A sentence for people."""
    last_transition_time: str | None = Field(None, alias="lastTransitionTime")
    """When status last changed (RFC 3339)."""
    observed_generation: int | None = Field(None, alias="observedGeneration")
    """metadata.generation the condition was computed for."""


class PoolAutoscalingStatus(_Status):
    """The autoscaler's last decision for one pool."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, use_attribute_docstrings=True)

    replicas: int | None = None
    """Replicas the autoscaler chose; the renderer uses them while autoscaling is enabled."""
    last_scale_time: str | None = Field(None, alias="lastScaleTime")
    """When replicas last changed (RFC 3339)."""
    reason: str | None = None
    """Why (the metric and value that drove the decision)."""


class AutoscalingStatus(_Status):
    """Autoscaler decisions per pool."""

    prefill: PoolAutoscalingStatus | None = None
    """Prefill decision."""
    decode: PoolAutoscalingStatus | None = None
    """Decode decision."""


class GeneratedSecret(_Status):
    """A Secret the operator created for the ServingCluster (it never reads one back)."""

    name: str
    """Secret name."""
    uid: str
    """The uid the API server gave it at creation: a same-named Secret with another uid (or one
    that existed before) is not Tandem's."""


class ServingClusterStatus(_Status):
    """Observed state, written by the operator."""

    observed_generation: int | None = Field(None, alias="observedGeneration")
    """metadata.generation last reconciled."""
    phase: Literal["Pending", "Progressing", "Ready", "Degraded"] | None = None
    """Pending (nothing ready yet), Progressing (rolling or scaling), Ready, Degraded (failing)."""
    endpoint: str | None = None
    """In-cluster URL of the router Service."""
    prefill: PoolStatus | None = None
    """Prefill Deployment."""
    decode: PoolStatus | None = None
    """Decode Deployment."""
    router: PoolStatus | None = None
    """Router Deployment."""
    conditions: list[Condition] = Field(default_factory=list)
    """Ready, Progressing, Degraded, ExactTokenization, ScalingLimited."""
    autoscaling: AutoscalingStatus | None = None
    """Autoscaler decisions."""
    engine_key_secret: GeneratedSecret | None = Field(None, alias="engineKeySecret")
    """The engine API key Secret the operator generated."""
