"""The objects of a shared gateway: one `tandem gateway` for the ServingClusters that join it.

Pure: the members (ServingClusters of one namespace whose `spec.gateway.name` is the gateway's)
in, manifests out. Every object is owned by every member (none is the controller), so it lives
while any member does; the gateway's settings follow the member whose name sorts first.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tandem.common.roles import LABEL_CLUSTER, LABEL_ROLE
from tandem.operator.api import API_VERSION, KIND, ServingCluster
from tandem.operator.common_render import (
    ENGINE_KEY_SECRET_KEY,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    MANAGED_BY,
    ROUTER_ADMIN_PORT,
    ROUTER_UID,
    rendered_roles,
)
from tandem.operator.router_render import config_volumes, router_config, router_process_container
from tandem.operator.security_render import container_security_context, pod_security_context
from tandem.operator.tokenizer import TOKENIZER_DIR, router_tokenizer, tokenizer_pod_parts
from tandem.router.config import AuthConfig, GatewayConfig, TrustConfig

LABEL_GATEWAY = "tandem.dev/gateway"
GATEWAY_CONFIG_KEY = "gateway.yaml"
GATEWAY_CONTAINER = "gateway"
# Each member's key Secrets, mounted whole (so rotations reach the running gateway).
MEMBER_KEYS_DIR = "/var/run/tandem/clusters"
# Each member's model volume, where its tokenizer (or chat template file) lies on it.
MEMBER_MODELS_DIR = "/var/lib/tandem/models"


def gateway_object_name(gateway: str) -> str:
    return f"{gateway}-gateway"


def members(
    clusters: Iterable[ServingCluster], namespace: str, gateway: str
) -> list[ServingCluster]:
    """The clusters of `namespace` that join `gateway`, by name."""
    joined = [
        sc
        for sc in clusters
        if sc.namespace == namespace
        and sc.spec.gateway is not None
        and sc.spec.gateway.name == gateway
    ]
    return sorted(joined, key=lambda sc: sc.name)


def gateway_labels(gateway: str) -> dict[str, str]:
    """No cluster label: no member's pruning of its own children may take these."""
    return {
        LABEL_NAME: "tandem",
        LABEL_INSTANCE: gateway,
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_COMPONENT: "gateway",
        LABEL_GATEWAY: gateway,
    }


def _owners(owners: list[ServingCluster]) -> list[dict[str, Any]]:
    return [
        {"apiVersion": API_VERSION, "kind": KIND, "name": sc.name, "uid": sc.metadata.uid}
        for sc in owners
        if sc.metadata.uid
    ]


def _meta(gateway: str, name: str, owners: list[ServingCluster]) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": owners[0].namespace,
        "labels": gateway_labels(gateway),
    }
    references = _owners(owners)
    if references:
        meta["ownerReferences"] = references
    return meta


def _key_dir(sc: ServingCluster, kind: str) -> str:
    return f"{MEMBER_KEYS_DIR}/{sc.name}/{kind}"


def member_auth(sc: ServingCluster) -> AuthConfig:
    """Where the gateway finds a member's client keys and engine key."""
    auth = sc.spec.router.auth
    client = auth.client_keys_secret
    return AuthConfig(
        client_keys_file=f"{_key_dir(sc, 'client-keys')}/{client.key}" if client else None,
        engine_key_file=(
            f"{_key_dir(sc, 'engine-key')}/{ENGINE_KEY_SECRET_KEY}" if auth.engine_key else None
        ),
    )


@dataclass(frozen=True)
class MemberTokenizer:
    """A member's tokenizer in the gateway pod: as in its own router's pod (tokenizer.py), with
    every path moved below a directory of the member's own and every volume and init container
    named `m<index>-...`, so members never collide."""

    path: str | None
    chat_template: str | None
    init_containers: list[dict[str, Any]]
    volumes: list[dict[str, Any]]
    mounts: list[dict[str, Any]]


def _relocated(value: Any, old: str, new: str) -> Any:
    """`value` with every string that is the path `old` or below it moved to `new`."""
    if isinstance(value, str):
        moved = old and (value == old or value.startswith(old + "/"))
        return new + value[len(old) :] if moved else value
    if isinstance(value, list):
        return [_relocated(item, old, new) for item in value]
    if isinstance(value, dict):
        return {key: _relocated(item, old, new) for key, item in value.items()}
    return value


def member_tokenizer(index: int, sc: ServingCluster) -> MemberTokenizer:
    source = router_tokenizer(sc)
    inits, volumes, mounts = tokenizer_pod_parts(sc, container_security_context(ROUTER_UID, None))
    old = new = ""
    if source.kind == "hub":
        old, new = TOKENIZER_DIR, f"{TOKENIZER_DIR}/{sc.name}"
    elif source.kind == "volume" and sc.spec.model.cache is not None:
        old, new = sc.spec.model.cache.mount_path.rstrip("/"), f"{MEMBER_MODELS_DIR}/{sc.name}"
    prefix = f"m{index}-"

    def renamed(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**item, "name": prefix + item["name"]} for item in _relocated(items, old, new)]

    containers = []
    for init in inits:
        container = _relocated(init, old, new)
        container["name"] = prefix + container["name"]
        container["volumeMounts"] = renamed(init.get("volumeMounts", []))
        containers.append(container)
    return MemberTokenizer(
        _relocated(source.path, old, new),
        _relocated(source.chat_template, old, new),
        containers,
        renamed(volumes),
        renamed(mounts),
    )


