"""The engine pools' objects: `vllm serve` flags and environment, probes, Deployment, Service."""

from __future__ import annotations

from typing import Any

from tandem.common.roles import Role
from tandem.operator import inference_pool as gateway
from tandem.operator.api import ServingCluster, pool_replicas
from tandem.operator.api_engine import EngineSpec, PoolSpec
from tandem.operator.api_kube import ProbeOverride, Probes
from tandem.operator.common_render import (
    ENGINE_CONTAINER,
    ENGINE_HOME,
    ENGINE_KEY_ENV,
    ENGINE_KEY_SECRET_KEY,
    ENGINE_UID,
    HTTP_PORT,
    KV_EVENTS_PORT,
    KV_EVENTS_TOPIC,
    KV_REPLAY_PORT,
    NIXL_SIDE_CHANNEL_PORT,
    NIXL_TRANSFER_PORTS,
    POD_PORTS,
    EnginePorts,
    child_meta,
    child_name,
    compact_json,
    disaggregated,
    env_dicts,
    external_scaling,
    last_flag,
    pod_placement,
    pull_secrets,
    role_labels,
    selector_labels,
)
from tandem.operator.drain import engine_lifecycle, shutdown_timeout
from tandem.operator.gpu_sharing import WHOLE_GPU, gpu_memory_utilization, gpu_resource
from tandem.operator.lora_render import lora_args, lora_env
from tandem.operator.security_render import (
    container_security_context,
    engine_key_annotation,
    engine_key_secret_name,
    pod_security_context,
)


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
        "--kv-events-config", compact_json(kv_events_config(ports)),
        "--max-num-batched-tokens", str(pool.max_num_batched_tokens),
        "--gpu-memory-utilization", str(gpu_memory_utilization(engine, pool)),
        "--shutdown-timeout", str(shutdown_timeout(pool)),
    ]  # fmt: skip
    if disaggregated(sc):
        args += ["--kv-transfer-config", compact_json(kv_transfer_config(sc, role))]
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
        args += ["--speculative-config", compact_json(config)]
    args += lora_args(spec.lora, pool)
    return args + engine.extra_args + pool.extra_args


def step_tokens(sc: ServingCluster, role: Role) -> int:
    """The pool's step budget as its engines read their arguments: the last
    `--max-num-batched-tokens`, so an `extraArgs` override counts."""
    value = last_flag(vllm_args(sc, role), "--max-num-batched-tokens")
    try:
        tokens = int(value or "")
    except ValueError:
        tokens = 0
    if tokens < 1:
        raise ValueError(
            f"spec.{role}: --max-num-batched-tokens {value!r} (extraArgs) is not a positive integer"
        )
    return tokens


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
    return merge_env(base, env_dicts(spec.engine.env), env_dicts(_pool(sc, role).env))


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
        **pull_secrets(sc),
        **pod_placement(pool.node_selector, pool.tolerations, pool.affinity),
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
        "metadata": child_meta(sc, child_name(sc, role), role),
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
        "metadata": child_meta(sc, child_name(sc, role), role),
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
