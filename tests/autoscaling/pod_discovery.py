"""Prometheus HTTP service discovery of Kubernetes pods, for Prometheus builds without kubernetes_sd.

Each GET lists the pods of the watched namespaces from the apiserver and answers one target per
container port with the `__meta_kubernetes_pod_*` labels kubernetes_sd (role pod) would attach, so
the production relabelling applies unchanged.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kubernetes import client as k8s


def _label_name(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def pod_targets(pods: Sequence[Any]) -> list[dict[str, Any]]:
    """http_sd target groups for typed V1Pods: one per container port of each pod with an IP."""
    groups = []
    for pod in pods:
        if not pod.status.pod_ip:
            continue
        labels = {
            "__meta_kubernetes_namespace": pod.metadata.namespace,
            "__meta_kubernetes_pod_name": pod.metadata.name,
            "__meta_kubernetes_pod_ip": pod.status.pod_ip,
            "__meta_kubernetes_pod_phase": pod.status.phase or "",
            "__meta_kubernetes_pod_node_name": pod.spec.node_name or "",
        }
        for key, value in (pod.metadata.labels or {}).items():
            labels[f"__meta_kubernetes_pod_label_{_label_name(key)}"] = value
        for container in pod.spec.containers:
            for port in container.ports or []:
                groups.append(
                    {
                        "targets": [f"{pod.status.pod_ip}:{port.container_port}"],
                        "labels": {
                            **labels,
                            "__meta_kubernetes_pod_container_name": container.name,
                            "__meta_kubernetes_pod_container_port_name": port.name or "",
                            "__meta_kubernetes_pod_container_port_number": str(port.container_port),
                        },
                    }
                )
    return groups


@contextmanager
def serve_targets(groups: Callable[[], list[dict[str, Any]]]) -> Iterator[str]:
    """Serve `groups()` as an http_sd endpoint on a free 127.0.0.1 port; yields its URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(groups()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="http-sd", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/targets"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@contextmanager
def pod_discovery(api: k8s.ApiClient, namespaces: Sequence[str]) -> Iterator[str]:
    """http_sd of the pods of `namespaces`, listed from the apiserver on every refresh."""
    core = k8s.CoreV1Api(api)
    with serve_targets(
        lambda: pod_targets(
            [pod for ns in namespaces for pod in core.list_namespaced_pod(ns).items]
        )
    ) as url:
        yield url
