"""The renderer: every object valid for Kubernetes 1.34, and the vLLM flags of each pool."""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest
import yaml
from sc_manifests import cluster

from tandem.operator.api import ServingCluster
from tandem.operator.api_status import AutoscalingStatus
from tandem.operator.engine_render import vllm_args, vllm_env
from tandem.operator.render import render
from tandem.operator.router_render import (
    config_hash,
    router_config,
    router_config_map,
    router_deployment,
)
from tandem.operator.tokenizer import TOKENIZER_DIR
from tandem.router.config import RouterConfig

K8S_VERSION = "1.34.0"
# Prometheus Operator kinds have no schema in kubernetes-validate; their shape is asserted below.
CUSTOM_KINDS = {"ServiceMonitor", "PodMonitor"}


def by_kind(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def everything_on() -> ServingCluster:
    return cluster(
        model={
            "name": "meta-llama/Llama-3.1-8B-Instruct",
            "servedName": "llama",
            "revision": "main",
            "maxModelLen": 8192,
            "cache": {"pvc": "models", "subPath": "llama"},
            "hfTokenSecret": {"name": "hf", "key": "HF_TOKEN"},
        },
        engine={"quantization": "fp8", "kvCacheDtype": "fp8", "extraArgs": ["--disable-log-stats"],
                "env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}]},
        prefill={"replicas": 2, "tensorParallelSize": 2, "nodeSelector": {"gpu": "h200"},
                 "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                 "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                     "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
                 "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                                "whenUnsatisfiable": "ScheduleAnyway"}],
                 "priorityClassName": "serving", "podAnnotations": {"a": "b"}},
        decode={"replicas": 3, "speculative": {"method": "ngram", "numSpeculativeTokens": 4, "promptLookupMax": 4},
                "env": [{"name": "PYTHONHASHSEED", "value": "7"}], "extraArgs": ["--max-num-seqs", "128"],
                "probes": {"startupBudgetSeconds": 600, "readiness": {"periodSeconds": 2}}},
        router={"replicas": 2, "service": {"type": "LoadBalancer", "annotations": {"lb": "internal"}},
                "env": [{"name": "X", "value": "1"}]},
        monitoring={"labels": {"release": "prometheus"}},
        networkPolicy={"enabled": True, "allowFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]},
        imagePullSecrets=["regcred"],
        labels={"team": "ml"},
        annotations={"owner": "ml-platform"},
    )  # fmt: skip


@pytest.mark.parametrize("make", ["pd", "colocated", "everything"])
def test_every_object_validates_against_kubernetes_1_34(
    make: str, pd_cluster: ServingCluster, colocated_cluster: ServingCluster
) -> None:
    sc = {"pd": pd_cluster, "colocated": colocated_cluster, "everything": everything_on()}[make]
    objects = render(sc)
    kinds = {o["kind"] for o in objects}
    assert {
        "Deployment",
        "Service",
        "ConfigMap",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "PodDisruptionBudget",
    } <= kinds
    for obj in objects:
        if obj["kind"] in CUSTOM_KINDS:
            continue
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_objects_of_the_pd_example(pd_cluster: ServingCluster) -> None:
    names = {(o["kind"], o["metadata"]["name"]) for o in render(pd_cluster)}
    assert names == {
        ("ServiceAccount", "llama-8b-router"), ("Role", "llama-8b-router"), ("RoleBinding", "llama-8b-router"),
        ("ConfigMap", "llama-8b-router"), ("Service", "llama-8b-router"), ("Deployment", "llama-8b-router"),
        ("Service", "llama-8b-router-admin"),
        ("Service", "llama-8b-prefill"), ("Deployment", "llama-8b-prefill"), ("PodDisruptionBudget", "llama-8b-prefill"),
        ("Service", "llama-8b-decode"), ("Deployment", "llama-8b-decode"), ("PodDisruptionBudget", "llama-8b-decode"),
        ("ServiceMonitor", "llama-8b-router"), ("PodMonitor", "llama-8b-engines"),
        ("NetworkPolicy", "llama-8b-router"), ("NetworkPolicy", "llama-8b-prefill"),
        ("NetworkPolicy", "llama-8b-decode"),
    }  # fmt: skip
    for obj in render(pd_cluster):
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "tandem"
        assert labels["app.kubernetes.io/instance"] == "llama-8b"
        assert labels["app.kubernetes.io/managed-by"] == "tandem-operator"
        assert labels["tandem.dev/cluster"] == "llama-8b"
        assert obj["metadata"]["namespace"] == "default"
        assert "ownerReferences" not in obj["metadata"]


@pytest.mark.parametrize(
    ("role", "kv_role"), [("prefill", "kv_producer"), ("decode", "kv_consumer")]
)
def test_vllm_args_of_each_pool(pd_cluster: ServingCluster, role: str, kv_role: str) -> None:
    args = vllm_args(pd_cluster, role)  # type: ignore[arg-type]
    assert args[0] == "meta-llama/Llama-3.1-8B-Instruct"
    assert flag(args, "--served-model-name") == "llama-8b"
    assert flag(args, "--host") == "0.0.0.0"
    assert flag(args, "--port") == "8000"
    assert flag(args, "--tensor-parallel-size") == "1"
    assert flag(args, "--block-size") == "16"
    assert "--enable-prefix-caching" in args
    assert flag(args, "--prefix-caching-hash-algo") == "sha256_cbor"
    assert flag(args, "--max-num-batched-tokens") == "8192"
    assert flag(args, "--max-model-len") == "16384"
    # A failed KV pull makes the decode engine recompute the prompt, not fail the request.
    recompute = ',"kv_load_failure_policy":"recompute"' if role == "decode" else ""
    assert (
        flag(args, "--kv-transfer-config")
        == f'{{"kv_connector":"NixlConnector","kv_role":"{kv_role}"{recompute}}}'
    )
    assert json.loads(flag(args, "--kv-events-config")) == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5558",
        "topic": "kv-events",
    }
    assert (role == "decode") == ("--max-num-seqs" in args)


def test_colocated_engines_have_no_connector(colocated_cluster: ServingCluster) -> None:
    objects = render(colocated_cluster)
    roles = {
        o["metadata"]["labels"].get("tandem.dev/role") for o in objects if o["kind"] == "Deployment"
    }
    assert roles == {"decode", "router"}
    args = vllm_args(colocated_cluster, "decode")
    assert "--kv-transfer-config" not in args
    assert "--kv-events-config" in args


def test_engine_env(pd_cluster: ServingCluster) -> None:
    env = {e["name"]: e for e in vllm_env(pd_cluster, "prefill")}
    assert env["PYTHONHASHSEED"]["value"] == "0"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "status.podIP"}
    }
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == "5600"
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}


