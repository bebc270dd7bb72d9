"""The router's objects: its configuration, ConfigMap, RBAC, Deployment and Services."""

from __future__ import annotations

import hashlib
from typing import Any

from tandem.common.routing import AdmissionConfig, ScoringConfig
from tandem.operator import inference_pool as gateway
from tandem.operator.api import ServingCluster
from tandem.operator.api_router import RouterSpec
from tandem.operator.common_render import (
    ALL_INTERFACES,
    ANNOTATION_CONFIG_HASH,
    ENGINE_KEY_SECRET_KEY,
    HTTP_PORT,
    KV_EVENTS_PORT,
    KV_REPLAY_PORT,
    NIXL_SIDE_CHANNEL_PORT,
    ROUTER_ADMIN_PORT,
    ROUTER_CLIENT_KEYS_DIR,
    ROUTER_CONFIG_DIR,
    ROUTER_CONFIG_KEY,
    ROUTER_CONTAINER,
    ROUTER_ENGINE_KEY_DIR,
    ROUTER_PORT,
    ROUTER_PRE_STOP_S,
    ROUTER_UID,
    child_meta,
    child_name,
    compact_json,
    disaggregated,
    env_dicts,
    pod_placement,
    pull_secrets,
    role_labels,
    selector_labels,
)
from tandem.operator.engine_render import step_tokens
from tandem.operator.security_render import (
    container_security_context,
    engine_key_annotation,
    engine_key_secret_name,
    pod_security_context,
)
from tandem.operator.tokenizer import engine_chat_template, router_tokenizer, tokenizer_pod_parts
from tandem.router.config import (
    AuthConfig,
    KubernetesDiscovery,
    RouterConfig,
    StaticDiscovery,
    TrustConfig,
)


def router_scoring(sc: ServingCluster) -> ScoringConfig:
    """`spec.router.scoring`, with the step budgets the predictive policy assumes taken from the
    pools' own arguments where the manifest leaves them unset: a router told 8192 by default
    while a decode pool runs 2048-token steps would predict its prefills in a quarter of the
    steps they take."""
    scoring = sc.spec.router.scoring
    predictive = scoring.predictive
    budgets: dict[str, int] = {}
    if predictive.prefill_chunk_tokens is None:
        budgets["prefill_chunk_tokens"] = step_tokens(sc, "decode")
    if predictive.prefill_pool_chunk_tokens is None and disaggregated(sc):
        budgets["prefill_pool_chunk_tokens"] = step_tokens(sc, "prefill")
    return scoring.model_copy(update={"predictive": predictive.model_copy(update=budgets)})


def router_config(
    sc: ServingCluster,
    *,
    host: str = ALL_INTERFACES,
    port: int = ROUTER_PORT,
    static: StaticDiscovery | None = None,
    tokenizer: str | None = None,
    chat_template: str | None = None,
    auth: AuthConfig | None = None,
    admin_port: int | None = None,
) -> RouterConfig:
    """The router's configuration. In a pod it discovers this cluster's engines by watching Pods
    and reads its keys from mounted Secrets; `tandem up` passes its own address, a static engine
    list, its run's keys and, for several router processes, an admin port instead. `tokenizer`
    is where the router finds the model's tokenizer files when the manifest's `router.tokenizer`
    names none; `chat_template` the engines' `--chat-template` as the router can read it (see
    tokenizer.py)."""
    spec = sc.spec
    router = spec.router
    return RouterConfig(
        host=host,
        port=port,
        served_model_name=spec.model.served_model_name,
        tokenizer=router.tokenizer or tokenizer,
        chat_template=chat_template,
        chat_template_kwargs=engine_chat_template(sc)[1],
        block_size=spec.engine.block_size,
        hash_algo=spec.engine.hash_algo,
        hash_seed=spec.engine.hash_seed,
        scoring=router_scoring(sc),
        disaggregation=router.disaggregation,
        admission=router_admission(sc),
        tenancy=router.tenancy,
        timeouts=router.timeouts,
        processes=router.processes,
        kubernetes=None
        if static
        else KubernetesDiscovery(
            namespace=sc.namespace,
            cluster_name=sc.name,
            engine_port=HTTP_PORT,
            kv_events_port=KV_EVENTS_PORT,
            kv_events_replay_port=KV_REPLAY_PORT,
            side_channel_port=NIXL_SIDE_CHANNEL_PORT,
        ),
        static=static,
        # `tandem up` serves /metrics on the router's own loopback port (its bench samples it
        # there), or on `admin_port` when several processes share the router's port
        trust=TrustConfig(admin_port=admin_port if static else ROUTER_ADMIN_PORT),
        metrics_scrape_interval_s=router.metrics_scrape_interval_seconds,
        log_level=router.log_level,
        auth=auth or router_auth_config(sc),
        epp=gateway.epp_config(sc),
    )


