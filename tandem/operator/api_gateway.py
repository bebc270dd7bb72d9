"""Shared endpoints in the ServingCluster API: gateway membership and the InferencePool."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from tandem.operator.api_model import MAX_NAME_LENGTH, NAME_PATTERN, SpecModel
from tandem.operator.api_router import RouterServiceSpec


class GatewayJoin(SpecModel):
    """Membership of a shared endpoint: one address for several ServingClusters' models."""

    name: str = Field(min_length=1, max_length=MAX_NAME_LENGTH, pattern=NAME_PATTERN)
    """The shared endpoint of the namespace this cluster joins. The operator runs `tandem
    gateway` as `<name>-gateway` (Deployment, Service, ConfigMap) for every ServingCluster of the
    namespace naming it: a request goes by its `model` to that model's pools, with the model's
    own P/D and KV-aware routing, admission queue, tenants and client keys; an unknown model gets
    vLLM's 404. The cluster's own router keeps serving too. The gateway's image, replicas and
    Service follow the member whose name sorts first."""
    replicas: int = Field(1, ge=0)
    """Gateway pods (the first member's value counts)."""
    service: RouterServiceSpec = Field(default_factory=RouterServiceSpec)
    """The gateway's Service (the first member's value counts)."""


class InferencePoolSpec(SpecModel):
    """The Gateway API Inference Extension (docs/gateway-api.md): an InferencePool
    (inference.networking.k8s.io/v1) of this cluster's engines, with the router as its endpoint
    picker, so that a GIE gateway (Envoy based) routes to them by Tandem's placement."""

    enabled: bool = False
    """Render the InferencePool, the endpoint picker's Service `<name>-epp` and, with P/D, the
    relay container beside each decode engine. Needs the InferencePool CRD in the cluster."""
    epp_port: int = Field(9002, ge=1, le=65535, alias="eppPort")
    """The router's endpoint picker port (Envoy ext_proc over gRPC, and gRPC health)."""
    relay_port: int = Field(8001, ge=1, le=65535, alias="relayPort")
    """The port of the relay container (`tandem relay`) in decode pods: the pool's target port
    under P/D. Without P/D the target port is the engines' own."""
    failure_mode: Literal["FailOpen", "FailClose"] = Field("FailClose", alias="failureMode")
    """What the gateway does when the endpoint picker does not answer: FailClose answers 503,
    FailOpen sends the request to an endpoint of the pool without Tandem's placement (the
    gateway's ext_proc filter must then send request bodies BUFFERED: docs/gateway-api.md)."""
    allow_from: list[dict[str, Any]] = Field(default_factory=list, alias="allowFrom")
    """core/v1 NetworkPolicyPeers of the gateway (its proxy pods): allowed to the endpoint picker
    and to the pool's target port; empty = anyone."""
