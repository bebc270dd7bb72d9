"""The harness itself: a real apiserver with RBAC, a KWOK GPU node, pods that really serve."""

from __future__ import annotations

import ipaddress
import json
import urllib.request

import pytest
from kubernetes import client as k8s

from e2e.harness.cluster import NODE_NAME, ControlPlane
from e2e.harness.kube import eventually, gone
from e2e.harness.podrunner import PodRunner

pytestmark = pytest.mark.e2e


def test_apiserver_reports_the_pinned_version(
    control_plane: ControlPlane, api: k8s.ApiClient
) -> None:
    info = k8s.VersionApi(api).get_code()
    assert info.git_version == control_plane.binaries.kubernetes_version
    assert int(info.minor) >= 34


def test_gpu_node_is_ready_with_loopback_pod_cidr(
    control_plane: ControlPlane, api: k8s.ApiClient
) -> None:
    node = k8s.CoreV1Api(api).read_node(NODE_NAME)
    assert node.spec.pod_cidr == control_plane.pod_cidr
    assert ipaddress.ip_network(control_plane.pod_cidr).subnet_of(
        ipaddress.ip_network("127.0.0.0/8")
    )
    assert node.status.allocatable["nvidia.com/gpu"] == "8"
    assert {c.type: c.status for c in node.status.conditions}["Ready"] == "True"


def test_rbac_is_enforced_for_service_accounts(
    control_plane: ControlPlane, api: k8s.ApiClient
) -> None:
    core = k8s.CoreV1Api(api)
    core.create_namespaced_service_account("default", {"metadata": {"name": "nobody"}})
    nobody = k8s.CoreV1Api(
        control_plane.api_client(control_plane.service_account_kubeconfig("default", "nobody"))
    )
    with pytest.raises(k8s.ApiException) as refused:
        nobody.list_namespaced_pod("default")
    assert refused.value.status == 403
    assert "system:serviceaccount:default:nobody" in refused.value.body


def engine_pod(name: str, gpus: int) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "harness-check"}},
        "spec": {
            "containers": [
                {
                    "name": "vllm",
                    "image": "vllm/vllm-openai:v0.32.0",
                    "command": ["vllm", "serve"],
                    "args": ["harness/model", "--served-model-name", "tiny", "--port", "8000"],
                    "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                }
            ],
            "terminationGracePeriodSeconds": 1,
        },
    }


def test_a_gpu_pod_runs_serves_on_its_pod_ip_and_stops_with_it(
    control_plane: ControlPlane, api: k8s.ApiClient, pod_runner: PodRunner
) -> None:
    core = k8s.CoreV1Api(api)
    core.create_namespaced_pod("default", engine_pod("harness-engine", gpus=1))
    pod = eventually(
        lambda: (p := core.read_namespaced_pod("harness-engine", "default")).status.pod_ip and p,
        timeout_s=60,
        what="the pod to be scheduled and given an IP",
    )
    assert pod.spec.node_name == NODE_NAME
    assert pod.status.phase == "Running"
    assert ipaddress.ip_address(pod.status.pod_ip) in ipaddress.ip_network(control_plane.pod_cidr)

    def models() -> dict[str, object] | None:
        url = f"http://{pod.status.pod_ip}:8000/v1/models"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return json.loads(response.read())  # type: ignore[no-any-return]
        except OSError:
            return None

    listing = eventually(
        models, timeout_s=60, what="the emulator on the pod IP", details=pod_runner.report
    )
    assert [m["id"] for m in listing["data"]] == ["tiny"]  # type: ignore[index]
    [running] = [p for p in pod_runner.snapshot() if p.name == "harness-engine"]

    core.delete_namespaced_pod("harness-engine", "default")
    eventually(
        lambda: gone(lambda: core.read_namespaced_pod("harness-engine", "default")),
        timeout_s=30,
        what="pod deletion",
    )
    eventually(lambda: not running.child.alive(), timeout_s=15, what="the pod's process to stop")


def test_gpu_requests_beyond_the_node_stay_pending(api: k8s.ApiClient) -> None:
    core = k8s.CoreV1Api(api)
    core.create_namespaced_pod("default", engine_pod("harness-too-big", gpus=9))
    try:

        def unschedulable() -> bool:
            conditions = (
                core.read_namespaced_pod("harness-too-big", "default").status.conditions or []
            )
            return any(c.type == "PodScheduled" and c.reason == "Unschedulable" for c in conditions)

        eventually(unschedulable, timeout_s=30, what="the scheduler to refuse 9 GPUs")
    finally:
        core.delete_namespaced_pod("harness-too-big", "default", grace_period_seconds=0)
