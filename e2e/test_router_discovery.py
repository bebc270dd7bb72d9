"""The router's Pod-watch discovery against a real kube-apiserver.

The `api_server` fixture runs etcd and kube-apiserver alone, so the test itself writes what the
operator, the Deployment and ReplicaSet controllers and the kubelet would: a ServingCluster, its
pool Deployments and their ReplicaSets (every owner reference carrying the server's own uid),
Pods bound to a node that no kubelet serves, and their status (phase, a loopback podIP, the Ready
condition); nothing else changes them. One emulated engine listens on 127.0.0.1 behind the Pods
given that address. The router runs as its own process with a kubeconfig for the server, lists
and watches the Pods, and the test follows its `/engines` and its answers. For a watch that
breaks, the router talks to a second kube-apiserver on the same etcd, which the test stops while
it changes Pods through the first and then starts again: nothing here is a stand-in.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client as k8s

from e2e.harness.cluster import ControlPlane, write_kubeconfig
from e2e.harness.kube import eventually, gone, zero_pool_cluster
from e2e.harness.processes import Child, Supervisor, wait_until
from e2e.harness.tools import Clients
from tandem.common.ports import free_port
from tandem.common.roles import LABEL_CLUSTER, LABEL_ROLE

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

NAMESPACE = "discovery"
CLUSTER = "llama"
# The Pods are bound to a node no kubelet serves: deleting one leaves it terminating (with a
# deletionTimestamp) until it is deleted with no grace period, as a real kubelet would finish it.
NODE = "node-without-kubelet"
SERVED_IP = "127.0.0.1"  # where the engine listens; the other Pods' addresses serve nothing
GROUP, VERSION, PLURAL = "tandem.dev", "v1alpha1", "servingclusters"
CONTAINERS = [{"name": "engine", "image": "vllm/vllm-openai:v0.32.0"}]


def owner_reference(obj: dict[str, Any]) -> dict[str, Any]:
    metadata = obj["metadata"]
    return {
        "apiVersion": obj["apiVersion"],
        "kind": obj["kind"],
        "name": metadata["name"],
        "uid": metadata["uid"],
        "controller": True,
    }


def workload(kind: str, name: str, role: str, owner: dict[str, Any] | None) -> dict[str, Any]:
    """A Deployment or ReplicaSet of no replicas, labelled as the operator labels the pools."""
    labels = {LABEL_CLUSTER: CLUSTER, LABEL_ROLE: role}
    metadata: dict[str, Any] = {"name": name, "labels": labels}
    if owner is not None:
        metadata["ownerReferences"] = [owner_reference(owner)]
    return {
        "apiVersion": "apps/v1",
        "kind": kind,
        "metadata": metadata,
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": CONTAINERS}},
        },
    }


@dataclass
class Pools:
    """The objects the test writes through, and the ReplicaSets Pods can be owned by."""

    core: k8s.CoreV1Api
    apps: k8s.AppsV1Api
    replica_sets: dict[str, dict[str, Any]]  # pool role (or "copycat") -> the server's object
    deployments: dict[str, dict[str, Any]]

    def create(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        """Creates the Deployment or ReplicaSet `body`; the server's object, as JSON."""
        created: object
        if kind == "Deployment":
            created = self.apps.create_namespaced_deployment(NAMESPACE, body)  # type: ignore[arg-type]
        else:
            created = self.apps.create_namespaced_replica_set(NAMESPACE, body)  # type: ignore[arg-type]
        as_json: dict[str, Any] = self.apps.api_client.sanitize_for_serialization(created)
        return {"apiVersion": "apps/v1", "kind": kind, **as_json}

    def pod(self, name: str, role: str, owner: str, *, cluster: str = CLUSTER) -> None:
        """A Pod of `owner`'s ReplicaSet as the scheduler leaves it: bound, no status yet."""
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "labels": {LABEL_CLUSTER: cluster, LABEL_ROLE: role},
                "ownerReferences": [owner_reference(self.replica_sets[owner])],
            },
            "spec": {"nodeName": NODE, "containers": CONTAINERS},
        }
        self.core.create_namespaced_pod(NAMESPACE, body)  # type: ignore[arg-type]

    def status(self, name: str, ip: str | None, *, ready: bool) -> None:
        """What the kubelet reports: Running with `ip`, the Ready condition as given."""
        ready_status = "True" if ready else "False"
        status: dict[str, Any] = {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": ready_status}],
        }
        if ip is not None:
            status |= {"podIP": ip, "podIPs": [{"ip": ip}], "hostIP": SERVED_IP}
        self.core.patch_namespaced_pod_status(name, NAMESPACE, {"status": status})

    def running(self, name: str, role: str, ip: str, owner: str | None = None) -> None:
        self.pod(name, role, owner or role)
        self.status(name, ip, ready=True)

    def delete(self, name: str, *, grace: bool = True) -> None:
        options = None if grace else k8s.V1DeleteOptions(grace_period_seconds=0)
        self.core.delete_namespaced_pod(name, NAMESPACE, body=options)

    def delete_all_pods(self) -> None:
        self.core.delete_collection_namespaced_pod(NAMESPACE, grace_period_seconds=0)
        eventually(
            lambda: not self.core.list_namespaced_pod(NAMESPACE).items,
            timeout_s=30,
            what=f"no Pods left in {NAMESPACE}",
        )


