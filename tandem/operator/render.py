"""The pure renderer: one ServingCluster → every Kubernetes object that serves it.

Nothing here talks to a cluster: `render(sc)` is a function of the object alone (spec, plus the
autoscaler's decisions kept in its status), so it can be snapshot-tested and run by `tandem render`.
Owner references are added by the apply layer, which knows the object's uid.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

from tandem.common.roles import LABEL_CLUSTER, LABEL_ROLE, ROLES, Role
from tandem.common.routing import AdmissionConfig
from tandem.operator.api import (
    EngineSpec,
    EnvVar,
    PoolSpec,
    ProbeOverride,
    Probes,
    RouterSpec,
    ServingCluster,
    Toleration,
    pool_replicas,
)
from tandem.operator.drain import engine_lifecycle, shutdown_timeout
from tandem.operator.gpu_sharing import WHOLE_GPU, gpu_memory_utilization, gpu_resource
from tandem.operator.lora_render import lora_args, lora_env
from tandem.operator.tokenizer import engine_chat_template, router_tokenizer, tokenizer_pod_parts
from tandem.router.config import (
    AuthConfig,
    KubernetesDiscovery,
    RouterConfig,
    StaticDiscovery,
    TrustConfig,
)

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


def _meta(sc: ServingCluster, name: str, role: Component | None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": sc.namespace,
        "labels": role_labels(sc, role) if role else common_labels(sc),
    }
    if sc.spec.annotations:
        meta["annotations"] = dict(sc.spec.annotations)
    return meta


def _compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def disaggregated(sc: ServingCluster) -> bool:
    """Whether a prefill pool exists and the engines carry the KV connector."""
    return sc.spec.router.disaggregation.mode != "never"


def rendered_roles(sc: ServingCluster) -> tuple[Role, ...]:
    return ROLES if disaggregated(sc) else ("decode",)


def endpoint(sc: ServingCluster) -> str:
    """In-cluster URL of the router Service."""
    return f"http://{child_name(sc, 'router')}.{sc.namespace}:{sc.spec.router.service.port}"


# --- engines -----------------------------------------------------------------------------------


def kv_transfer_config(sc: ServingCluster, role: Role) -> dict[str, Any]:
    """vLLM's --kv-transfer-config: prefill produces KV blocks, decode consumes them. A decode
    engine whose KV pull fails (prefill pod gone, handshake timed out) recomputes the prompt
    itself (`kv_load_failure_policy: recompute`) instead of failing the request (vLLM's default)."""
    engine = sc.spec.engine
    config: dict[str, Any] = {
        "kv_connector": engine.kv_connector,
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
    }
    if role == "decode":
        config["kv_load_failure_policy"] = "recompute"
    if engine.kv_buffer_device:
        config["kv_buffer_device"] = engine.kv_buffer_device
    if engine.kv_connector_extra_config:
        config["kv_connector_extra_config"] = engine.kv_connector_extra_config
    return config


def kv_events_config(ports: EnginePorts = POD_PORTS) -> dict[str, Any]:
    """vLLM's --kv-events-config: a binding PUB endpoint and a replay endpoint (docs/protocols.md §2);
    `*` even on one machine, since vLLM connects instead of binding to any other host."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{ports.kv_events}",
        "replay_endpoint": f"tcp://*:{ports.kv_replay}",
        "topic": KV_EVENTS_TOPIC,
    }


def _pool(sc: ServingCluster, role: Role) -> PoolSpec:
    pool: PoolSpec = getattr(sc.spec, role)
    return pool


def vllm_args(sc: ServingCluster, role: Role, ports: EnginePorts = POD_PORTS) -> list[str]:
    """The arguments after `vllm serve` of one pool: the model first, then flags."""
    spec = sc.spec
    model, engine, pool = spec.model, spec.engine, _pool(sc, role)
    args = [
        model.name,
        "--served-model-name", model.served_model_name,
        "--host", ports.host,
        "--port", str(ports.http),
        "--tensor-parallel-size", str(pool.tensor_parallel_size),
        "--block-size", str(engine.block_size),
        "--enable-prefix-caching",
        "--prefix-caching-hash-algo", engine.hash_algo,
        "--kv-events-config", _compact_json(kv_events_config(ports)),
        "--max-num-batched-tokens", str(pool.max_num_batched_tokens),
        "--gpu-memory-utilization", str(gpu_memory_utilization(engine, pool)),
        "--shutdown-timeout", str(shutdown_timeout(pool)),
    ]  # fmt: skip
    if disaggregated(sc):
        args += ["--kv-transfer-config", _compact_json(kv_transfer_config(sc, role))]
    if pool.max_num_seqs is not None:
        args += ["--max-num-seqs", str(pool.max_num_seqs)]
    if model.max_model_len is not None:
        args += ["--max-model-len", str(model.max_model_len)]
    if model.revision:
        args += ["--revision", model.revision]
    if model.tokenizer:
        args += ["--tokenizer", model.tokenizer]
    if model.trust_remote_code:
        args.append("--trust-remote-code")
    if engine.dtype != "auto":
        args += ["--dtype", engine.dtype]
    if engine.quantization:
        args += ["--quantization", engine.quantization]
    if engine.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", engine.kv_cache_dtype]
    if engine.enforce_eager:
        args.append("--enforce-eager")
    if pool.speculative:
        speculative = pool.speculative
        config: dict[str, Any] = {
            "method": speculative.method,
            "num_speculative_tokens": speculative.num_speculative_tokens,
        }
        for key, value in (
            ("model", speculative.model),
            ("prompt_lookup_max", speculative.prompt_lookup_max),
            ("prompt_lookup_min", speculative.prompt_lookup_min),
            ("draft_tensor_parallel_size", speculative.draft_tensor_parallel_size),
        ):
            if value is not None:
                config[key] = value
        args += ["--speculative-config", _compact_json(config)]
    args += lora_args(spec.lora, pool)
    return args + engine.extra_args + pool.extra_args


def _env_dicts(env: list[EnvVar]) -> list[dict[str, Any]]:
    return [e.model_dump(by_alias=True, exclude_none=True) for e in env]


def merge_env(*layers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Later layers replace earlier variables of the same name, keeping first-seen order."""
    merged: dict[str, dict[str, Any]] = {}
    for layer in layers:
        for var in layer:
            merged[var["name"]] = var
    return list(merged.values())


def vllm_env(
    sc: ServingCluster, role: Role, ports: EnginePorts = POD_PORTS
) -> list[dict[str, Any]]:
    """Environment of one pool's engine container (core/v1 EnvVar dicts)."""
    spec = sc.spec
    base: list[dict[str, Any]] = [
        # The prefix-cache hash chain starts from hash(seed): pinned so the router reproduces it.
        {"name": "PYTHONHASHSEED", "value": spec.engine.hash_seed},
        {
            "name": "VLLM_NIXL_SIDE_CHANNEL_HOST",
            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
        },
        {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(ports.nixl_side_channel)},
    ]
    if disaggregated(sc):
        low, high = NIXL_TRANSFER_PORTS
        base.append({"name": "UCX_TCP_PORT_RANGE", "value": f"{low}-{high}"})
    # A writable home for vLLM's, Triton's and torch's caches under a read-only root filesystem.
    base += [{"name": "HOME", "value": ENGINE_HOME}, {"name": "USER", "value": "vllm"}]
    if spec.model.hf_token_secret:
        ref = spec.model.hf_token_secret
        base.append(
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}
        )
    if spec.router.auth.engine_key:
        secret = {"name": engine_key_secret_name(sc), "key": ENGINE_KEY_SECRET_KEY}
        base.append({"name": ENGINE_KEY_ENV, "valueFrom": {"secretKeyRef": secret}})
    if spec.model.cache:
        base.append({"name": "HF_HOME", "value": f"{spec.model.cache.mount_path}/huggingface"})
        if spec.model.cache.read_only:
            base.append({"name": "HF_HUB_OFFLINE", "value": "1"})
    base += lora_env(spec.lora)
    return merge_env(base, _env_dicts(spec.engine.env), _env_dicts(_pool(sc, role).env))


