"""Applies a shared gateway's objects for its members as the API server holds them now."""

from __future__ import annotations

from tandem.operator.api import API_VERSION, KIND, ServingCluster
from tandem.operator.gateway_render import members, render_gateway
from tandem.operator.kube import Kube
from tandem.operator.manifest import ManifestError, parse_manifest


def apply_gateway(kube: Kube, namespace: str, gateway: str, leaving: str | None = None) -> int:
    """Server-side applies `gateway`'s objects rendered from the namespace's ServingClusters that
    join it (`leaving`, a member being deleted, left out; invalid manifests too: their own
    reconcile reports them); the number of objects applied."""
    clusters: list[ServingCluster] = []
    for item in kube.list(API_VERSION, KIND, namespace, ""):
        meta = item.get("metadata", {})
        if meta.get("name") == leaving or meta.get("deletionTimestamp"):
            continue
        try:
            clusters.append(parse_manifest(item))
        except ManifestError:
            continue
    objects = render_gateway(gateway, members(clusters, namespace, gateway))
    for obj in objects:
        kube.apply(obj)
    return len(objects)