def router_admission(sc: ServingCluster) -> AdmissionConfig:
    """`router.admission`, holding requests for `scaleToZero.wakeTimeoutSeconds` while no decode
    engine is ready when scale-to-zero is on."""
    admission = sc.spec.router.admission
    zero = sc.spec.autoscaling.scale_to_zero
    if not zero.enabled:
        return admission
    return admission.model_copy(update={"engine_wait_s": zero.wake_timeout_seconds})


def router_config_map(sc: ServingCluster) -> dict[str, Any]:
    source = router_tokenizer(sc)
    config = router_config(sc, tokenizer=source.path, chat_template=source.chat_template)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_meta(sc, child_name(sc, "router"), "router"),
        "data": {ROUTER_CONFIG_KEY: config.to_yaml()},
    }


def router_service_account(sc: ServingCluster) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": child_meta(sc, child_name(sc, "router"), "router"),
        **pull_secrets(sc),
    }


def router_role(sc: ServingCluster) -> dict[str, Any]:
    """The router watches its cluster's engine Pods (discovery) and reads the pools' Deployments
    and ReplicaSets (a Pod is admitted only when the pool's ReplicaSet controls it)."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": child_meta(sc, child_name(sc, "router"), "router"),
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
            {
                "apiGroups": ["apps"],
                "resources": ["deployments", "replicasets"],
                "verbs": ["get", "list"],
            },
        ],
    }


def router_role_binding(sc: ServingCluster) -> dict[str, Any]:
    name = child_name(sc, "router")
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": child_meta(sc, name, "router"),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": sc.namespace}],
    }


def config_hash(config_map: dict[str, Any]) -> str:
    """Digest of a ConfigMap's data; a pod-template annotation, so a config change rolls the pods."""
    return hashlib.sha256(compact_json(config_map["data"]).encode()).hexdigest()[:16]


def router_resources(router: RouterSpec) -> dict[str, Any]:
    """The router container's resources: `router.resources` when set, else for one process
    requests cpu 500m / memory 512Mi and limits memory 2Gi; for P > 1 processes requests cpu P /
    memory P x 512Mi and limits memory P x 2Gi (every process is a whole router on its own core).
    Never a CPU limit (CFS throttling adds latency to every request)."""
    if router.resources is not None:
        return router.resources.model_dump(by_alias=True)
    processes = router.processes
    cpu = "500m" if processes == 1 else str(processes)
    return {
        "requests": {"cpu": cpu, "memory": f"{512 * processes}Mi"},
        "limits": {"memory": f"{2 * processes}Gi"},
    }


def router_spread(sc: ServingCluster) -> list[dict[str, Any]]:
    """`router.topologySpreadConstraints` when set, else a maxSkew of 1 across nodes and zones,
    preferred only (ScheduleAnyway: a one-node or zoneless cluster still runs every replica).
    Rendered whatever the replica count, so scaling the router never changes its pod template
    (which would roll the running pods). `pod-template-hash` makes a rollout's new pods spread
    among themselves rather than against the old ones about to go."""
    if sc.spec.router.topology_spread_constraints is not None:
        return sc.spec.router.topology_spread_constraints
    return [
        {
            "maxSkew": 1,
            "topologyKey": key,
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": selector_labels(sc, "router")},
            "matchLabelKeys": ["pod-template-hash"],
        }
        for key in ("kubernetes.io/hostname", "topology.kubernetes.io/zone")
    ]


def router_process_container(
    name: str,
    router: RouterSpec,
    command: str,
    config_key: str,
    mounts: list[dict[str, Any]],
    extra_ports: list[dict[str, Any]],
    security_override: dict[str, Any] | None,
) -> dict[str, Any]:
    """The container of a router process (`tandem router` or `tandem gateway`, reading
    `config_key` of the mounted config map): its HTTP and admin ports, resources and probes.
    Ready while a decode engine is healthy; alive while the process serves (engines may take
    minutes to load, and restarting the router then helps nobody)."""

    def probe(path: str) -> dict[str, Any]:
        return {"httpGet": {"path": path, "port": "http"}, "timeoutSeconds": 3}

    return {
        "name": name,
        "image": router.image,
        "imagePullPolicy": router.image_pull_policy,
        "command": ["tandem", command],
        "args": ["--config", f"{ROUTER_CONFIG_DIR}/{config_key}"],
        "ports": [
            {"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"},
            {"name": "admin", "containerPort": ROUTER_ADMIN_PORT, "protocol": "TCP"},
            *extra_ports,
        ],
        "resources": router_resources(router),
        "volumeMounts": mounts,
        "readinessProbe": {**probe("/health"), "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {
            **probe("/livez"),
            "periodSeconds": 10,
            "failureThreshold": 6,
            "initialDelaySeconds": 10,
        },
        "securityContext": container_security_context(ROUTER_UID, security_override),
    }


