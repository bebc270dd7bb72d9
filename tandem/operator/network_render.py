"""The NetworkPolicies of a ServingCluster: what each component may send and receive."""

from __future__ import annotations

from typing import Any

from tandem.operator import inference_pool as gateway
from tandem.operator.api import ServingCluster
from tandem.operator.common_render import (
    HTTP_PORT,
    KV_EVENTS_PORT,
    KV_REPLAY_PORT,
    NIXL_SIDE_CHANNEL_PORT,
    NIXL_TRANSFER_PORTS,
    Component,
    child_meta,
    child_name,
    disaggregated,
    pods_peer,
    rendered_roles,
    selector_labels,
    tcp_ports,
)
from tandem.operator.tokenizer import router_tokenizer


def _nixl_ports() -> list[dict[str, Any]]:
    low, high = NIXL_TRANSFER_PORTS
    return [*tcp_ports(NIXL_SIDE_CHANNEL_PORT), {"port": low, "endPort": high, "protocol": "TCP"}]


def _prometheus_peer(sc: ServingCluster) -> dict[str, Any]:
    prometheus = sc.spec.network_policy.prometheus
    peer: dict[str, Any] = {"namespaceSelector": prometheus.namespace_selector}
    if prometheus.pod_selector is not None:
        peer["podSelector"] = prometheus.pod_selector
    return peer


def _dns_egress(sc: ServingCluster) -> list[dict[str, Any]]:
    dns = sc.spec.network_policy.dns
    if not dns:
        return []
    ports = [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]
    return [{"to": dns, "ports": ports}]


def _egress_to(to: list[dict[str, Any]], ports: list[int]) -> list[dict[str, Any]]:
    return [{"to": to, "ports": tcp_ports(*ports)}] if to and ports else []


def _policy(
    sc: ServingCluster,
    name: str,
    role: Component | None,
    selector: dict[str, Any],
    ingress: list[dict[str, Any]],
    egress: list[dict[str, Any]],
) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_meta(sc, name, role),
        "spec": {
            "podSelector": selector,
            "policyTypes": ["Ingress", "Egress"],
            "ingress": ingress,
            "egress": egress,
        },
    }


def network_policies(sc: ServingCluster) -> list[dict[str, Any]]:
    """One policy per component, each selecting its pods for ingress and egress, so anything not
    listed here is denied (docs/security.md shows the matrix):

    - router  in:  http from `allowFrom` (anyone when empty); the admin port (/metrics) from Prometheus;
              out: engines' http, kv-events and kv-replay; DNS; the API server (pod discovery);
                   model download while its init container fetches a Hub model's tokenizer;
    - engine  in:  http, kv-events, kv-replay from this cluster's router; http from Prometheus;
                   NIXL side channel and transfer ports from the other pool of this cluster;
              out: NIXL ports of the other pool; DNS; model download (unless the cache is
                   read-only).
    A pod is named by its cluster and role labels within the namespace; what that can and cannot
    prove is in docs/security.md.
    """
    policy = sc.spec.network_policy
    prometheus = _prometheus_peer(sc)
    router_in: dict[str, Any] = {"ports": tcp_ports("http")}
    if policy.allow_from:
        router_in["from"] = policy.allow_from
    # Prometheus scrapes the router's admin port (/metrics is not served on http).
    router_ingress = [router_in, {"from": [prometheus], "ports": tcp_ports("admin")}]
    router_ingress += gateway.router_ingress(sc)
    engine_ports = tcp_ports(HTTP_PORT, KV_EVENTS_PORT, KV_REPLAY_PORT)
    router_egress = [
        {"to": [pods_peer(sc, *rendered_roles(sc))], "ports": engine_ports},
        *_dns_egress(sc),
        *_egress_to(policy.api_server.to, policy.api_server.ports),
    ]
    if router_tokenizer(sc).kind == "hub":  # the init container fetches the tokenizer files
        router_egress += _egress_to(policy.model_download.to, policy.model_download.ports)
    objects = [
        _policy(
            sc,
            child_name(sc, "router"),
            "router",
            {"matchLabels": selector_labels(sc, "router")},
            router_ingress,
            router_egress,
        )
    ]
    cache = sc.spec.model.cache
    offline = cache is not None and cache.read_only
    for role in rendered_roles(sc):
        ingress: list[dict[str, Any]] = [
            {
                "from": [pods_peer(sc, "router")],
                "ports": tcp_ports("http", "kv-events", "kv-replay"),
            },
            {"from": [prometheus], "ports": tcp_ports("http")},
            *gateway.engine_ingress(sc, role),
        ]
        egress: list[dict[str, Any]] = gateway.engine_egress(sc, role)
        if disaggregated(sc):
            peer = pods_peer(sc, "decode" if role == "prefill" else "prefill")
            ingress.append({"from": [peer], "ports": _nixl_ports()})
            egress.append({"to": [peer], "ports": _nixl_ports()})
        egress += _dns_egress(sc)
        if not offline:
            egress += _egress_to(policy.model_download.to, policy.model_download.ports)
        objects.append(
            _policy(
                sc,
                child_name(sc, role),
                role,
                {"matchLabels": selector_labels(sc, role)},
                ingress,
                egress,
            )
        )
    return objects