def gateway_config(gateway: str, joined: list[ServingCluster]) -> GatewayConfig:
    """One router config per member, discovering its engines and reading its tokenizer as its
    own router does (`member_tokenizer`)."""
    models = []
    for index, sc in enumerate(joined):
        tokenizer = member_tokenizer(index, sc)
        models.append(
            router_config(
                sc,
                tokenizer=tokenizer.path,
                chat_template=tokenizer.chat_template,
                auth=member_auth(sc),
            )
        )
    return GatewayConfig(
        trust=TrustConfig(admin_port=ROUTER_ADMIN_PORT),
        log_level=joined[0].spec.router.log_level,
        models=models,
    )


def _volumes(name: str, joined: list[ServingCluster]) -> tuple[list[Any], list[Any]]:
    volumes, mounts = config_volumes(name)
    for index, sc in enumerate(joined):
        tokenizer = member_tokenizer(index, sc)
        volumes += tokenizer.volumes
        mounts += tokenizer.mounts
        auth = sc.spec.router.auth
        secrets: list[tuple[str, str]] = []
        if auth.client_keys_secret:
            secrets.append(("client-keys", auth.client_keys_secret.name))
        if auth.engine_key:
            secrets.append(("engine-key", f"{sc.name}-engine-key"))
        for kind, secret in secrets:
            volume = f"m{index}-{kind}"
            volumes.append({"name": volume, "secret": {"secretName": secret, "defaultMode": 0o440}})
            mounts.append({"name": volume, "mountPath": _key_dir(sc, kind), "readOnly": True})
    return volumes, mounts


def _selector(gateway: str) -> dict[str, str]:
    return {LABEL_COMPONENT: "gateway", LABEL_GATEWAY: gateway}


def render_gateway(gateway: str, joined: list[ServingCluster]) -> list[dict[str, Any]]:
    """The gateway's objects for its members (`members`), in the order they are best applied;
    none for no member."""
    if not joined:
        return []
    first = joined[0]
    assert first.spec.gateway is not None
    name = gateway_object_name(gateway)
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(gateway, name, joined),
        "data": {GATEWAY_CONFIG_KEY: gateway_config(gateway, joined).to_yaml()},
    }
    digest = hashlib.sha256(json.dumps(config_map["data"]).encode()).hexdigest()[:16]
    pull_secrets = sorted({s for sc in joined for s in sc.spec.image_pull_secrets})
    volumes, mounts = _volumes(name, joined)
    inits = [c for i, sc in enumerate(joined) for c in member_tokenizer(i, sc).init_containers]
    router = first.spec.router

    container = router_process_container(
        GATEWAY_CONTAINER,
        router,
        "gateway",
        GATEWAY_CONFIG_KEY,
        mounts,
        [],
        None,
    )
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(gateway, name, joined),
        "spec": {
            "replicas": first.spec.gateway.replicas,
            "selector": {"matchLabels": _selector(gateway)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": {
                "metadata": {
                    "labels": gateway_labels(gateway),
                    "annotations": {"tandem.dev/config-hash": digest},
                },
                "spec": {
                    "serviceAccountName": name,
                    "securityContext": pod_security_context(ROUTER_UID, None),
                    **({"initContainers": inits} if inits else {}),
                    "containers": [container],
                    "volumes": volumes,
                    "terminationGracePeriodSeconds": 30,
                    **(
                        {"imagePullSecrets": [{"name": s} for s in pull_secrets]}
                        if pull_secrets
                        else {}
                    ),
                },
            },
        },
    }
    service_spec = first.spec.gateway.service
    service_meta = _meta(gateway, name, joined)
    if service_spec.annotations:
        service_meta["annotations"] = dict(service_spec.annotations)
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": service_meta,
        "spec": {
            "type": service_spec.type,
            "selector": _selector(gateway),
            "ports": [
                {"name": "http", "port": service_spec.port, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(gateway, name, joined)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _meta(gateway, name, joined),
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                {
                    "apiGroups": ["apps"],
                    "resources": ["deployments", "replicasets"],
                    "verbs": ["get", "list"],
                },
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta(gateway, name, joined),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": first.namespace}],
        },
        config_map,
        *(engine_ingress(gateway, sc) for sc in joined if sc.spec.network_policy.enabled),
        service,
        deployment,
    ]


def engine_ingress(gateway: str, sc: ServingCluster) -> dict[str, Any]:
    """Lets the gateway's pods reach a member's engines as its router does (http, KV events and
    their replay); a NetworkPolicy of its own, added to the member's (policies only allow)."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(gateway, f"{sc.name}-engines-from-{gateway_object_name(gateway)}", [sc]),
        "spec": {
            "podSelector": {
                "matchLabels": {LABEL_CLUSTER: sc.name},
                "matchExpressions": [
                    {"key": LABEL_ROLE, "operator": "In", "values": list(rendered_roles(sc))}
                ],
            },
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": _selector(gateway)}}],
                    "ports": [
                        {"port": port, "protocol": "TCP"}
                        for port in ("http", "kv-events", "kv-replay")
                    ],
                }
            ],
        },
    }
