"""Kubernetes discovery: watches the ServingCluster's engine Pods and keeps the pool in step.

Pods are selected by `tandem.dev/cluster=<name>,tandem.dev/role in (prefill,decode)`; a Pod is an
engine while it is Ready, has a podIP and is not being deleted. Engine URL `http://<podIP>:8000`,
KV events `tcp://<podIP>:5557` (replay 5558). Pod IPs are used directly (not EndpointSlices) so a
test cluster whose pods run on loopback addresses works too. The blocking watch runs in a thread
and hands events to the event loop; credentials come from the in-cluster service account, else
the kubeconfig (`$KUBECONFIG` honoured).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from tandem.router.config import KubernetesDiscovery
from tandem.router.engines import Engine

log = logging.getLogger("tandem.router.discovery")

ROLE_LABEL = "tandem.dev/role"
CLUSTER_LABEL = "tandem.dev/cluster"


def label_selector(cluster_name: str) -> str:
    return f"{CLUSTER_LABEL}={cluster_name},{ROLE_LABEL} in (prefill,decode)"


def engine_from_pod(pod: dict[str, Any], spec: KubernetesDiscovery) -> Engine | None:
    """The Engine a Pod (as a JSON dict) stands for, or None while it must not receive traffic."""
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    role = (metadata.get("labels") or {}).get(ROLE_LABEL)
    ip = status.get("podIP")
    if role not in ("prefill", "decode") or not ip or metadata.get("deletionTimestamp"):
        return None
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    if not ready:
        return None
    host = f"[{ip}]" if ":" in ip else ip
    return Engine(
        url=f"http://{host}:{spec.engine_port}",
        roles=frozenset({role}),
        kv_events=f"tcp://{host}:{spec.kv_events_port}" if spec.kv_events_port else None,
        kv_events_replay=f"tcp://{host}:{spec.kv_events_replay_port}"
        if spec.kv_events_replay_port
        else None,
        labels={
            "pod": str(metadata.get("name", "")),
            "namespace": str(metadata.get("namespace", "")),
        },
    )


def _load_client() -> Any:
    import kubernetes

    kube: Any = kubernetes  # the client library is untyped
    try:
        kube.config.load_incluster_config()
    except kube.config.ConfigException:
        kube.config.load_kube_config()  # honours $KUBECONFIG
    return kube.client.CoreV1Api()


class PodWatcher:
    """Calls `on_change(pod_name, engine_or_None)` on the loop for every relevant Pod change, and
    `on_resync(names)` after each full listing (Pods not named there are gone)."""

    def __init__(
        self,
        spec: KubernetesDiscovery,
        on_change: Callable[[str, Engine | None], None],
        on_resync: Callable[[set[str]], None],
        loop: asyncio.AbstractEventLoop,
    ):
        self.spec = spec
        self.on_change = on_change
        self.on_resync = on_resync
        self.loop = loop
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pod-watch", daemon=True)
        self.synced = asyncio.Event()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _emit(self, name: str, engine: Engine | None) -> None:
        self.loop.call_soon_threadsafe(self.on_change, name, engine)

    def _run(self) -> None:
        import kubernetes.watch
        from kubernetes.client.exceptions import ApiException

        watch: Any = kubernetes.watch

        api = None
        selector = label_selector(self.spec.cluster_name)
        while not self._stop.is_set():
            try:
                if api is None:
                    api = _load_client()
                listing = api.list_namespaced_pod(self.spec.namespace, label_selector=selector)
                seen = set()
                serialize = api.api_client.sanitize_for_serialization
                for pod in listing.items:
                    data = serialize(pod)
                    name = data["metadata"]["name"]
                    seen.add(name)
                    self._emit(name, engine_from_pod(data, self.spec))
                self.loop.call_soon_threadsafe(self._sync_done, seen)
                version = listing.metadata.resource_version
                stream = watch.Watch()
                for event in stream.stream(
                    api.list_namespaced_pod,
                    self.spec.namespace,
                    label_selector=selector,
                    resource_version=version,
                    timeout_seconds=60,
                    allow_watch_bookmarks=True,
                ):
                    if self._stop.is_set():
                        stream.stop()
                        return
                    kind = event["type"]
                    if kind == "BOOKMARK":
                        continue
                    data = serialize(event["object"])
                    name = data["metadata"]["name"]
                    self._emit(
                        name, None if kind == "DELETED" else engine_from_pod(data, self.spec)
                    )
            except ApiException as exc:
                if exc.status != 410:  # 410 Gone: our resourceVersion expired, list again
                    log.warning("pod watch failed: %s", exc.reason)
                    self._stop.wait(2.0)
            except Exception as exc:
                log.warning("pod watch error: %s", exc)
                api = None
                self._stop.wait(2.0)

    def _sync_done(self, names: set[str]) -> None:
        self.on_resync(names)
        self.synced.set()
