"""engine.gpuSharing: engines on slices of shared GPUs with part of the memory each."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from sc_manifests import cluster, minimal

from tandem.operator.manifest import ManifestError, parse_manifest
from tandem.operator.render import render

K8S_VERSION = "1.34.0"


def engine_container(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    deployment = next(
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == name
    )
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_off_by_default_whole_gpus_and_the_engine_memory_share() -> None:
    objects = render(cluster())
    for pool in ("m-prefill", "m-decode"):
        container = engine_container(objects, pool)
        assert set(container["resources"]["limits"]) == {"nvidia.com/gpu"}
        assert flag(container["args"], "--gpu-memory-utilization") == "0.9"


def test_sharing_asks_for_gpu_slices_and_a_memory_fraction_that_pools_can_override() -> None:
    sc = cluster(
        engine={"gpuSharing": {"enabled": True}},
        decode={"gpuMemoryUtilization": 0.4, "tensorParallelSize": 2},
    )
    objects = render(sc)
    prefill = engine_container(objects, "m-prefill")
    decode = engine_container(objects, "m-decode")
    assert prefill["resources"]["limits"] == {"nvidia.com/gpu.shared": "1"}
    assert decode["resources"]["limits"] == {"nvidia.com/gpu.shared": "2"}
    assert flag(prefill["args"], "--gpu-memory-utilization") == "0.45"
    assert flag(decode["args"], "--gpu-memory-utilization") == "0.4"
    for obj in objects:
        if obj["kind"] not in {"ServiceMonitor", "PodMonitor"}:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_own_resource_name_and_fraction_and_explicit_resources_win() -> None:
    sharing = {"enabled": True, "resourceName": "nvidia.com/gpu-mps", "memoryFraction": 0.3}
    sc = cluster(
        engine={"gpuSharing": sharing},
        prefill={"resources": {"limits": {"nvidia.com/gpu": 1}}},
    )
    objects = render(sc)
    assert engine_container(objects, "m-prefill")["resources"]["limits"] == {"nvidia.com/gpu": 1}
    decode = engine_container(objects, "m-decode")
    assert decode["resources"]["limits"] == {"nvidia.com/gpu-mps": "1"}
    assert flag(decode["args"], "--gpu-memory-utilization") == "0.3"


def test_disabled_sharing_changes_nothing() -> None:
    plain = render(cluster())
    disabled = render(cluster(engine={"gpuSharing": {"enabled": False, "memoryFraction": 0.2}}))
    assert plain == disabled


@pytest.mark.parametrize(
    "sharing",
    [{"memoryFraction": 1.0}, {"memoryFraction": 0}, {"resourceName": "gpu"}, {"replicas": 2}],
)
def test_invalid_sharing_is_refused(sharing: dict[str, Any]) -> None:
    with pytest.raises(ManifestError) as caught:
        parse_manifest(minimal(engine={"gpuSharing": {"enabled": True, **sharing}}))
    assert all(p.startswith("spec.engine.gpuSharing") for p in caught.value.problems)
