"""A small synchronous Kubernetes REST client: server-side apply, get, list, delete, status patch.

It rides on the `kubernetes` package's configuration and authentication (kubeconfig or in-cluster
service account, token refresh included) and speaks plain REST, so one code path serves every
kind the renderer produces, custom resources included.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Any

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

from tandem.operator.kinds import PLURALS

FIELD_MANAGER = "tandem-operator"
CONNECTIONS = 64


class KubeError(Exception):
    """An API call that failed; `status` is the HTTP status (0 when the server was unreachable)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        self.status = status
        self.reason = reason
        self.message = message
        super().__init__(f"{status} {reason}: {message}")


class NotFound(KubeError):
    pass


class AlreadyExists(KubeError):
    pass


def collection_path(api_version: str, kind: str, namespace: str) -> str:
    """/api/v1/namespaces/NS/pods or /apis/GROUP/VERSION/namespaces/NS/PLURAL."""
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    return f"{base}/namespaces/{namespace}/{PLURALS[kind]}"


def object_path(api_version: str, kind: str, namespace: str, name: str) -> str:
    return f"{collection_path(api_version, kind, namespace)}/{name}"


def load_configuration() -> k8s_client.Configuration:
    """In-cluster service account when running in a pod, else the kubeconfig ($KUBECONFIG)."""
    configuration = k8s_client.Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    except k8s_config.ConfigException:
        k8s_config.load_kube_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    return configuration


class Kube:
    """Thread-safe enough for kopf's handler threads: each call builds its own request."""

    def __init__(
        self, configuration: k8s_client.Configuration | None = None, timeout_s: float = 30.0
    ):
        configuration = configuration or load_configuration()
        # Kept-alive connections: one per request in flight (kopf's handler threads, each
        # applying several children at once, the resync's, the refreshes'); the client's default
        # of 5 per CPU discards the rest after each request and opens a new TLS connection.
        configuration.connection_pool_maxsize = CONNECTIONS
        self.api = k8s_client.ApiClient(configuration)
        self.timeout_s = timeout_s
        self._group_cache: dict[str, tuple[float, set[str]]] = {}
        self._lock = threading.Lock()

    def request(
        self,
        method: str,
        path: str,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Any:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        serialized = self.api.param_serialize(
            method=method,
            resource_path=path,
            query_params=query or [],
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        method_, url, headers_, body_ = serialized[0], serialized[1], serialized[2], serialized[3]
        try:
            response = self.api.call_api(
                method_, url, header_params=headers_, body=body_, _request_timeout=self.timeout_s
            )
        except Exception as exc:  # urllib3 connection errors surface here
            raise KubeError(0, "Unreachable", str(exc)) from exc
        response.read()  # type: ignore[no-untyped-call]
        text = response.data.decode() if response.data else ""
        if response.status >= 400:
            raise _error(response.status, text)
        return json.loads(text) if text else None

    # --- objects ---------------------------------------------------------------------------

    def apply(self, obj: dict[str, Any], force: bool = True) -> dict[str, Any]:
        """Server-side apply with the operator's field manager (creates or updates)."""
        meta = obj["metadata"]
        path = object_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        query = [("fieldManager", FIELD_MANAGER), ("force", "true" if force else "false")]
        result: dict[str, Any] = self.request(
            "PATCH", path, query, obj, "application/apply-patch+yaml"
        )
        return result

    def create(self, obj: dict[str, Any], dry_run: bool = False) -> dict[str, Any] | None:
        """POST a new object; None when one of that name exists already (nothing is read).

        A dry run tells whether the name is taken with only the `create` permission: the answer
        is the object as sent, or AlreadyExists, never the stored object."""
        meta = obj["metadata"]
        path = collection_path(obj["apiVersion"], obj["kind"], meta["namespace"])
        query = [("fieldManager", FIELD_MANAGER)] + ([("dryRun", "All")] if dry_run else [])
        try:
            result: dict[str, Any] = self.request("POST", path, query, obj)
        except AlreadyExists:
            return None
        return result

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            result: dict[str, Any] = self.request(
                "GET", object_path(api_version, kind, namespace, name)
            )
        except NotFound:
            return None
        return result

    def list(
        self, api_version: str, kind: str, namespace: str, selector: str
    ) -> list[dict[str, Any]]:
        """Objects of one kind matching a label selector, each with apiVersion and kind filled in."""
        try:
            listing = self.request(
                "GET", collection_path(api_version, kind, namespace), [("labelSelector", selector)]
            )
        except NotFound:
            return []  # the API group is not served (e.g. no Prometheus Operator)
        return [
            {**item, "apiVersion": api_version, "kind": kind} for item in listing.get("items", [])
        ]

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        with contextlib.suppress(NotFound):
            self.request("DELETE", object_path(api_version, kind, namespace, name), body=body)

    def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Merge-patch the status; returns the object as stored after the patch."""
        path = object_path(api_version, kind, namespace, name) + "/status"
        result: dict[str, Any] | None = self.request(
            "PATCH", path, body={"status": status}, content_type="application/merge-patch+json"
        )
        return result

    # --- discovery -------------------------------------------------------------------------

    def serves(self, api_version: str, kind: str, ttl_s: float = 300.0) -> bool:
        """Whether the API server serves `kind` in `api_version` (e.g. a CRD is installed).

        Cached for `ttl_s`, so installing the Prometheus Operator later is noticed."""
        now = time.monotonic()
        with self._lock:
            cached = self._group_cache.get(api_version)
        if cached is None or now - cached[0] > ttl_s:
            path = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
            try:
                kinds = {r["kind"] for r in self.request("GET", path).get("resources", [])}
            except NotFound:
                kinds = set()
            cached = (now, kinds)
            with self._lock:
                self._group_cache[api_version] = cached
        return kind in cached[1]


def _error(status: int, text: str) -> KubeError:
    reason, message = "", text
    try:
        body = json.loads(text)
        reason, message = body.get("reason", ""), body.get("message", text)
    except ValueError:
        pass
    cls = {404: NotFound}.get(status, KubeError)
    if status == 409 and reason == "AlreadyExists":
        cls = AlreadyExists
    return cls(status, reason, message)
