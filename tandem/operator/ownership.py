"""Pure checks before applying: which existing objects Tandem may touch, and which user-owned
Secrets and PVCs a ServingCluster needs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tandem.common.roles import LABEL_CLUSTER
from tandem.operator.api import ServingCluster
from tandem.operator.api_kube import EnvVar
from tandem.operator.common_render import LABEL_MANAGED_BY, MANAGED_BY


def foreign_owner(existing: Mapping[str, Any], owner_uid: str, cluster_name: str) -> str | None:
    """Why `existing` is not this ServingCluster's to apply over, or None when it is.

    Ours: controlled by this ServingCluster (owner uid), or carrying no controller at all but
    Tandem's labels for this cluster (an orphan left by `kubectl delete --cascade=orphan`, adopted
    back). Anything else was made by someone else and is left alone.
    """
    meta = existing.get("metadata", {})
    refs = meta.get("ownerReferences") or []
    controller = next((ref for ref in refs if ref.get("controller")), None)
    if controller is not None:
        if controller.get("uid") == owner_uid:
            return None
        return f"controlled by {controller.get('kind')}/{controller.get('name')}"
    labels = meta.get("labels") or {}
    if labels.get(LABEL_MANAGED_BY) == MANAGED_BY and labels.get(LABEL_CLUSTER) == cluster_name:
        return None
    return "not created by Tandem"


@dataclass(frozen=True, order=True)
class Dependency:
    """A user-owned object the pods need: it must exist before they can start."""

    kind: str  # Secret or PersistentVolumeClaim
    name: str
    used_for: str

    def missing_message(self, namespace: str) -> str:
        return f"{self.kind} {namespace}/{self.name} ({self.used_for}) not found"


def _secret_refs(env: list[EnvVar], where: str) -> list[Dependency]:
    found = []
    for var in env:
        ref = (var.value_from or {}).get("secretKeyRef") or {}
        if ref.get("name") and not ref.get("optional"):
            found.append(Dependency("Secret", ref["name"], f"env {var.name} of {where}"))
    return found


def dependencies(sc: ServingCluster) -> list[Dependency]:
    """Every Secret and PVC the rendered pods reference and Tandem does not create, once each."""
    spec = sc.spec
    found: list[Dependency] = []
    if spec.model.hf_token_secret:
        found.append(Dependency("Secret", spec.model.hf_token_secret.name, "model.hfTokenSecret"))
    if spec.model.cache:
        found.append(Dependency("PersistentVolumeClaim", spec.model.cache.pvc, "model.cache"))
    keys = spec.router.auth.client_keys_secret
    if keys:
        found.append(Dependency("Secret", keys.name, "router.auth.clientKeysSecret"))
    found += _secret_refs(spec.engine.env, "engine")
    found += _secret_refs(spec.prefill.env, "prefill")
    found += _secret_refs(spec.decode.env, "decode")
    found += _secret_refs(spec.router.env, "router")
    found += [Dependency("Secret", name, "imagePullSecrets") for name in spec.image_pull_secrets]
    unique: dict[tuple[str, str], Dependency] = {}
    for dependency in found:
        unique.setdefault((dependency.kind, dependency.name), dependency)
    return list(unique.values())
