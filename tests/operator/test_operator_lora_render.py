"""LoRA in a ServingCluster: the API's checks and the vLLM flags and environment each pool gets."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from sc_manifests import cluster

from tandem.operator.api import ServingCluster
from tandem.operator.engine_render import vllm_args, vllm_env
from tandem.operator.manifest import ManifestError
from tandem.operator.render import render

ADAPTERS = [
    {"name": "sql", "source": "org/sql-lora"},
    {"name": "support-v2", "source": "/models/adapters/support-v2"},
]


def lora_cluster(**lora: Any) -> ServingCluster:
    return cluster(lora={"adapters": ADAPTERS, **lora}, router={"disaggregation": {"mode": "auto"}})


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_both_pools_serve_every_adapter(role: str) -> None:
    args = vllm_args(lora_cluster(), role)  # type: ignore[arg-type]
    assert "--enable-lora" in args
    assert flag(args, "--max-loras") == "1"
    assert flag(args, "--max-lora-rank") == "16"
    assert "--max-cpu-loras" not in args  # vLLM's default: maxLoras
    start = args.index("--lora-modules")
    assert args[start + 1 : start + 3] == [
        "sql=org/sql-lora",
        "support-v2=/models/adapters/support-v2",
    ]


def test_pool_capacity_overrides_the_cluster_settings() -> None:
    sc = cluster(
        lora={"adapters": ADAPTERS, "maxLoras": 2, "maxLoraRank": 32, "maxCpuLoras": 4},
        decode={"lora": {"maxLoras": 4, "maxCpuLoras": 8}},
        prefill={"lora": {"maxLoraRank": 64}},
    )
    decode, prefill = vllm_args(sc, "decode"), vllm_args(sc, "prefill")
    assert (flag(decode, "--max-loras"), flag(decode, "--max-lora-rank")) == ("4", "32")
    assert flag(decode, "--max-cpu-loras") == "8"
    assert (flag(prefill, "--max-loras"), flag(prefill, "--max-lora-rank")) == ("2", "64")
    assert flag(prefill, "--max-cpu-loras") == "4"


def test_cpu_slots_never_below_a_pools_gpu_slots() -> None:
    sc = cluster(lora={"maxLoras": 1, "maxCpuLoras": 2}, decode={"lora": {"maxLoras": 4}})
    assert flag(vllm_args(sc, "decode"), "--max-cpu-loras") == "4"


def test_runtime_updates_set_vllms_environment_variable() -> None:
    def env_of(sc: ServingCluster) -> dict[str, Any]:
        return {v["name"]: v.get("value") for v in vllm_env(sc, "decode")}

    assert env_of(lora_cluster(runtimeUpdates=True))["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env_of(lora_cluster())


def test_no_lora_renders_no_lora_flag() -> None:
    args = vllm_args(cluster(), "decode")
    assert not [a for a in args if "lora" in a]


def test_adapter_only_runtime_loading() -> None:
    args = vllm_args(cluster(lora={"runtimeUpdates": True}), "decode")
    assert "--enable-lora" in args
    assert "--lora-modules" not in args


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        ({"adapters": [ADAPTERS[0], ADAPTERS[0]]}, "adapter names must be unique"),
        ({"maxLoras": 4, "maxCpuLoras": 2}, "maxCpuLoras must be >= maxLoras"),
        ({"maxLoraRank": 12}, "maxLoraRank"),
        ({"adapters": [{"name": "a", "source": "relative/dir/x"}]}, "source"),
        ({"adapters": [{"name": "Meta-Llama", "source": "/a"}]}, None),
    ],
)
def test_invalid_lora_settings_are_refused(lora: dict[str, Any], message: str | None) -> None:
    if message is None:  # a valid name that is not the served model's
        cluster(lora=lora)
        return
    with pytest.raises(ManifestError, match=message):
        cluster(lora=lora)


def test_an_adapter_cannot_shadow_the_served_model() -> None:
    with pytest.raises(ManifestError, match="served model's name"):
        cluster(
            model={"name": "org/base", "servedName": "base"},
            lora={"adapters": [{"name": "base", "source": "org/x"}]},
        )


def test_lora_cluster_objects_validate_against_kubernetes() -> None:
    for obj in render(lora_cluster(runtimeUpdates=True)):
        if obj["kind"] in ("Deployment", "ConfigMap", "Service"):
            kubernetes_validate.validate(obj, "1.34.0", strict=True)
