"""The stand-in kubelet's pod-to-process translation (pure; no cluster needed)."""

from __future__ import annotations

import json
from pathlib import PurePosixPath
from typing import Any

import pytest
import yaml

from e2e.harness.podspec import (
    UnsupportedPod,
    container_env,
    engine_args,
    expand,
    plan_pod,
)

KV_EVENTS = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": "tcp://*:5557",
    "replay_endpoint": "tcp://*:5558",
    "topic": "kv-events",
}
OBJECTS: dict[tuple[str, str], dict[str, str]] = {
    ("ConfigMap", "llama-router"): {
        "router.yaml": "host: 0.0.0.0\nport: 8000\nservedModelName: m\n"
    },
    ("Secret", "hf-token"): {"token": "hf_secret"},
}


def read(kind: str, namespace: str, name: str) -> dict[str, str] | None:
    return OBJECTS.get((kind, name))


def pod(container: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "llama-decode-abc",
            "namespace": "serving",
            "uid": "u1",
            "labels": {"tandem.dev/role": "decode"},
        },
        "spec": {"containers": [container], "nodeName": "kwok-gpu-0", **spec},
        "status": {"phase": "Running", "podIP": "127.0.1.7", "hostIP": "127.0.0.1"},
    }


def engine_container() -> dict[str, Any]:
    return {
        "name": "vllm",
        "command": ["vllm", "serve"],
        "args": [
            "meta-llama/Llama-3.1-8B-Instruct",
            "--host",
            "0.0.0.0",
            "--port",
            "8000",
            "--kv-events-config",
            json.dumps(KV_EVENTS),
        ],
        "env": [
            {"name": "PYTHONHASHSEED", "value": "0"},
            {
                "name": "VLLM_NIXL_SIDE_CHANNEL_HOST",
                "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
            },
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}},
            },
            {"name": "WHERE", "value": "$(VLLM_NIXL_SIDE_CHANNEL_HOST):$$(X)"},
        ],
    }


def test_engine_pod_becomes_an_emulator_bound_to_the_pod_ip() -> None:
    plan = plan_pod(
        pod(engine_container()),
        read,
        tandem=("/venv/bin/python", "-m", "tandem.cli"),
        scratch=PurePosixPath("/tmp/p"),
        engine_extra_args=("--fast",),
    )
    assert plan.role == "decode"
    assert plan.argv[:5] == [
        "/venv/bin/python",
        "-m",
        "tandem.cli",
        "emulate",
        "meta-llama/Llama-3.1-8B-Instruct",
    ]
    assert plan.argv[-5:] == ["--host", "127.0.1.7", "--kv-events-bind-host", "127.0.1.7", "--fast"]
    assert plan.argv.count("--host") == 1
    # The rendered KV-events config is passed unchanged (vLLM's wildcard bind).
    assert json.loads(plan.argv[plan.argv.index("--kv-events-config") + 1]) == KV_EVENTS
    assert plan.env == {
        "PYTHONHASHSEED": "0",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.1.7",
        "HF_TOKEN": "hf_secret",
        "WHERE": "127.0.1.7:$(X)",
    }


def test_router_pod_gets_its_configmap_as_a_file_bound_to_the_pod_ip() -> None:
    container = {
        "name": "router",
        "command": ["tandem", "router"],
        "args": ["--config", "/etc/tandem/router.yaml"],
        "volumeMounts": [{"name": "config", "mountPath": "/etc/tandem"}],
    }
    volumes = [{"name": "config", "configMap": {"name": "llama-router"}}]
    plan = plan_pod(
        pod(container, volumes=volumes), read, tandem=("tandem",), scratch=PurePosixPath("/s")
    )
    assert plan.role == "router"
    assert plan.argv == ["tandem", "router", "--config", "/s/config/router.yaml"]
    config = yaml.safe_load(plan.files["/s/config/router.yaml"])
    assert config["host"] == "127.0.1.7"
    assert "tokenizer" not in config

    # With the tokenizer-fetching init container, the emulators' own tokenization stands in for
    # the Hub's files (no Hub here).
    fetch = {"name": "fetch-tokenizer", "image": "vllm/vllm-openai", "command": ["python3"]}
    plan = plan_pod(
        pod(container, volumes=volumes, initContainers=[fetch]),
        read,
        tandem="tandem",
        scratch=PurePosixPath("/s"),
    )
    assert yaml.safe_load(plan.files["/s/config/router.yaml"])["tokenizer"] == "tandem-fallback"


def test_router_secret_volumes_become_files_its_config_points_at() -> None:
    objects = {
        ("ConfigMap", "llama-router"): {
            "router.yaml": "servedModelName: m\nauth:\n"
            "  engineKeyFile: /var/run/tandem/engine-key/api-key\n"
        },
        ("Secret", "llama-engine-key"): {"api-key": "k1"},
    }
    container = {
        "name": "router",
        "command": ["tandem", "router"],
        "args": ["--config", "/etc/tandem/router.yaml"],
        "volumeMounts": [
            {"name": "config", "mountPath": "/etc/tandem"},
            {"name": "engine-key", "mountPath": "/var/run/tandem/engine-key"},
        ],
    }
    volumes = [
        {"name": "config", "configMap": {"name": "llama-router"}},
        {"name": "engine-key", "secret": {"secretName": "llama-engine-key"}},
    ]
    plan = plan_pod(
        pod(container, volumes=volumes),
        lambda kind, ns, name: objects.get((kind, name)),
        tandem="tandem",
        scratch=PurePosixPath("/s"),
    )
    assert plan.files["/s/engine-key/api-key"] == "k1"
    config = yaml.safe_load(plan.files["/s/config/router.yaml"])
    assert config["auth"]["engineKeyFile"] == "/s/engine-key/api-key"


def test_engine_listeners_bind_the_pod_ip() -> None:
    assert engine_args(["m", "--host=0.0.0.0", "--port", "8000"], "127.0.1.3") == [
        "m", "--port", "8000", "--host", "127.0.1.3", "--kv-events-bind-host", "127.0.1.3"
    ]  # fmt: skip


def test_kubernetes_variable_expansion() -> None:
    assert expand("$(A)-$(B)-$$(A)", {"A": "x"}) == "x-$(B)-$(A)"


def test_unknown_images_and_missing_sources_are_refused_clearly() -> None:
    with pytest.raises(UnsupportedPod, match="no local stand-in"):
        plan_pod(
            pod({"name": "c", "command": ["nginx"]}),
            read,
            tandem=("t",),
            scratch=PurePosixPath("/"),
        )
    missing = {"name": "X", "valueFrom": {"configMapKeyRef": {"name": "nope", "key": "k"}}}
    with pytest.raises(UnsupportedPod, match="ConfigMap key nope/k missing"):
        container_env(pod({}), {"env": [missing]}, read)