def _probe(path: str, defaults: dict[str, int], override: ProbeOverride) -> dict[str, Any]:
    probe: dict[str, Any] = {"httpGet": {"path": path, "port": "http"}, **defaults}
    probe.update(override.model_dump(by_alias=True, exclude_none=True))
    return probe


def engine_probes(probes: Probes) -> dict[str, dict[str, Any]]:
    """Startup, readiness and liveness probes on /health; the startup probe allows model loading
    for `startupBudgetSeconds` (failureThreshold = ceil(budget / period))."""
    period = probes.startup.period_seconds or 10
    startup_defaults = {
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": -(-probes.startup_budget_seconds // period),
    }
    return {
        "startupProbe": _probe("/health", startup_defaults, probes.startup),
        "readinessProbe": _probe(
            "/health",
            {"periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 3},
            probes.readiness,
        ),
        "livenessProbe": _probe(
            "/health",
            {"periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6},
            probes.liveness,
        ),
    }


def engine_resources(pool: PoolSpec, gpu: str = WHOLE_GPU) -> dict[str, Any]:
    """The pool's resources, or one `gpu` (a GPU or a slice of one) per tensor-parallel rank with
    room for an 8B model's host side."""
    if pool.resources is not None:
        return pool.resources.model_dump(by_alias=True)
    return {
        "requests": {
            "cpu": str(4 * pool.tensor_parallel_size),
            "memory": f"{32 * pool.tensor_parallel_size}Gi",
        },
        "limits": {gpu: str(pool.tensor_parallel_size)},
    }


def _tolerations(tolerations: list[Toleration]) -> list[dict[str, Any]]:
    return [t.model_dump(by_alias=True, exclude_none=True) for t in tolerations]


def _placement(
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


def _pull_secrets(sc: ServingCluster) -> dict[str, Any]:
    if not sc.spec.image_pull_secrets:
        return {}
    return {"imagePullSecrets": [{"name": name} for name in sc.spec.image_pull_secrets]}


def engine_ports() -> list[dict[str, Any]]:
    return [
        {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
        {"name": "kv-events", "containerPort": KV_EVENTS_PORT, "protocol": "TCP"},
        {"name": "kv-replay", "containerPort": KV_REPLAY_PORT, "protocol": "TCP"},
        {"name": "nixl", "containerPort": NIXL_SIDE_CHANNEL_PORT, "protocol": "TCP"},
    ]


def _engine_volumes(
    engine: EngineSpec, sc: ServingCluster
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": str(engine.shm_size)}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "home", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "home", "mountPath": ENGINE_HOME},
    ]
    cache = sc.spec.model.cache
    if cache:
        volumes.append(
            {
                "name": "model-cache",
                "persistentVolumeClaim": {"claimName": cache.pvc, "readOnly": cache.read_only},
            }
        )
        mount: dict[str, Any] = {
            "name": "model-cache",
            "mountPath": cache.mount_path,
            "readOnly": cache.read_only,
        }
        if cache.sub_path:
            mount["subPath"] = cache.sub_path
        mounts.append(mount)
    return volumes, mounts


def engine_deployment(sc: ServingCluster, role: Role) -> dict[str, Any]:
    spec = sc.spec
    engine, pool = spec.engine, _pool(sc, role)
    probes = pool.probes or engine.probes
    volumes, mounts = _engine_volumes(engine, sc)
    relay, relay_volumes = gateway.relay_parts(sc, role)
    container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": pool.image or engine.image,
        "imagePullPolicy": engine.image_pull_policy,
        "command": ["vllm", "serve"],
        "args": vllm_args(sc, role),
        "env": vllm_env(sc, role),
        "ports": engine_ports(),
        "resources": engine_resources(pool, gpu_resource(engine)),
        "volumeMounts": mounts,
        # A crashed engine's last log lines become the container's termination message.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": container_security_context(ENGINE_UID, pool.security_context),
        **engine_probes(probes),
        **engine_lifecycle(pool),
    }
    pod_spec: dict[str, Any] = {
        "securityContext": pod_security_context(ENGINE_UID, pool.pod_security_context),
        "containers": [container, *relay],
        "volumes": [*volumes, *relay_volumes],
        # Service links would inject e.g. VLLM_PORT for a Service named "vllm", which vLLM misreads.
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": pool.termination_grace_period_seconds,
        **_pull_secrets(sc),
        **_placement(pool.node_selector, pool.tolerations, pool.affinity),
    }
    if spec.service_account_name:
        pod_spec["serviceAccountName"] = spec.service_account_name
    else:
        pod_spec["automountServiceAccountToken"] = False
    if pool.topology_spread_constraints:
        pod_spec["topologySpreadConstraints"] = pool.topology_spread_constraints
    if pool.priority_class_name:
        pod_spec["priorityClassName"] = pool.priority_class_name
    template_meta: dict[str, Any] = {"labels": {**role_labels(sc, role), **pool.pod_labels}}
    annotations = {**pool.pod_annotations, **engine_key_annotation(sc)}
    if annotations:
        template_meta["annotations"] = annotations
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(sc, child_name(sc, role), role),
        "spec": {
            **({} if external_scaling(sc) else {"replicas": pool_replicas(sc, role)}),
            "selector": {"matchLabels": selector_labels(sc, role)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {
                    "maxSurge": pool.rollout.max_surge,
                    "maxUnavailable": pool.rollout.max_unavailable,
                },
            },
            "revisionHistoryLimit": 5,
            # Loading weights can take most of the startup budget; only report a stuck rollout after it.
            "progressDeadlineSeconds": probes.startup_budget_seconds + 600,
            "template": {"metadata": template_meta, "spec": pod_spec},
        },
    }


def engine_service(sc: ServingCluster, role: Role) -> dict[str, Any]:
    """Headless Service of one pool: stable DNS for its pods (the router itself watches Pods)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(sc, child_name(sc, role), role),
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(sc, role),
            "ports": [
                {
                    "name": p["name"],
                    "port": p["containerPort"],
                    "targetPort": p["name"],
                    "protocol": "TCP",
                }
                for p in engine_ports()
            ],
        },
    }


def disruption_budget(sc: ServingCluster, role: Component) -> dict[str, Any]:
    """At most one pod of a component down at a time from voluntary disruptions (drains).

    maxUnavailable rather than minAvailable: it follows the Deployment's current scale (the
    autoscaler's, or a router scaled from 3 to 5) without being re-rendered, and a pod that is
    already unready counts against it, so a drain never takes a second one."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(sc, child_name(sc, role), role),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(sc, role)}},
    }


# --- router ------------------------------------------------------------------------------------


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
        scoring=router.scoring,
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
        "metadata": _meta(sc, child_name(sc, "router"), "router"),
        "data": {ROUTER_CONFIG_KEY: config.to_yaml()},
    }


