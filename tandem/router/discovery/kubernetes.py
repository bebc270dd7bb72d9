"""Kubernetes discovery: watches the ServingCluster's engine Pods and keeps the pool in step.

Pods are selected by `tandem.dev/cluster=<name>,tandem.dev/role in (prefill,decode)`, but labels
only select: a Pod is admitted only when its controller is a ReplicaSet (matched by uid) whose
controller is the pool's own Deployment (`<name>-prefill` / `<name>-decode`, itself controlled by
the ServingCluster `<name>`), so a Pod that merely copies the labels never receives traffic. An
admitted Pod is an engine while it is Ready, has a podIP and is not being deleted. Engine URL `http://<podIP>:8000`,
KV events `tcp://<podIP>:5557` (replay 5558). Pod IPs are used directly (not EndpointSlices) so a
test cluster whose pods run on loopback addresses works too. The blocking watch runs in a thread
and hands events to the event loop; credentials come from the in-cluster service account, else
the kubeconfig (`$KUBECONFIG` honoured).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from tandem.common.roles import LABEL_CLUSTER, LABEL_ROLE, ROLES
from tandem.router.config import KubernetesDiscovery
from tandem.router.engines import Engine

log = logging.getLogger("tandem.router.discovery")


def label_selector(cluster_name: str) -> str:
    return f"{LABEL_CLUSTER}={cluster_name},{LABEL_ROLE} in ({','.join(ROLES)})"


def controller(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The owner reference marked `controller: true`, if any."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if isinstance(ref, dict) and ref.get("controller"):
            return ref
    return None


def pool_owner_uids(
    cluster_name: str, deployments: list[dict[str, Any]], replica_sets: list[dict[str, Any]]
) -> set[str]:
    """uids of the ReplicaSets whose controller is one of the cluster's pool Deployments.

    A pool Deployment is named `<cluster>-prefill` or `<cluster>-decode` and controlled by the
    ServingCluster `<cluster>`.
    """
    names = {f"{cluster_name}-{role}" for role in ("prefill", "decode")}
    pools = set()
    for deployment in deployments:
        metadata = deployment.get("metadata") or {}
        owner = controller(deployment) or {}
        if (
            metadata.get("name") in names
            and owner.get("kind") == "ServingCluster"
            and owner.get("name") == cluster_name
        ):
            pools.add(metadata.get("uid"))
    return {
        str((rs.get("metadata") or {}).get("uid"))
        for rs in replica_sets
        if (controller(rs) or {}).get("uid") in pools
    }


def owner_uid(pod: dict[str, Any]) -> str | None:
    ref = controller(pod)
    return str(ref.get("uid")) if ref and ref.get("kind") == "ReplicaSet" else None


def engine_from_pod(
    pod: dict[str, Any], spec: KubernetesDiscovery, owners: set[str]
) -> Engine | None:
    """The Engine a Pod (as a JSON dict) stands for, or None while it must not receive traffic.

    `owners` are the uids of the pools' ReplicaSets (`pool_owner_uids`).
    """
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    role = (metadata.get("labels") or {}).get(LABEL_ROLE)
    ip = status.get("podIP")
    if role not in ROLES or not ip or metadata.get("deletionTimestamp"):
        return None
    if owner_uid(pod) not in owners:
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
        side_channel_port=spec.side_channel_port,
        labels={
            "pod": str(metadata.get("name", "")),
            "namespace": str(metadata.get("namespace", "")),
        },
    )


def _load_clients() -> tuple[Any, Any]:
    """(CoreV1Api, AppsV1Api) with in-cluster credentials, else the kubeconfig."""
    import kubernetes

    kube: Any = kubernetes  # the client library is untyped
    try:
        kube.config.load_incluster_config()
    except kube.config.ConfigException:
        kube.config.load_kube_config()  # honours $KUBECONFIG
    return kube.client.CoreV1Api(), kube.client.AppsV1Api()


# The shortest time between two reads of the pools' Deployments and ReplicaSets.
OWNER_REREAD_S = 1.0


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
        self.owners: set[str] = set()
        self._owners_read = 0.0
        self._refused: set[str] = set()  # pods already logged as not the pools' own

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _emit(self, name: str, engine: Engine | None) -> None:
        self.loop.call_soon_threadsafe(self.on_change, name, engine)

    def _read_owners(self, apps: Any) -> None:
        selector = f"{LABEL_CLUSTER}={self.spec.cluster_name}"
        namespace = self.spec.namespace
        # Raw JSON: only names, uids and owner references are read, no model needs building.
        deployments = apps.list_namespaced_deployment(
            namespace, label_selector=selector, _preload_content=False
        )
        replica_sets = apps.list_namespaced_replica_set(
            namespace, label_selector=selector, _preload_content=False
        )
        self.owners = pool_owner_uids(
            self.spec.cluster_name,
            json.loads(deployments.data).get("items") or [],
            json.loads(replica_sets.data).get("items") or [],
        )
        self._owners_read = time.monotonic()

    def _engine(self, data: dict[str, Any], apps: Any) -> Engine | None:
        """engine_from_pod, reading the pools' ReplicaSets again when the Pod's controller is not
        among them: a rollout's new ReplicaSet exists before its Pods. The reads are at least
        OWNER_REREAD_S apart; an event that comes sooner waits for the next read rather than being
        judged on the old one (a Pod refused there would not be looked at again until it changes)."""
        uid = owner_uid(data)
        if uid is not None and uid not in self.owners:
            self._stop.wait(max(OWNER_REREAD_S - (time.monotonic() - self._owners_read), 0.0))
            self._read_owners(apps)
        name = str(data["metadata"]["name"])
        if uid not in self.owners and name not in self._refused:
            self._refused.add(name)
            log.warning(
                "pod %s carries the cluster's labels but is not one of its pools'; ignored", name
            )
        return engine_from_pod(data, self.spec, self.owners)

    def _run(self) -> None:
        import kubernetes.watch
        from kubernetes.client.exceptions import ApiException

        watch: Any = kubernetes.watch

        api = apps = None
        selector = label_selector(self.spec.cluster_name)
        while not self._stop.is_set():
            try:
                if api is None:
                    api, apps = _load_clients()
                serialize = api.api_client.sanitize_for_serialization
                self._read_owners(apps)
                listing = api.list_namespaced_pod(self.spec.namespace, label_selector=selector)
                seen = set()
                for pod in listing.items:
                    data = serialize(pod)
                    name = data["metadata"]["name"]
                    seen.add(name)
                    self._emit(name, self._engine(data, apps))
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
                    self._emit(name, None if kind == "DELETED" else self._engine(data, apps))
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