@pytest.fixture(scope="module")
def pools(api_server: ControlPlane, crd_clients: Clients) -> Pools:
    """Namespace, ServingCluster, both pool Deployments with a ReplicaSet each, and a copycat
    ReplicaSet whose Pods carry the pools' labels but belong to no pool (`crd_clients`: once the
    server serves the CRD)."""
    api = api_server.api_client()
    core, apps = k8s.CoreV1Api(api), k8s.AppsV1Api(api)
    core.create_namespace({"metadata": {"name": NAMESPACE}})  # type: ignore[arg-type]
    # The ServiceAccount admission plugin wants the namespace's `default` account, which the
    # controller-manager would have made.
    account = {"metadata": {"name": "default"}}
    core.create_namespaced_service_account(NAMESPACE, account)  # type: ignore[arg-type]
    serving_cluster = k8s.CustomObjectsApi(api).create_namespaced_custom_object(
        GROUP, VERSION, NAMESPACE, PLURAL, zero_pool_cluster(CLUSTER, NAMESPACE, router={})
    )
    assert isinstance(serving_cluster, dict)
    made = Pools(core, apps, replica_sets={}, deployments={})
    for role in ("prefill", "decode"):
        deployment = made.create(
            "Deployment", workload("Deployment", f"{CLUSTER}-{role}", role, serving_cluster)
        )
        made.deployments[role] = deployment
        made.replica_sets[role] = made.create(
            "ReplicaSet", workload("ReplicaSet", f"{CLUSTER}-{role}-1", role, deployment)
        )
    made.replica_sets["copycat"] = made.create(
        "ReplicaSet", workload("ReplicaSet", "copycat-1", "decode", owner=None)
    )
    return made


@pytest.fixture(scope="module")
def supervisor(api_server: ControlPlane) -> Iterator[Supervisor]:
    processes = Supervisor(api_server.workdir / "discovery-logs")
    try:
        yield processes
    finally:
        processes.stop_all()
        assert not processes.leftovers(), "router or engine processes left behind"


def tandem(*args: str) -> list[str]:
    return [sys.executable, "-m", "tandem.cli", *args]


def wait_answering(url: str, child: Child) -> None:
    """Until `url` answers 200 (a router's /health says 503 while it has no decode engine)."""
    wait_until(
        lambda: httpx.get(url, timeout=2).status_code == 200,
        timeout_s=60,
        what=f"{child.name} at {url}",
        child=child,
    )


@pytest.fixture(scope="module")
def engine_port(supervisor: Supervisor) -> int:
    """One emulated decode engine on 127.0.0.1, behind every Pod given that address."""
    port = free_port()
    argv = tandem(
        "emulate", "--model", "tiny", "--served-model-name", "tiny",
        "--host", SERVED_IP, "--port", str(port), "--speedup", "20", "--log-level", "warning",
    )  # fmt: skip
    wait_answering(f"http://{SERVED_IP}:{port}/health", supervisor.start("engine", argv))
    return port