def router_service_account(sc: ServingCluster) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(sc, child_name(sc, "router"), "router"),
        **_pull_secrets(sc),
    }


def router_role(sc: ServingCluster) -> dict[str, Any]:
    """The router watches its cluster's engine Pods (discovery) and reads the pools' Deployments
    and ReplicaSets (a Pod is admitted only when the pool's ReplicaSet controls it)."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(sc, child_name(sc, "router"), "router"),
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
        "metadata": _meta(sc, name, "router"),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": sc.namespace}],
    }


def config_hash(config_map: dict[str, Any]) -> str:
    """Digest of a ConfigMap's data; a pod-template annotation, so a config change rolls the pods."""
    return hashlib.sha256(_compact_json(config_map["data"]).encode()).hexdigest()[:16]


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


def router_deployment(sc: ServingCluster) -> dict[str, Any]:
    router = sc.spec.router
    name = child_name(sc, "router")
    volumes, mounts = router_volumes(sc)
    spread = router_spread(sc)

    def probe(path: str) -> dict[str, Any]:
        return {"httpGet": {"path": path, "port": "http"}, "timeoutSeconds": 3}

    container: dict[str, Any] = {
        "name": ROUTER_CONTAINER,
        "image": router.image,
        "imagePullPolicy": router.image_pull_policy,
        "command": ["tandem", "router"],
        "args": ["--config", f"{ROUTER_CONFIG_DIR}/{ROUTER_CONFIG_KEY}"],
        "ports": [
            {"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"},
            {"name": "admin", "containerPort": ROUTER_ADMIN_PORT, "protocol": "TCP"},
            *gateway.router_ports(sc),
        ],
        "resources": router_resources(router),
        "volumeMounts": mounts,
        # Ready while a decode engine is healthy; alive while the process serves (engines may
        # take minutes to load, and restarting the router then helps nobody).
        "readinessProbe": {**probe("/health"), "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {
            **probe("/livez"),
            "periodSeconds": 10,
            "failureThreshold": 6,
            "initialDelaySeconds": 10,
        },
        "securityContext": container_security_context(ROUTER_UID, router.security_context),
        # Out of the Service's endpoints before SIGTERM; then timeouts.shutdownSeconds to finish.
        "lifecycle": {"preStop": {"sleep": {"seconds": ROUTER_PRE_STOP_S}}},
    }
    init_containers, tokenizer_volumes, tokenizer_mounts = tokenizer_pod_parts(
        sc, container_security_context(ROUTER_UID, router.security_context)
    )
    container["volumeMounts"] += tokenizer_mounts
    if router.env:
        container["env"] = _env_dicts(router.env)
    annotations = {
        **router.pod_annotations,
        ANNOTATION_CONFIG_HASH: config_hash(router_config_map(sc)),
        **engine_key_annotation(sc),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(sc, name, "router"),
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
                    **_pull_secrets(sc),
                    **_placement(router.node_selector, router.tolerations, router.affinity),
                    **({"topologySpreadConstraints": spread} if spread else {}),
                },
            },
        },
    }


