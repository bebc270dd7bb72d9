"""Kubernetes discovery through the real `kubernetes` client against a stand-in API server.

No kube-apiserver can run in this test environment (the e2e suite uses a real one), so a small
HTTP server here answers the two calls the router makes — list Pods and watch Pods in a namespace
— with the Kubernetes wire format. The router runs as a real process with KUBECONFIG pointing at it.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from router_harness import SHORT, Engine, Proc, completion, running, wait_until

from tandem.common.ports import free_port

pytestmark = pytest.mark.timeout(90)


def pod(
    name: str, role: str, ip: str, ready: bool = True, version: int = 1, owner: str = ""
) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "serving",
            "resourceVersion": str(version),
            "labels": {"tandem.dev/cluster": "llama", "tandem.dev/role": role},
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "ReplicaSet",
                    "name": f"llama-{role}-1",
                    "uid": owner or f"rs-{role}",
                    "controller": True,
                }
            ],
        },
        "spec": {"containers": [{"name": "engine", "image": "vllm"}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def _owned(kind: str, name: str, uid: str, owner: dict[str, str]) -> dict[str, object]:
    meta = {
        "name": name,
        "namespace": "serving",
        "uid": uid,
        "labels": {"tandem.dev/cluster": "llama"},
    }
    return {"kind": kind, "metadata": {**meta, "ownerReferences": [{**owner, "controller": True}]}}


# The pools' owner chain as the operator leaves it: ServingCluster -> Deployment -> ReplicaSet.
DEPLOYMENTS = [
    _owned(
        "Deployment",
        f"llama-{role}",
        f"dep-{role}",
        {
            "apiVersion": "tandem.dev/v1alpha1",
            "kind": "ServingCluster",
            "name": "llama",
            "uid": "sc",
        },
    )
    for role in ("prefill", "decode")
]
REPLICA_SETS = [
    _owned(
        "ReplicaSet",
        f"llama-{role}-1",
        f"rs-{role}",
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": f"llama-{role}",
            "uid": f"dep-{role}",
        },
    )
    for role in ("prefill", "decode")
]
LISTS = {
    "/apis/apps/v1/namespaces/serving/deployments": ("DeploymentList", DEPLOYMENTS),
    "/apis/apps/v1/namespaces/serving/replicasets": ("ReplicaSetList", REPLICA_SETS),
}


class FakeApiServer:
    """Serves `GET /api/v1/namespaces/serving/pods` (list, and `watch=true` as a JSON-lines stream),
    and lists of the pools' Deployments and ReplicaSets."""

    def __init__(self, pods: list[dict[str, object]]):
        self.pods = pods
        self.events: queue.Queue[dict[str, object]] = queue.Queue()
        self.selectors: list[str] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # watch streams are chunked, as the real API server's

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                query = parse_qs(url.query)
                if url.path in LISTS:
                    kind, items = LISTS[url.path]
                    listing = {"kind": kind, "metadata": {"resourceVersion": "1"}, "items": items}
                    body = json.dumps(listing).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if url.path != "/api/v1/namespaces/serving/pods":
                    self.send_error(404)
                    return
                api.selectors.extend(query.get("labelSelector", []))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                if query.get("watch") != ["true"]:
                    body = json.dumps(
                        {
                            "apiVersion": "v1",
                            "kind": "PodList",
                            "metadata": {"resourceVersion": "1"},
                            "items": api.pods,
                        }
                    ).encode()
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    try:
                        event = api.events.get(timeout=0.2)
                    except queue.Empty:
                        continue
                    line = json.dumps(event).encode() + b"\n"
                    self.wfile.write(b"%x\r\n%b\r\n" % (len(line), line))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeApiServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def engines(router: Proc) -> dict[str, dict[str, object]]:
    return {e["url"]: e for e in httpx.get(router.url + "/engines").json()}


@pytest.fixture
def engine() -> Iterator[Engine]:
    decode = Engine(None)
    with running(decode):
        yield decode


def test_pod_watch_drives_the_pool(engine: Engine, tmp_path: Path) -> None:
    with FakeApiServer(
        [
            pod("llama-decode-0", "decode", "127.0.0.1"),
            pod("llama-decode-1", "decode", "127.0.0.3", ready=False),
            pod("impostor", "decode", "127.0.0.4", owner="rs-elsewhere"),  # the labels alone
        ]
    ) as api:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "test",
                    "clusters": [{"name": "test", "cluster": {"server": api.url}}],
                    "users": [{"name": "test", "user": {"token": "t"}}],
                    "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
                }
            )
        )
        config = tmp_path / "router.yaml"
        config.write_text(
            json.dumps(
                {
                    "servedModelName": "tiny",
                    "host": "127.0.0.1",
                    "port": free_port(),
                    "logLevel": "warning",
                    "kubernetes": {
                        "namespace": "serving",
                        "clusterName": "llama",
                        "enginePort": engine.port,
                        "kvEventsPort": None,
                        "kvEventsReplayPort": None,
                    },
                }
            )
        )
        port = json.loads(config.read_text())["port"]
        router = Proc(
            "router-k8s", ["router", "--config", str(config)], port, {"KUBECONFIG": str(kubeconfig)}
        )
        with running(router):
            local = f"http://127.0.0.1:{engine.port}"
            wait_until(lambda: local in engines(router), timeout=15)
            assert f"http://127.0.0.3:{engine.port}" not in engines(router)  # not Ready
            assert f"http://127.0.0.4:{engine.port}" not in engines(router)  # not the pools' pod
            assert (
                api.selectors[0] == "tandem.dev/cluster=llama,tandem.dev/role in (prefill,decode)"
            )
            assert completion(router, SHORT).status_code == 200
            api.events.put(
                {
                    "type": "ADDED",
                    "object": pod("llama-prefill-0", "prefill", "127.0.0.2", version=2),
                }
            )
            wait_until(lambda: f"http://127.0.0.2:{engine.port}" in engines(router), timeout=15)
            assert engines(router)[f"http://127.0.0.2:{engine.port}"]["roles"] == ["prefill"]
            api.events.put(
                {
                    "type": "DELETED",
                    "object": pod("llama-decode-0", "decode", "127.0.0.1", version=3),
                }
            )
            wait_until(lambda: local not in engines(router), timeout=15)
            response = completion(router, SHORT)
            assert response.status_code == 503  # no decode engine left
            assert response.json()["error"]["code"] == 503
