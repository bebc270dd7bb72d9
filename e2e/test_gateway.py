"""Two ServingClusters joining one gateway on the real control plane, with the operator installed
by Helm: the operator renders `<name>-gateway` owned by both, its pod runs `tandem gateway` (a real
process) that sends each model to its own cluster's engine pods and answers vLLM's 404 for an
unknown model; a member deleted leaves the gateway, the last one takes it away."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s

from e2e.harness.kube import eventually, gone
from e2e.harness.podrunner import PodRunner, RunningPod
from e2e.harness.tools import Clients

pytestmark = pytest.mark.e2e

NAMESPACE = "default"
GATEWAY = "shared"
MEMBERS = {"gw-alpha": "alpha", "gw-beta": "beta"}
GROUP, VERSION, PLURAL = "tandem.dev", "v1alpha1", "servingclusters"


def manifest(name: str, served: str) -> dict[str, Any]:
    return {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "ServingCluster",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "model": {"name": f"example/{served}", "servedName": served},
            "prefill": {"replicas": 0},
            "decode": {"replicas": 1},
            "router": {"replicas": 0, "disaggregation": {"mode": "never"}},
            "gateway": {"name": GATEWAY},
        },
    }


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def config_models(core: k8s.CoreV1Api) -> list[str] | None:
    try:
        config_map = core.read_namespaced_config_map(f"{GATEWAY}-gateway", NAMESPACE)
    except k8s.ApiException:
        return None
    config = yaml.safe_load(config_map.data["gateway.yaml"])
    return [model["servedModelName"] for model in config["models"]]


@pytest.fixture(scope="module")
def members(
    tandem_release: RunningPod, clients: Clients, pod_runner: PodRunner
) -> Iterator[PodRunner]:
    for name, served in MEMBERS.items():
        clients.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(manifest(name, served)))
    yield pod_runner
    for name in MEMBERS:
        clients.kubectl(
            "-n", NAMESPACE, "delete", "servingcluster", name, "--ignore-not-found",
            "--wait=false", check=False,
        )  # fmt: skip


def gateway_url(pod_runner: PodRunner) -> str | None:
    running = [p for p in pod_runner.by_role("gateway", NAMESPACE) if p.child.alive()]
    return f"http://{running[0].ip}:8000" if running else None


def test_one_gateway_serves_both_clusters_models(members: PodRunner, api: k8s.ApiClient) -> None:
    core, apps = k8s.CoreV1Api(api), k8s.AppsV1Api(api)
    eventually(
        lambda: config_models(core) == ["alpha", "beta"],
        timeout_s=90,
        what="the gateway config to list both models",
        details=members.report,
    )
    deployment = eventually(
        lambda: apps.read_namespaced_deployment(f"{GATEWAY}-gateway", NAMESPACE),
        timeout_s=30,
        what="the gateway Deployment",
    )
    owners = sorted(o.name for o in deployment.metadata.owner_references)
    assert owners == sorted(MEMBERS)

    def answered(model: str) -> dict[str, Any] | None:
        url = gateway_url(members)
        if url is None:
            return None
        try:
            status, body = post(url, {"model": model, "prompt": "hello", "max_tokens": 2})
        except OSError:
            return None
        return body if status == 200 else None

    for model in MEMBERS.values():
        body = eventually(
            lambda m=model: answered(m),  # type: ignore[misc]
            timeout_s=120,
            interval_s=0.5,
            what=f"a completion of {model} through the gateway",
            details=members.report,
        )
        assert body["model"] == model
    url = gateway_url(members)
    assert url is not None
    status, body = post(url, {"model": "nobody", "prompt": "hello", "max_tokens": 2})
    assert status == 404
    assert body["error"] == {
        "message": "The model `nobody` does not exist. Valid aliases: alpha, beta.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


def test_a_member_that_leaves_leaves_the_gateway_and_the_last_takes_it_away(
    members: PodRunner, clients: Clients, api: k8s.ApiClient
) -> None:
    core, apps = k8s.CoreV1Api(api), k8s.AppsV1Api(api)
    clients.kubectl("-n", NAMESPACE, "delete", "servingcluster", "gw-beta", "--wait=false")
    eventually(
        lambda: config_models(core) == ["alpha"],
        timeout_s=90,
        what="the gateway config without beta",
        details=members.report,
    )
    clients.kubectl("-n", NAMESPACE, "delete", "servingcluster", "gw-alpha", "--wait=false")
    eventually(
        lambda: gone(lambda: apps.read_namespaced_deployment(f"{GATEWAY}-gateway", NAMESPACE)),
        timeout_s=120,
        what="the gateway garbage-collected with its last member",
        details=members.report,
    )