def router_service(sc: ServingCluster) -> dict[str, Any]:
    service = sc.spec.router.service
    meta = _meta(sc, child_name(sc, "router"), "router")
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
        "metadata": _meta(sc, child_name(sc, "router-admin"), "router"),
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


# --- optional objects --------------------------------------------------------------------------


def _engine_selector(sc: ServingCluster) -> dict[str, Any]:
    return {
        "matchLabels": {LABEL_CLUSTER: sc.name},
        "matchExpressions": [{"key": LABEL_ROLE, "operator": "In", "values": list(ROLES)}],
    }


# Copied onto every scraped series (as tandem_dev_cluster, tandem_dev_role): the autoscaler's
# queries select each pool by them.
MONITOR_POD_LABELS = [LABEL_CLUSTER, LABEL_ROLE]


def monitors(sc: ServingCluster) -> list[dict[str, Any]]:
    """A ServiceMonitor for the router and a PodMonitor for the engines (Prometheus Operator)."""
    monitoring = sc.spec.monitoring
    endpoint_ = {"port": "http", "path": "/metrics", "interval": monitoring.interval}
    # The router serves /metrics on its admin port only (the NAME-router-admin Service's).
    router_endpoint = {**endpoint_, "port": "admin"}

    def meta(name: str, role: Component | None) -> dict[str, Any]:
        meta_ = _meta(sc, name, role)
        meta_["labels"] = {**meta_["labels"], **monitoring.labels}
        return meta_

    return [
        {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "ServiceMonitor",
            "metadata": meta(child_name(sc, "router"), "router"),
            "spec": {
                "selector": {"matchLabels": selector_labels(sc, "router")},
                "namespaceSelector": {"matchNames": [sc.namespace]},
                "endpoints": [router_endpoint],
                "podTargetLabels": MONITOR_POD_LABELS,
            },
        },
        {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "PodMonitor",
            "metadata": meta(child_name(sc, "engines"), None),
            "spec": {
                "selector": _engine_selector(sc),
                "namespaceSelector": {"matchNames": [sc.namespace]},
                "podMetricsEndpoints": [endpoint_],
                "podTargetLabels": MONITOR_POD_LABELS,
            },
        },
    ]


