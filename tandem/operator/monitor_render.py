"""The Prometheus Operator monitors of a ServingCluster: a ServiceMonitor and a PodMonitor."""

from __future__ import annotations

from typing import Any

from tandem.common.roles import LABEL_CLUSTER, LABEL_ROLE, ROLES
from tandem.operator.api import ServingCluster
from tandem.operator.common_render import Component, child_meta, child_name, selector_labels


def _engine_selector(sc: ServingCluster) -> dict[str, Any]:
    return {
        "matchLabels": {LABEL_CLUSTER: sc.name},
        "matchExpressions": [{"key": LABEL_ROLE, "operator": "In", "values": list(ROLES)}],
    }


# Copied onto every scraped series (as tandem_dev_cluster, tandem_dev_role): the autoscaler's
# queries select each pool by them.
MONITOR_POD_LABELS = [LABEL_CLUSTER, LABEL_ROLE]


def monitors(sc: ServingCluster) -> list[dict[str, Any]]:
    """A ServiceMonitor for the router and a PodMonitor for the engines (Prometheus Operator)."""
    monitoring = sc.spec.monitoring
    endpoint_ = {"port": "http", "path": "/metrics", "interval": monitoring.interval}
    # The router serves /metrics on its admin port only (the NAME-router-admin Service's).
    router_endpoint = {**endpoint_, "port": "admin"}

    def meta(name: str, role: Component | None) -> dict[str, Any]:
        meta_ = child_meta(sc, name, role)
        meta_["labels"] = {**meta_["labels"], **monitoring.labels}
        return meta_

    return [
        {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "ServiceMonitor",
            "metadata": meta(child_name(sc, "router"), "router"),
            "spec": {
                "selector": {"matchLabels": selector_labels(sc, "router")},
                "namespaceSelector": {"matchNames": [sc.namespace]},
                "endpoints": [router_endpoint],
                "podTargetLabels": MONITOR_POD_LABELS,
            },
        },
        {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "PodMonitor",
            "metadata": meta(child_name(sc, "engines"), None),
            "spec": {
                "selector": _engine_selector(sc),
                "namespaceSelector": {"matchNames": [sc.namespace]},
                "podMetricsEndpoints": [endpoint_],
                "podTargetLabels": MONITOR_POD_LABELS,
            },
        },
    ]