def router_deployment(sc: ServingCluster) -> dict[str, Any]:
    router = sc.spec.router
    name = child_name(sc, "router")
    volumes, mounts = router_volumes(sc)
    spread = router_spread(sc)

    container = router_process_container(
        ROUTER_CONTAINER,
        router,
        "router",
        ROUTER_CONFIG_KEY,
        mounts,
        gateway.router_ports(sc),
        router.security_context,
    )
    # Out of the Service's endpoints before SIGTERM; then timeouts.shutdownSeconds to finish.
    container["lifecycle"] = {"preStop": {"sleep": {"seconds": ROUTER_PRE_STOP_S}}}
    init_containers, tokenizer_volumes, tokenizer_mounts = tokenizer_pod_parts(
        sc, container_security_context(ROUTER_UID, router.security_context)
    )
    container["volumeMounts"] += tokenizer_mounts
    if router.env:
        container["env"] = env_dicts(router.env)
    annotations = {
        **router.pod_annotations,
        ANNOTATION_CONFIG_HASH: config_hash(router_config_map(sc)),
        **engine_key_annotation(sc),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_meta(sc, name, "router"),
        "spec": {
            "replicas": router.replicas,
            "selector": {"matchLabels": selector_labels(sc, "router")},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "revisionHistoryLimit": 5,
            "template": {
                "metadata": {
                    "labels": {**role_labels(sc, "router"), **router.pod_labels},
                    "annotations": annotations,
                },
                "spec": {
                    "serviceAccountName": name,
                    "securityContext": pod_security_context(
                        ROUTER_UID, router.pod_security_context
                    ),
                    **({"initContainers": init_containers} if init_containers else {}),
                    "containers": [container],
                    "volumes": [*volumes, *tokenizer_volumes],
                    "terminationGracePeriodSeconds": 30,
                    **pull_secrets(sc),
                    **pod_placement(router.node_selector, router.tolerations, router.affinity),
                    **({"topologySpreadConstraints": spread} if spread else {}),
                },
            },
        },
    }


def router_service(sc: ServingCluster) -> dict[str, Any]:
    service = sc.spec.router.service
    meta = child_meta(sc, child_name(sc, "router"), "router")
    if service.annotations:
        meta["annotations"] = {**meta.get("annotations", {}), **service.annotations}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "type": service.type,
            "selector": selector_labels(sc, "router"),
            "ports": [
                {"name": "http", "port": service.port, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }


def router_admin_service(sc: ServingCluster) -> dict[str, Any]:
    """In-cluster only: the router's admin port (/metrics for Prometheus, /engines)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_meta(sc, child_name(sc, "router-admin"), "router"),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(sc, "router"),
            "ports": [
                {
                    "name": "admin",
                    "port": ROUTER_ADMIN_PORT,
                    "targetPort": "admin",
                    "protocol": "TCP",
                }
            ],
        },
    }


def router_auth_config(sc: ServingCluster) -> AuthConfig:
    """Where the router finds the client keys and the engine key (mounted Secrets)."""
    auth = sc.spec.router.auth
    return AuthConfig(
        client_keys_file=(
            f"{ROUTER_CLIENT_KEYS_DIR}/{auth.client_keys_secret.key}"
            if auth.client_keys_secret
            else None
        ),
        engine_key_file=(
            f"{ROUTER_ENGINE_KEY_DIR}/{ENGINE_KEY_SECRET_KEY}" if auth.engine_key else None
        ),
    )


def config_volumes(name: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A router process's volumes and mounts of config map `name` and a scratch /tmp (the root
    file system is read-only)."""
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": name}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": ROUTER_CONFIG_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    return volumes, mounts


def router_volumes(sc: ServingCluster) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The router's config, a scratch /tmp, and the key Secrets (whole Secret volumes, not
    subPath mounts, so the kubelet's updates reach the running router)."""
    name = child_name(sc, "router")
    auth = sc.spec.router.auth
    volumes, mounts = config_volumes(name)
    secrets: list[tuple[str, str, str]] = []
    if auth.client_keys_secret:
        secrets.append(("client-keys", auth.client_keys_secret.name, ROUTER_CLIENT_KEYS_DIR))
    if auth.engine_key:
        secrets.append(("engine-key", engine_key_secret_name(sc), ROUTER_ENGINE_KEY_DIR))
    for volume, secret, path in secrets:
        volumes.append({"name": volume, "secret": {"secretName": secret, "defaultMode": 0o440}})
        mounts.append({"name": volume, "mountPath": path, "readOnly": True})
    return volumes, mounts