def _pods(sc: ServingCluster, *roles: Component) -> dict[str, Any]:
    """A peer: this cluster's pods of `roles`, in its own namespace."""
    if len(roles) == 1:
        return {"podSelector": {"matchLabels": selector_labels(sc, roles[0])}}
    return {
        "podSelector": {
            "matchLabels": {LABEL_CLUSTER: sc.name},
            "matchExpressions": [{"key": LABEL_ROLE, "operator": "In", "values": list(roles)}],
        }
    }


def _tcp(*ports: int | str) -> list[dict[str, Any]]:
    return [{"port": port, "protocol": "TCP"} for port in ports]


def _nixl_ports() -> list[dict[str, Any]]:
    low, high = NIXL_TRANSFER_PORTS
    return [*_tcp(NIXL_SIDE_CHANNEL_PORT), {"port": low, "endPort": high, "protocol": "TCP"}]


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
    return [{"to": to, "ports": _tcp(*ports)}] if to and ports else []


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
        "metadata": _meta(sc, name, role),
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
    router_in: dict[str, Any] = {"ports": _tcp("http")}
    if policy.allow_from:
        router_in["from"] = policy.allow_from
    # Prometheus scrapes the router's admin port (/metrics is not served on http).
    router_ingress = [router_in, {"from": [prometheus], "ports": _tcp("admin")}]
    router_ingress += gateway.router_ingress(sc)
    engine_ports = _tcp(HTTP_PORT, KV_EVENTS_PORT, KV_REPLAY_PORT)
    router_egress = [
        {"to": [_pods(sc, *rendered_roles(sc))], "ports": engine_ports},
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
            {"from": [_pods(sc, "router")], "ports": _tcp("http", "kv-events", "kv-replay")},
            {"from": [prometheus], "ports": _tcp("http")},
            *gateway.engine_ingress(sc, role),
        ]
        egress: list[dict[str, Any]] = gateway.engine_egress(sc, role)
        if disaggregated(sc):
            peer = _pods(sc, "decode" if role == "prefill" else "prefill")
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