@dataclass
class Router:
    url: str
    engine_port: int

    def engines(self) -> dict[str, list[str]]:
        """The engines the router routes to: each one's URL and the roles it serves."""
        listing = httpx.get(f"{self.url}/engines", timeout=5).json()
        return {e["url"]: e["roles"] for e in listing}

    def wait_for(self, expected: dict[str, str], what: str) -> None:
        """Until the router's engines are exactly `expected` (Pod IP -> role)."""
        wanted = {f"http://{ip}:{self.engine_port}": [role] for ip, role in expected.items()}
        eventually(
            lambda: self.engines() == wanted,
            timeout_s=20,
            what=what,
            details=lambda: f"router engines: {self.engines()}",
        )

    def completion(self) -> httpx.Response:
        body = {"model": "tiny", "prompt": "hello there", "max_tokens": 4}
        return httpx.post(f"{self.url}/v1/completions", json=body, timeout=60)


@pytest.fixture
def start_router(
    api_server: ControlPlane,
    pools: Pools,
    supervisor: Supervisor,
    engine_port: int,
    tmp_path: Path,
) -> Iterator[Callable[..., Router]]:
    """Starts a router discovering the `llama` pools' Pods (once the test has written the Pods it
    should find at start-up) through `kubeconfig` (the admin's by default); the router and every
    Pod go afterwards."""
    started: list[Child] = []

    def start(kubeconfig: Path = api_server.kubeconfig) -> Router:
        port = free_port()
        discovery = {
            "namespace": NAMESPACE,
            "clusterName": CLUSTER,
            "enginePort": engine_port,
            "kvEventsPort": None,
            "kvEventsReplayPort": None,
        }
        settings = {
            "servedModelName": "tiny",
            "host": "127.0.0.1",
            "port": port,
            "logLevel": "info",
            "kubernetes": discovery,
        }
        config = tmp_path / "router.json"
        config.write_text(json.dumps(settings))
        env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        child = supervisor.start("router", tandem("router", "--config", str(config)), env=env)
        started.append(child)
        router = Router(f"http://127.0.0.1:{port}", engine_port)
        wait_answering(f"{router.url}/engines", child)
        return router

    try:
        yield start
    finally:
        for child in started:
            supervisor.stop(child)
        pools.delete_all_pods()


def test_the_first_listing_admits_ready_pods_of_the_pools_only(
    pools: Pools, start_router: Callable[..., Router]
) -> None:
    pools.running("llama-decode-0", "decode", SERVED_IP)
    pools.pod("llama-decode-1", "decode", "decode")
    pools.status("llama-decode-1", "127.0.0.3", ready=False)
    pools.pod("llama-prefill-0", "prefill", "prefill")  # scheduled, no address yet
    # The labels alone: a ReplicaSet that is not a pool's.
    pools.running("copycat-0", "decode", "127.0.0.4", owner="copycat")
    # A pool's own ReplicaSet, but another cluster's labels: the label selector leaves it out.
    pools.pod("other-0", "decode", "decode", cluster="other")
    pools.status("other-0", "127.0.0.5", ready=True)

    router = start_router()

    router.wait_for({SERVED_IP: "decode"}, "the Ready decode Pod alone")
    assert router.completion().status_code == 200


def test_the_watch_follows_readiness_addresses_and_a_rollout(
    pools: Pools, start_router: Callable[..., Router]
) -> None:
    router = start_router()
    assert router.engines() == {}

    pools.running("llama-decode-0", "decode", SERVED_IP)
    router.wait_for({SERVED_IP: "decode"}, "a decode Pod that turned Ready")
    pools.pod("llama-prefill-0", "prefill", "prefill")
    pools.status("llama-prefill-0", None, ready=True)  # Ready before it has an address
    pools.status("llama-prefill-0", "127.0.0.2", ready=True)
    router.wait_for({SERVED_IP: "decode", "127.0.0.2": "prefill"}, "the prefill Pod's address")

    pools.status("llama-decode-0", SERVED_IP, ready=False)
    router.wait_for({"127.0.0.2": "prefill"}, "the decode Pod no longer Ready")
    assert router.completion().status_code == 503  # no decode engine left
    pools.status("llama-decode-0", SERVED_IP, ready=True)
    router.wait_for({SERVED_IP: "decode", "127.0.0.2": "prefill"}, "the decode Pod Ready again")

    # A rollout: the Deployment's new ReplicaSet appears after the router read the owners.
    pools.replica_sets["decode-2"] = pools.create(
        "ReplicaSet",
        workload("ReplicaSet", f"{CLUSTER}-decode-2", "decode", pools.deployments["decode"]),
    )
    # Its Pod turns Ready at once (as KWOK's do), within the second in which the router may not
    # read the ReplicaSets again: the router waits for that read instead of refusing the Pod.
    pools.pod("llama-decode-2-0", "decode", "decode-2")
    pools.status("llama-decode-2-0", "127.0.0.6", ready=True)
    router.wait_for(
        {SERVED_IP: "decode", "127.0.0.2": "prefill", "127.0.0.6": "decode"},
        "the new ReplicaSet's Pod",
    )


