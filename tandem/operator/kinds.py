"""Every Kubernetes kind the operator touches: API version, kind and resource name, in one list.

The renderer's kinds (`CHILD_KINDS`) are the only ones the operator ever prunes; the REST client,
the RBAC reference in docs/api.md and the tests read the same list, so a kind cannot be rendered
without the client knowing how to name it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kind:
    api_version: str
    kind: str
    plural: str  # the REST resource name

    @property
    def group(self) -> str:
        """The API group ("" for the core group)."""
        return self.api_version.rpartition("/")[0]


# Kinds the renderer may produce, and so the only kinds the operator ever prunes. PVCs and
# Secrets are deliberately absent: users own them (model cache, HF token) and they must survive.
CHILD_KINDS: tuple[Kind, ...] = (
    Kind("v1", "ServiceAccount", "serviceaccounts"),
    Kind("rbac.authorization.k8s.io/v1", "Role", "roles"),
    Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
    Kind("v1", "ConfigMap", "configmaps"),
    Kind("v1", "Service", "services"),
    Kind("apps/v1", "Deployment", "deployments"),
    Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
    Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
    Kind("monitoring.coreos.com/v1", "ServiceMonitor", "servicemonitors"),
    Kind("monitoring.coreos.com/v1", "PodMonitor", "podmonitors"),
    Kind("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers"),
    Kind("keda.sh/v1alpha1", "ScaledObject", "scaledobjects"),
    Kind("inference.networking.k8s.io/v1", "InferencePool", "inferencepools"),
)
# Kinds the operator reads or writes without owning them.
OTHER_KINDS: tuple[Kind, ...] = (
    Kind("tandem.dev/v1alpha1", "ServingCluster", "servingclusters"),
    Kind("v1", "Pod", "pods"),
    Kind("v1", "Event", "events"),
    Kind("v1", "Secret", "secrets"),
    Kind("v1", "PersistentVolumeClaim", "persistentvolumeclaims"),
)
NEVER_PRUNED_KINDS = frozenset({"PersistentVolumeClaim", "Secret"})

# kind -> resource name, for every kind the operator reads or writes (all namespaced).
PLURALS: dict[str, str] = {k.kind: k.plural for k in (*CHILD_KINDS, *OTHER_KINDS)}