# --- auth and pod security ---------------------------------------------------------------------


def engine_key_secret_name(sc: ServingCluster) -> str:
    return child_name(sc, "engine-key")


def engine_key_secret(sc: ServingCluster, key: str) -> dict[str, Any]:
    """The engine API key Secret. The operator creates it once with a random key (never reads or
    rewrites it); `tandem render` prints it with a fresh key."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(sc, engine_key_secret_name(sc), None),
        "type": "Opaque",
        "stringData": {ENGINE_KEY_SECRET_KEY: key},
    }


def engine_key_annotation(sc: ServingCluster) -> dict[str, str]:
    generated = sc.status.engine_key_secret
    if not sc.spec.router.auth.engine_key or generated is None:
        return {}
    return {ANNOTATION_ENGINE_KEY: generated.uid}


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


def router_volumes(sc: ServingCluster) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The router's config, a scratch /tmp, and the key Secrets (whole Secret volumes, not
    subPath mounts, so the kubelet's updates reach the running router)."""
    name = child_name(sc, "router")
    auth = sc.spec.router.auth
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": name}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": ROUTER_CONFIG_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    secrets: list[tuple[str, str, str]] = []
    if auth.client_keys_secret:
        secrets.append(("client-keys", auth.client_keys_secret.name, ROUTER_CLIENT_KEYS_DIR))
    if auth.engine_key:
        secrets.append(("engine-key", engine_key_secret_name(sc), ROUTER_ENGINE_KEY_DIR))
    for volume, secret, path in secrets:
        volumes.append({"name": volume, "secret": {"secretName": secret, "defaultMode": 0o440}})
        mounts.append({"name": volume, "mountPath": path, "readOnly": True})
    return volumes, mounts


def pod_security_context(uid: int, override: dict[str, Any] | None) -> dict[str, Any]:
    """Non-root with the given uid/gid (fsGroup too, so Secret and volume files are readable) and
    the RuntimeDefault seccomp profile; `override` keys replace these."""
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
        **(override or {}),
    }


def container_security_context(uid: int, override: dict[str, Any] | None) -> dict[str, Any]:
    """What the "restricted" Pod Security Standard asks of a container, plus a read-only root
    filesystem; `override` keys replace these."""
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
        **(override or {}),
    }


def render(sc: ServingCluster) -> list[dict[str, Any]]:
    """Every child object of a ServingCluster, in the order they are best applied."""
    objects: list[dict[str, Any]] = [
        router_service_account(sc),
        router_role(sc),
        router_role_binding(sc),
        router_config_map(sc),
    ]
    for role in rendered_roles(sc):
        objects += [
            engine_service(sc, role),
            engine_deployment(sc, role),
            disruption_budget(sc, role),
        ]
    objects += [
        router_service(sc),
        router_admin_service(sc),
        router_deployment(sc),
        *gateway.objects(sc),
    ]
    if sc.spec.router.replicas > 1:
        # One router pod has nothing to keep through a drain (a budget of maxUnavailable 1 would
        # allow evicting it anyway); dropping back to one prunes the budget.
        objects.append(disruption_budget(sc, "router"))
    if sc.spec.monitoring.enabled:
        objects += monitors(sc)
    if sc.spec.network_policy.enabled:
        objects += network_policies(sc)
    if external_scaling(sc):
        objects += provider_autoscalers(sc)
    return objects


def external_scaling(sc: ServingCluster) -> bool:
    """The pools are sized by KEDA or an HPA, so the Deployments must not claim `replicas`."""
    scaling = sc.spec.autoscaling
    return scaling.enabled and scaling.provider != "tandem"


def provider_autoscalers(sc: ServingCluster) -> list[dict[str, Any]]:
    """The ScaledObjects or HPAs of `spec.autoscaling.provider`, one per pool."""
    # Imported here: those renderers build on this module's names.
    from tandem.operator.autoscaling.external import external_autoscalers

    return external_autoscalers(sc, sc.spec.autoscaling.provider)


# The Gateway API Inference Extension's parts build on this module's names (imported last).
from tandem.operator import inference_pool as gateway  # noqa: E402
