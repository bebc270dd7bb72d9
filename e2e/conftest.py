"""Session fixtures of the e2e suite: one control plane, the stand-in kubelet, and the clients."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kubernetes import client as k8s

from e2e.harness.binaries import Binaries
from e2e.harness.cluster import ControlPlane, running_control_plane
from e2e.harness.kube import crd_established, eventually
from e2e.harness.podrunner import PodRunner, RunningPod
from e2e.harness.tools import Clients

# Flags for every emulated engine (simulated time runs 10x faster to keep the suite quick);
# the pod's rendered vLLM arguments come first, unchanged apart from the bind addresses.
ENGINE_EXTRA_ARGS: tuple[str, ...] = ("--speedup", "10")


@pytest.fixture(scope="session")
def binaries() -> Binaries:
    # Missing binaries fail loudly: CI builds them first (`make cluster-binaries`).
    return Binaries.locate()


@pytest.fixture(scope="session")
def control_plane(binaries: Binaries) -> Iterator[ControlPlane]:
    with running_control_plane(binaries) as plane:
        yield plane


@pytest.fixture(scope="session")
def api_server(binaries: Binaries) -> Iterator[ControlPlane]:
    """etcd and kube-apiserver alone: for tests that ask the server itself (its defaulting), or
    write Pods and their owners as the controllers and the kubelet would and need what they
    write to stay as written."""
    with running_control_plane(binaries, controllers=False) as plane:
        yield plane


@pytest.fixture(scope="session")
def crd_clients(api_server: ControlPlane) -> Clients:
    """kubectl on `api_server`, which serves the CRD `tandem crd` prints."""
    clients = Clients(api_server.binaries, api_server.workdir, api_server.kubeconfig)
    crd = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "crd"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    clients.kubectl("apply", "-f", "-", stdin=crd)
    name = yaml.safe_load(crd)["metadata"]["name"]
    api = api_server.api_client()
    eventually(lambda: crd_established(api, name), timeout_s=30, what=f"CRD {name} established")
    return clients


@pytest.fixture(scope="session")
def pod_runner(control_plane: ControlPlane) -> Iterator[PodRunner]:
    runner = PodRunner(control_plane, label_selector=None, engine_extra_args=ENGINE_EXTRA_ARGS)
    runner.start()
    try:
        yield runner
    finally:
        runner.stop()
        leftovers = runner.leftovers()
        assert not leftovers, f"pod processes left behind: {leftovers}"


@pytest.fixture(scope="session")
def api(control_plane: ControlPlane) -> k8s.ApiClient:
    return control_plane.api_client()


@pytest.fixture(scope="session")
def clients(control_plane: ControlPlane) -> Clients:
    home = control_plane.workdir / "client-home"
    home.mkdir(exist_ok=True)
    return Clients(control_plane.binaries, home, control_plane.kubeconfig)


@pytest.fixture(scope="session")
def offline_clients(binaries: Binaries, tmp_path_factory: pytest.TempPathFactory) -> Clients:
    """helm/kubectl for commands that need no cluster (lint, template)."""
    return Clients(binaries, tmp_path_factory.mktemp("client-home"))


RELEASE = "tandem"
OPERATOR_NAMESPACE = "tandem-system"
OPERATOR_METRICS_PORT = 8081  # the chart's operator.metrics.port
CHART = Path(__file__).resolve().parent.parent / "charts" / "tandem"


@pytest.fixture(scope="session")
def tandem_release(
    clients: Clients, pod_runner: PodRunner, control_plane: ControlPlane
) -> Iterator[RunningPod]:
    """`helm install` of the chart; the operator pod then runs as a local process with the
    chart's ServiceAccount token, so the chart's RBAC is what it works with."""
    install = clients.helm(
        "install", RELEASE, str(CHART),
        "--namespace", OPERATOR_NAMESPACE, "--create-namespace",
        "--wait", "--timeout", "2m",
    )  # fmt: skip
    assert "STATUS: deployed" in install.stdout, install.stdout
    operator = wait_for_operator(pod_runner)
    try:
        yield operator
    finally:
        clients.helm("uninstall", RELEASE, "--namespace", OPERATOR_NAMESPACE, "--wait", check=False)


def wait_for_operator(pod_runner: PodRunner, *, not_named: str | None = None) -> RunningPod:
    """The operator pod's process, once its liveness endpoint answers."""

    def healthy() -> RunningPod | None:
        for running in pod_runner.by_role("operator", OPERATOR_NAMESPACE):
            if running.name == not_named or not running.child.alive():
                continue
            try:
                url = f"http://{running.ip}:8080/healthz"
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return running
            except OSError:
                continue
        return None

    return eventually(
        healthy, timeout_s=60, what="the operator to be live", details=pod_runner.report
    )
