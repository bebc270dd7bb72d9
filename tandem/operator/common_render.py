"""What every rendered child shares: fixed ports, names, labels, metadata, pod placement and
network policy peers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from tandem.common.roles import LABEL_CLUSTER, LABEL_ROLE, ROLES, Role
from tandem.operator.api import ServingCluster
from tandem.operator.api_kube import EnvVar, Toleration

# What a child object belongs to: one of the engine pools, or the router.
Component = Literal["prefill", "decode", "router"]

# Ports of every engine pod (fixed so the router, monitors and policies agree without lookups).
HTTP_PORT = 8000
KV_EVENTS_PORT = 5557
KV_REPLAY_PORT = 5558
NIXL_SIDE_CHANNEL_PORT = 5600
# UCX's TCP transport listens on a port from this range (UCX_TCP_PORT_RANGE) instead of an
# ephemeral one, so a NetworkPolicy can name the NIXL transfer ports.
NIXL_TRANSFER_PORTS = (5601, 5699)
KV_EVENTS_TOPIC = "kv-events"
ROUTER_PORT = 8000
ALL_INTERFACES = "0.0.0.0"
# /metrics and /engines: never on the client-facing port (Envoy's admin port number).
ROUTER_ADMIN_PORT = 9901
ROUTER_PRE_STOP_S = 5
ROUTER_CONFIG_DIR = "/etc/tandem"
ROUTER_CONFIG_KEY = "router.yaml"

# Labels and annotations.
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "tandem-operator"
ANNOTATION_CONFIG_HASH = "tandem.dev/config-hash"
# uid of the engine key Secret on pod templates: a replaced Secret (a new key) rolls the pods.
ANNOTATION_ENGINE_KEY = "tandem.dev/engine-key-uid"
ENGINE_CONTAINER = "vllm"
ROUTER_CONTAINER = "router"
# The engine API key: a Secret the operator generates, owned by the ServingCluster.
ENGINE_KEY_SECRET_KEY = "api-key"
ENGINE_KEY_ENV = "VLLM_API_KEY"
ROUTER_CLIENT_KEYS_DIR = "/var/run/tandem/client-keys"
ROUTER_ENGINE_KEY_DIR = "/var/run/tandem/engine-key"
ENGINE_UID = 1000
ROUTER_UID = 65532
ENGINE_HOME = "/home/vllm"


@dataclass(frozen=True)
class EnginePorts:
    """Where one engine listens. Every pod uses the fixed ports above (the router, monitors and
    policies rely on them); `tandem up` gives each local engine its own on 127.0.0.1."""

    host: str = ALL_INTERFACES
    http: int = HTTP_PORT
    kv_events: int = KV_EVENTS_PORT
    kv_replay: int = KV_REPLAY_PORT
    nixl_side_channel: int = NIXL_SIDE_CHANNEL_PORT


POD_PORTS = EnginePorts()


def child_name(sc: ServingCluster, suffix: str) -> str:
    return f"{sc.name}-{suffix}"


def common_labels(sc: ServingCluster) -> dict[str, str]:
    """Labels on every child object (the apply layer finds its children with them)."""
    return {
        **sc.spec.labels,
        LABEL_NAME: "tandem",
        LABEL_INSTANCE: sc.name,
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_CLUSTER: sc.name,
    }


def selector_labels(sc: ServingCluster, role: Component) -> dict[str, str]:
    """The immutable Deployment selector of one component."""
    return {LABEL_CLUSTER: sc.name, LABEL_ROLE: role}


def role_labels(sc: ServingCluster, role: Component) -> dict[str, str]:
    return {**common_labels(sc), LABEL_COMPONENT: role, LABEL_ROLE: role}


def child_meta(sc: ServingCluster, name: str, role: Component | None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": sc.namespace,
        "labels": role_labels(sc, role) if role else common_labels(sc),
    }
    if sc.spec.annotations:
        meta["annotations"] = dict(sc.spec.annotations)
    return meta


def compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def last_flag(args: list[str], flag: str) -> str | None:
    """The value of the last `flag VALUE` or `flag=VALUE` in argv (argparse: the last one wins)."""
    value = None
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            value = args[index + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def disaggregated(sc: ServingCluster) -> bool:
    """Whether a prefill pool exists and the engines carry the KV connector."""
    return sc.spec.router.disaggregation.mode != "never"


def rendered_roles(sc: ServingCluster) -> tuple[Role, ...]:
    return ROLES if disaggregated(sc) else ("decode",)


def endpoint(sc: ServingCluster) -> str:
    """In-cluster URL of the router Service."""
    return f"http://{child_name(sc, 'router')}.{sc.namespace}:{sc.spec.router.service.port}"


def external_scaling(sc: ServingCluster) -> bool:
    """The pools are sized by KEDA or an HPA, so the Deployments must not claim `replicas`."""
    scaling = sc.spec.autoscaling
    return scaling.enabled and scaling.provider != "tandem"


def env_dicts(env: list[EnvVar]) -> list[dict[str, Any]]:
    return [e.model_dump(by_alias=True, exclude_none=True) for e in env]


def _tolerations(tolerations: list[Toleration]) -> list[dict[str, Any]]:
    return [t.model_dump(by_alias=True, exclude_none=True) for t in tolerations]


def pod_placement(
    node_selector: dict[str, str], tolerations: list[Toleration], affinity: dict[str, Any] | None
) -> dict[str, Any]:
    placement: dict[str, Any] = {}
    if node_selector:
        placement["nodeSelector"] = dict(node_selector)
    if tolerations:
        placement["tolerations"] = _tolerations(tolerations)
    if affinity:
        placement["affinity"] = affinity
    return placement


def pull_secrets(sc: ServingCluster) -> dict[str, Any]:
    if not sc.spec.image_pull_secrets:
        return {}
    return {"imagePullSecrets": [{"name": name} for name in sc.spec.image_pull_secrets]}


def pods_peer(sc: ServingCluster, *roles: Component) -> dict[str, Any]:
    """A peer: this cluster's pods of `roles`, in its own namespace."""
    if len(roles) == 1:
        return {"podSelector": {"matchLabels": selector_labels(sc, roles[0])}}
    return {
        "podSelector": {
            "matchLabels": {LABEL_CLUSTER: sc.name},
            "matchExpressions": [{"key": LABEL_ROLE, "operator": "In", "values": list(roles)}],
        }
    }


def tcp_ports(*ports: int | str) -> list[dict[str, Any]]:
    return [{"port": port, "protocol": "TCP"} for port in ports]