def test_engine_deployment(pd_cluster: ServingCluster) -> None:
    deployment = by_kind(render(pd_cluster), "Deployment", "llama-8b-prefill")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["selector"]["matchLabels"] == {
        "tandem.dev/cluster": "llama-8b",
        "tandem.dev/role": "prefill",
    }
    template = deployment["spec"]["template"]
    assert template["metadata"]["labels"]["tandem.dev/role"] == "prefill"
    pod = template["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["vllm", "serve"]
    assert container["args"] == vllm_args(pd_cluster, "prefill")
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "http": 8000, "kv-events": 5557, "kv-replay": 5558, "nixl": 5600,
    }  # fmt: skip
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 1}
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800
    assert pod["enableServiceLinks"] is False
    assert pod["automountServiceAccountToken"] is False


def test_overrides_and_options() -> None:
    sc = everything_on()
    objects = render(sc)
    prefill = by_kind(objects, "Deployment", "m-prefill")["spec"]["template"]["spec"]
    decode = by_kind(objects, "Deployment", "m-decode")["spec"]["template"]["spec"]
    p_args, d_args = prefill["containers"][0]["args"], decode["containers"][0]["args"]
    assert flag(p_args, "--tensor-parallel-size") == "2"
    assert prefill["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert flag(p_args, "--quantization") == "fp8"
    assert flag(p_args, "--kv-cache-dtype") == "fp8"
    assert flag(p_args, "--revision") == "main"
    assert p_args[-1] == "--disable-log-stats"
    assert "--speculative-config" not in p_args
    assert json.loads(flag(d_args, "--speculative-config")) == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
    }  # fmt: skip
    assert d_args[-3:] == ["--disable-log-stats", "--max-num-seqs", "128"]
    d_env = {e["name"]: e for e in decode["containers"][0]["env"]}
    assert d_env["PYTHONHASHSEED"]["value"] == "7"  # pool env replaces the default
    assert d_env["VLLM_LOGGING_LEVEL"]["value"] == "DEBUG"
    assert d_env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "HF_TOKEN"}
    assert d_env["HF_HOME"]["value"] == "/models/huggingface"
    assert {
        "name": "model-cache",
        "mountPath": "/models",
        "readOnly": False,
        "subPath": "llama",
    } in decode["containers"][0]["volumeMounts"]
    assert {
        "name": "model-cache",
        "persistentVolumeClaim": {"claimName": "models", "readOnly": False},
    } in decode["volumes"]
    startup = decode["containers"][0]["startupProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] == 600
    assert decode["containers"][0]["readinessProbe"]["periodSeconds"] == 2
    assert prefill["nodeSelector"] == {"gpu": "h200"}
    assert prefill["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert prefill["priorityClassName"] == "serving"
    assert prefill["imagePullSecrets"] == [{"name": "regcred"}]
    for obj in objects:
        assert obj["metadata"]["labels"]["team"] == "ml"
        assert obj["metadata"]["annotations"]["owner"] == "ml-platform"
    service = by_kind(objects, "Service", "m-router")
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["metadata"]["annotations"]["lb"] == "internal"
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    assert len(policies) == 3
    monitors = [o for o in objects if o["kind"] in CUSTOM_KINDS]
    assert all(m["metadata"]["labels"]["release"] == "prometheus" for m in monitors)


def test_monitors_shape(pd_cluster: ServingCluster) -> None:
    objects = render(pd_cluster)
    service_monitor = by_kind(objects, "ServiceMonitor", "llama-8b-router")
    assert service_monitor["spec"]["endpoints"] == [
        {"port": "admin", "path": "/metrics", "interval": "15s"}
    ]  # the router serves /metrics on its admin port only
    admin = by_kind(objects, "Service", "llama-8b-router-admin")
    assert admin["spec"]["type"] == "ClusterIP"
    assert admin["spec"]["ports"][0]["name"] == "admin"
    pod_monitor = by_kind(objects, "PodMonitor", "llama-8b-engines")
    assert pod_monitor["spec"]["selector"]["matchExpressions"][0]["values"] == ["prefill", "decode"]
    off = cluster(monitoring={"enabled": False})
    assert not [o for o in render(off) if o["kind"] in CUSTOM_KINDS]


def test_router_objects(pd_cluster: ServingCluster) -> None:
    objects = render(pd_cluster)
    deployment = by_kind(objects, "Deployment", "llama-8b-router")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["tandem", "router"]
    assert container["args"] == ["--config", "/etc/tandem/router.yaml"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"  # alive while engines load
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["image"].startswith("ghcr.io/tandem-serving/tandem:")
    assert pod["serviceAccountName"] == "llama-8b-router"
    config_map = by_kind(objects, "ConfigMap", "llama-8b-router")
    config = RouterConfig.model_validate(yaml.safe_load(config_map["data"]["router.yaml"]))
    assert config == router_config(pd_cluster, tokenizer=TOKENIZER_DIR)
    role = by_kind(objects, "Role", "llama-8b-router")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        # discovery checks each Pod's owner chain (ReplicaSet -> the pool's Deployment)
        {
            "apiGroups": ["apps"],
            "resources": ["deployments", "replicasets"],
            "verbs": ["get", "list"],
        },
    ]
    binding = by_kind(objects, "RoleBinding", "llama-8b-router")
    assert binding["subjects"][0]["name"] == "llama-8b-router"
    headless = by_kind(objects, "Service", "llama-8b-decode")
    assert headless["spec"]["clusterIP"] == "None"


def test_router_config(pd_cluster: ServingCluster) -> None:
    config = router_config(pd_cluster)
    assert config.served_model_name == "llama-8b"
    assert config.block_size == 16
    assert config.hash_algo == "sha256_cbor"
    assert config.hash_seed == "0"
    assert config.kubernetes is not None
    assert (config.kubernetes.namespace, config.kubernetes.cluster_name) == ("default", "llama-8b")
    assert (config.kubernetes.engine_port, config.kubernetes.kv_events_port) == (8000, 5557)
    assert config.kubernetes.kv_events_replay_port == 5558
    assert config.static is None
    assert config.disaggregation.mode == "auto"
    assert config.scoring.prefix_weight == 3


def test_config_change_rolls_the_router() -> None:
    before = cluster()
    after = cluster(router={"scoring": {"prefixWeight": 5}})
    annotation = "tandem.dev/config-hash"

    def hash_of(sc: ServingCluster) -> str:
        return router_deployment(sc)["spec"]["template"]["metadata"]["annotations"][annotation]

    assert hash_of(before) == config_hash(router_config_map(before))
    assert hash_of(before) != hash_of(after)


def test_autoscaler_decision_sets_replicas() -> None:
    sc = cluster(autoscaling={"enabled": True, "prefill": {"min": 1, "max": 4}})
    sc.status.autoscaling = AutoscalingStatus.model_validate({"prefill": {"replicas": 3}})
    assert by_kind(render(sc), "Deployment", "m-prefill")["spec"]["replicas"] == 3


def test_render_is_pure_and_deterministic(pd_cluster: ServingCluster) -> None:
    assert render(pd_cluster) == render(pd_cluster.model_copy(deep=True))


@pytest.mark.parametrize(
    ("provider", "kind"), [("hpa", "HorizontalPodAutoscaler"), ("keda", "ScaledObject")]
)
def test_external_provider_renders_its_autoscalers_and_leaves_replicas_to_them(
    provider: str, kind: str
) -> None:
    sc = cluster(autoscaling={"enabled": True, "provider": provider})
    objects = render(sc)
    for role in ("prefill", "decode"):
        deployment = by_kind(objects, "Deployment", f"{sc.name}-{role}")
        assert "replicas" not in deployment["spec"]
        scaler = by_kind(objects, kind, f"{sc.name}-{role}")
        assert scaler["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    if kind == "HorizontalPodAutoscaler":
        for hpa in (o for o in objects if o["kind"] == kind):
            kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)


def test_builtin_autoscaler_keeps_replicas_and_renders_no_external_scalers() -> None:
    objects = render(cluster(autoscaling={"enabled": True}))
    assert not [o for o in objects if o["kind"] in {"HorizontalPodAutoscaler", "ScaledObject"}]
    assert all("replicas" in o["spec"] for o in objects if o["kind"] == "Deployment")
