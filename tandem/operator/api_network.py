"""The ServingCluster API's NetworkPolicies: who may reach the pods and where they may connect."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from tandem.operator.api_model import SpecModel


class EgressTarget(SpecModel):
    """Destinations (core/v1 NetworkPolicyPeers) and TCP ports a component may open connections to."""

    to: list[dict[str, Any]] = Field(default_factory=list)
    """NetworkPolicyPeers (podSelector, namespaceSelector, ipBlock); empty = nowhere."""
    ports: list[int] = Field(default_factory=list)
    """TCP ports."""


def _everywhere(*ports: int) -> EgressTarget:
    return EgressTarget(to=[{"ipBlock": {"cidr": "0.0.0.0/0"}}], ports=list(ports))


class PrometheusPeer(SpecModel):
    """Where Prometheus runs: it may scrape the router's and the engines' metrics port."""

    namespace_selector: dict[str, Any] = Field(
        default_factory=lambda: {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        alias="namespaceSelector",
    )
    """LabelSelector of Prometheus' namespaces. The default names the namespace `monitoring` by
    `kubernetes.io/metadata.name`, a label the API server sets and nobody can forge."""
    pod_selector: dict[str, Any] | None = Field(None, alias="podSelector")
    """LabelSelector of the Prometheus pods inside those namespaces; unset = every pod there."""


class NetworkPolicySpec(SpecModel):
    """NetworkPolicies per component, written from the traffic Tandem really has; everything else
    in and out of the cluster's pods is denied (docs/security.md has the matrix)."""

    enabled: bool = True
    """Render the NetworkPolicies (they take effect where the network plugin enforces them)."""
    allow_from: list[dict[str, Any]] = Field(default_factory=list, alias="allowFrom")
    """core/v1 NetworkPolicyPeers that may call the router (its clients); empty = anyone. Engines
    never accept traffic from these."""
    prometheus: PrometheusPeer = Field(default_factory=PrometheusPeer)
    """Prometheus, allowed to the metrics port of router and engines."""
    dns: list[dict[str, Any]] = Field(
        default_factory=lambda: [
            {
                "namespaceSelector": {
                    "matchLabels": {"kubernetes.io/metadata.name": "kube-system"}
                },
                "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
            }
        ]
    )
    """NetworkPolicyPeers of the cluster DNS (port 53, UDP and TCP); default kube-dns/CoreDNS."""
    api_server: EgressTarget = Field(
        default_factory=lambda: _everywhere(443, 6443), alias="apiServer"
    )
    """The Kubernetes API, which the router watches for engine pods. The API server is not a pod,
    so no selector names it: narrow `to` to its address blocks (an ipBlock) where known."""
    model_download: EgressTarget = Field(
        default_factory=lambda: _everywhere(443), alias="modelDownload"
    )
    """Where engines download weights (the Hugging Face Hub over HTTPS by default). Not rendered
    when the model cache is mounted read-only (engines are offline then); `to: []` denies it."""
