"""A ServingCluster's Gateway API Inference Extension objects: the InferencePool, the endpoint
picker's Service, the relay container of decode pods, and the network rules between them.

    InferencePool  selector = the decode pods (the engines a request is sent to)
                   targetPorts = [relayPort] under P/D (the relay prefills first), else the
                                 engines' own HTTP port
                   endpointPickerRef = Service <name>-epp, port eppPort (the router), failureMode
"""

from __future__ import annotations

from typing import Any

from tandem.operator.api import ServingCluster
from tandem.operator.common_render import (
    ENGINE_KEY_SECRET_KEY,
    ENGINE_UID,
    HTTP_PORT,
    ROUTER_ENGINE_KEY_DIR,
    child_meta,
    child_name,
    disaggregated,
    pods_peer,
    selector_labels,
    tcp_ports,
)
from tandem.operator.security_render import container_security_context, engine_key_secret_name
from tandem.router.epp.config import EppConfig

API_VERSION = "inference.networking.k8s.io/v1"
RELAY_CONTAINER = "relay"
EPP_PORT_NAME = "epp"
RELAY_PORT_NAME = "relay"
# gRPC without TLS: what a gateway must speak to the endpoint picker's Service port.
H2C = "kubernetes.io/h2c"


def enabled(sc: ServingCluster) -> bool:
    return sc.spec.inference_pool.enabled


def relayed(sc: ServingCluster) -> bool:
    """Decode pods carry the relay: the pool is on and P/D is possible."""
    return enabled(sc) and disaggregated(sc)


def epp_config(sc: ServingCluster) -> EppConfig | None:
    """The router's endpoint picker listener; the relay's port when decode pods have one."""
    if not enabled(sc):
        return None
    spec = sc.spec.inference_pool
    return EppConfig(port=spec.epp_port, relay_port=spec.relay_port if relayed(sc) else None)


def target_port(sc: ServingCluster) -> int:
    return sc.spec.inference_pool.relay_port if relayed(sc) else HTTP_PORT


def inference_pool(sc: ServingCluster) -> dict[str, Any]:
    spec = sc.spec.inference_pool
    return {
        "apiVersion": API_VERSION,
        "kind": "InferencePool",
        "metadata": child_meta(sc, sc.name, None),
        "spec": {
            "selector": {"matchLabels": selector_labels(sc, "decode")},
            "targetPorts": [{"number": target_port(sc)}],
            "appProtocol": "http",
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": child_name(sc, "epp"),
                "port": {"number": spec.epp_port},
                "failureMode": spec.failure_mode,
            },
        },
    }


def epp_service(sc: ServingCluster) -> dict[str, Any]:
    """The endpoint picker's own ClusterIP Service (never the router's, which may be public)."""
    port = sc.spec.inference_pool.epp_port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_meta(sc, child_name(sc, "epp"), "router"),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(sc, "router"),
            "ports": [
                {
                    "name": EPP_PORT_NAME,
                    "port": port,
                    "targetPort": EPP_PORT_NAME,
                    "protocol": "TCP",
                    "appProtocol": H2C,
                }
            ],
        },
    }


def objects(sc: ServingCluster) -> list[dict[str, Any]]:
    return [epp_service(sc), inference_pool(sc)] if enabled(sc) else []


def router_ports(sc: ServingCluster) -> list[dict[str, Any]]:
    if not enabled(sc):
        return []
    port = sc.spec.inference_pool.epp_port
    return [{"name": EPP_PORT_NAME, "containerPort": port, "protocol": "TCP"}]


def relay_parts(sc: ServingCluster, role: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The relay container of a decode pod, and the volumes it adds (the engine key)."""
    if role != "decode" or not relayed(sc):
        return [], []
    router = sc.spec.router
    port = sc.spec.inference_pool.relay_port
    args = [
        "--engine",
        f"http://127.0.0.1:{HTTP_PORT}",
        "--model",
        sc.spec.model.served_model_name,
        "--port",
        str(port),
        "--log-level",
        router.log_level,
    ]
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if router.auth.engine_key:
        args += ["--engine-key-file", f"{ROUTER_ENGINE_KEY_DIR}/{ENGINE_KEY_SECRET_KEY}"]
        volumes.append(
            {
                "name": "relay-engine-key",
                "secret": {"secretName": engine_key_secret_name(sc), "defaultMode": 0o440},
            }
        )
        mounts.append(
            {"name": "relay-engine-key", "mountPath": ROUTER_ENGINE_KEY_DIR, "readOnly": True}
        )
    container = {
        "name": RELAY_CONTAINER,
        "image": router.image,
        "imagePullPolicy": router.image_pull_policy,
        "command": ["tandem", "relay"],
        "args": args,
        "ports": [{"name": RELAY_PORT_NAME, "containerPort": port, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "volumeMounts": mounts,
        # Ready when its engine is: the relay passes /health through.
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": RELAY_PORT_NAME},
            "periodSeconds": 5,
            "timeoutSeconds": 3,
        },
        # The engine's user: the pod's fsGroup makes the engine key readable to it.
        "securityContext": container_security_context(ENGINE_UID, router.security_context),
    }
    return [container], volumes


def gateway_peers(sc: ServingCluster) -> dict[str, Any]:
    """`from` of the rules that admit the gateway (absent: anyone)."""
    peers = sc.spec.inference_pool.allow_from
    return {"from": peers} if peers else {}


def router_ingress(sc: ServingCluster) -> list[dict[str, Any]]:
    """The gateway to the endpoint picker."""
    if not enabled(sc):
        return []
    return [{**gateway_peers(sc), "ports": tcp_ports(EPP_PORT_NAME)}]


def engine_ingress(sc: ServingCluster, role: str) -> list[dict[str, Any]]:
    """The gateway to the decode pods' target port; the relays to the prefill engines' HTTP."""
    if not enabled(sc):
        return []
    if role == "decode":
        return [{**gateway_peers(sc), "ports": tcp_ports(target_port(sc))}]
    if relayed(sc):
        return [{"from": [pods_peer(sc, "decode")], "ports": tcp_ports("http")}]
    return []


def engine_egress(sc: ServingCluster, role: str) -> list[dict[str, Any]]:
    """A decode pod's relay to the prefill engines."""
    if role != "decode" or not relayed(sc):
        return []
    return [{"to": [pods_peer(sc, "prefill")], "ports": tcp_ports(HTTP_PORT)}]