def test_terminating_and_deleted_pods_leave_the_pool(
    pools: Pools, start_router: Callable[..., Router]
) -> None:
    pools.running("llama-decode-0", "decode", SERVED_IP)
    pools.running("llama-prefill-0", "prefill", "127.0.0.2")
    router = start_router()
    router.wait_for({SERVED_IP: "decode", "127.0.0.2": "prefill"}, "both Pods")
    assert router.completion().status_code == 200

    pools.delete("llama-decode-0")
    terminating = pools.core.read_namespaced_pod("llama-decode-0", NAMESPACE)
    assert terminating.metadata is not None
    assert terminating.metadata.deletion_timestamp is not None  # still there, still Ready
    router.wait_for({"127.0.0.2": "prefill"}, "the terminating decode Pod gone")
    response = router.completion()
    assert response.status_code == 503
    assert response.json()["error"]["code"] == 503

    pools.delete("llama-prefill-0", grace=False)
    assert gone(lambda: pools.core.read_namespaced_pod("llama-prefill-0", NAMESPACE))
    router.wait_for({}, "the deleted prefill Pod gone")

    # The same name again, now a new Pod (new uid): admitted like any other.
    pools.delete("llama-decode-0", grace=False)
    pools.running("llama-decode-0", "decode", SERVED_IP)
    router.wait_for({SERVED_IP: "decode"}, "the re-created decode Pod")
    assert router.completion().status_code == 200


@dataclass
class SecondApiServer:
    """A second kube-apiserver on the plane's etcd, as a highly available control plane has."""

    plane: ControlPlane
    port: int
    kubeconfig: Path
    name: str = "kube-apiserver-b"

    def start(self) -> None:
        self.plane.start_apiserver(self.name, self.port)

    def stop(self) -> None:
        child = self.plane.children[self.name]
        if child.alive():
            self.plane.supervisor.stop(child)


@pytest.fixture
def second_api_server(api_server: ControlPlane) -> Iterator[SecondApiServer]:
    port = free_port()
    kubeconfig = write_kubeconfig(
        api_server.workdir / "second-apiserver.kubeconfig",
        f"https://127.0.0.1:{port}",
        api_server.ca.cert_path,
        user="admin",
        client=api_server.admin,
    )
    second = SecondApiServer(api_server, port, kubeconfig)
    second.start()
    try:
        yield second
    finally:
        second.stop()


def test_a_router_that_lost_its_apiserver_lists_again_when_it_is_back(
    pools: Pools, start_router: Callable[..., Router], second_api_server: SecondApiServer
) -> None:
    """The router watches through the second apiserver; while that one is down the Pods change
    through the first, so the router hears of nothing until its new listing, which must bring
    its pool up to date: the Pod deleted meanwhile is in no listing and no watch event."""
    pools.running("llama-decode-0", "decode", SERVED_IP)
    pools.running("llama-prefill-0", "prefill", "127.0.0.2")
    router = start_router(second_api_server.kubeconfig)
    before = {SERVED_IP: "decode", "127.0.0.2": "prefill"}
    router.wait_for(before, "both Pods")

    second_api_server.stop()
    pools.delete("llama-prefill-0", grace=False)
    pools.running("llama-decode-1", "decode", "127.0.0.7")
    pools.status("llama-decode-0", SERVED_IP, ready=False)
    router.wait_for(before, "the router's pool as it was: its apiserver is down")

    second_api_server.start()
    router.wait_for({"127.0.0.7": "decode"}, "the pool as the new listing has it")
