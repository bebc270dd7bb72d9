"""`EppConfig`: the router's endpoint-picker listener and where each decode engine's relay is."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class EppConfig(BaseModel):
    """The endpoint picker (docs/gateway-api.md): an Envoy ext_proc gRPC server in the router.

    A P/D route needs a relay beside the decode engine (`tandem relay`): the picker names the
    relay as the destination and the prefill engine in a header, and the relay does the handoff.
    Decode engines without a relay are named directly and always prefill locally.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    # The gRPC port (ext_proc and grpc.health.v1); the router's `host` is the address.
    port: int = Field(9002, ge=0, le=65535)
    # The relay's port beside every decode engine (Kubernetes: the decode pod's IP and this port).
    relay_port: int | None = Field(None, ge=1, le=65535, alias="relayPort")
    # Engine URL -> its relay's host:port, for static discovery (engines sharing one address).
    relays: dict[str, str] = Field(default_factory=dict)
