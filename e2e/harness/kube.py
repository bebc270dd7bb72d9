"""Small read-and-wait helpers over the Kubernetes client for the e2e tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from kubernetes import client as k8s

T = TypeVar("T")


def eventually(
    probe: Callable[[], T | None],
    *,
    timeout_s: float,
    what: str,
    interval_s: float = 0.25,
    details: Callable[[], str] | None = None,
) -> T:
    """Calls `probe` until it returns something truthy and returns that; fails with `what`."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except k8s.ApiException as error:
            last = error
        else:
            if last:
                return last  # type: ignore[no-any-return]
        time.sleep(interval_s)
    extra = f"\n{details()}" if details is not None else ""
    raise AssertionError(
        f"timed out after {timeout_s:.0f} s waiting for {what}; last: {last!r}{extra}"
    )


def gone(read: Callable[[], object]) -> bool:
    """True once `read` answers 404."""
    try:
        read()
    except k8s.ApiException as error:
        if error.status == 404:
            return True
        raise
    return False


def zero_pool_cluster(
    name: str, namespace: str, router: dict[str, Any], **spec: Any
) -> dict[str, Any]:
    """A ServingCluster manifest whose pools have no replicas, for tests of the operator and the
    router's objects rather than of serving: no engine starts unless `spec` (fields that replace
    the defaults, e.g. `model`, `autoscaling`) adds an autoscaler that sizes the pools."""
    return {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "ServingCluster",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
            "prefill": {"replicas": 0},
            "decode": {"replicas": 0},
            "router": router,
            **spec,
        },
    }


def crd_established(api: k8s.ApiClient, name: str) -> bool:
    """Whether the CustomResourceDefinition `name` is served yet (its Established condition)."""
    crd = k8s.ApiextensionsV1Api(api).read_custom_resource_definition(name)
    conditions = (crd.status.conditions if crd.status else None) or []
    return any(c.type == "Established" and c.status == "True" for c in conditions)
