"""Pure renderers of a KEDA ScaledObject or an autoscaling/v2 HorizontalPodAutoscaler per pool.

For clusters that already run KEDA or an HPA with prometheus-adapter: the same signals, targets,
range and step limits as the built-in autoscaler, expressed in their objects. Targets map as:
  - latency quantile (TTFT prefill, ITL decode): metric type Value, so the HPA computes
    desired = ceil(n * quantile / target), the built-in latency rule;
  - waiting requests per replica: AverageValue over the pool's sum, desired = ceil(sum / target);
  - decode KV usage: Value of the pool's mean, desired = ceil(n * mean / maxKVUsage).
The HPA's own 10 % tolerance plays the role of `tolerance`. behavior: scale-up without
stabilization, at most max(scaleUpMaxFactor, +scaleUpMaxPods) per interval; scale-down after
`scaleDownStabilizationSeconds`.
"""

from __future__ import annotations

import math
from typing import Any

from tandem.common.roles import Role
from tandem.operator.api import ServingCluster
from tandem.operator.autoscaling.policy import PoolPolicy, pool_policies
from tandem.operator.autoscaling.queries import PoolSelector, pool_queries
from tandem.operator.autoscaling.zero import demand_queries
from tandem.operator.common_render import child_name, rendered_roles, role_labels

# External metric names that the prometheus-adapter rules in docs/autoscaling.md define.
ADAPTER_LATENCY_METRIC: dict[Role, str] = {
    "prefill": "tandem_ttft_seconds",
    "decode": "tandem_itl_seconds",
}
ADAPTER_WAITING_METRIC = "vllm_num_requests_waiting"
# The routers' demand (held + arrived + in flight, `wake_query`) as the prometheus-adapter rule
# in docs/autoscaling.md names it.
ADAPTER_DEMAND_METRIC = "tandem_router_demand"
ADAPTER_KV_USAGE_METRIC = "vllm_kv_cache_usage_perc"
MAX_STABILIZATION_S = 3600  # the HPA API's upper bound
MAX_PERIOD_S = 1800


def quantity(value: float) -> str:
    """A Kubernetes quantity for a non-negative decimal: whole numbers plain, others in milli-units."""
    if float(value).is_integer():
        return str(int(value))
    return f"{max(1, round(value * 1000))}m"


def behavior(policy: PoolPolicy, interval_s: float) -> dict[str, Any]:
    """HPA scaling behavior equal to rules 4 and 5 of decision.py."""
    period = min(MAX_PERIOD_S, max(1, math.ceil(interval_s)))
    return {
        "scaleUp": {
            "stabilizationWindowSeconds": 0,
            "selectPolicy": "Max",
            "policies": [
                {
                    "type": "Percent",
                    "value": max(1, round((policy.scale_up_max_factor - 1) * 100)),
                    "periodSeconds": period,
                },
                {"type": "Pods", "value": policy.scale_up_max_pods, "periodSeconds": period},
            ],
        },
        "scaleDown": {
            "stabilizationWindowSeconds": min(
                MAX_STABILIZATION_S, round(policy.scale_down_stabilization_s)
            ),
            "selectPolicy": "Max",
            "policies": [{"type": "Percent", "value": 100, "periodSeconds": period}],
        },
    }


def _metadata(sc: ServingCluster, pool: Role) -> dict[str, Any]:
    return {
        "name": child_name(sc, pool),
        "namespace": sc.namespace,
        "labels": role_labels(sc, pool),
    }


def _target(sc: ServingCluster, pool: Role) -> dict[str, str]:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": child_name(sc, pool)}


def keda_scaled_object(sc: ServingCluster, pool: Role) -> dict[str, Any]:
    """A keda.sh/v1alpha1 ScaledObject with one prometheus trigger per configured signal."""
    scaling = sc.spec.autoscaling
    policy = pool_policies(scaling)[pool]
    queries = pool_queries(PoolSelector(namespace=sc.namespace, cluster=sc.name, pool=pool), policy)

    def trigger(query: str, threshold: float, metric_type: str) -> dict[str, Any]:
        return {
            "type": "prometheus",
            "metricType": metric_type,
            "metadata": {
                "serverAddress": scaling.prometheus_url,
                "query": query,
                "threshold": f"{threshold:g}",
                # An idle pool has no latency samples: read it as 0 so the pool can shrink.
                "ignoreNullValues": "true",
            },
        }

    triggers = []
    if policy.target_latency_s is not None:
        triggers.append(trigger(queries["latency_s"], policy.target_latency_s, "Value"))
    if policy.target_waiting_per_replica is not None:
        triggers.append(
            trigger(queries["waiting"], policy.target_waiting_per_replica, "AverageValue")
        )
    if policy.max_kv_usage is not None:
        triggers.append(trigger(queries["kv_usage"], policy.max_kv_usage, "Value"))
    spec: dict[str, Any] = {
        "scaleTargetRef": _target(sc, pool),
        "minReplicaCount": policy.min_replicas,
        "maxReplicaCount": policy.max_replicas,
        "pollingInterval": max(1, math.ceil(scaling.interval_seconds)),
        "advanced": {
            "horizontalPodAutoscalerConfig": {
                "behavior": behavior(policy, scaling.interval_seconds)
            }
        },
        "triggers": triggers,
    }
    zero = scaling.scale_to_zero
    if zero.enabled:
        # KEDA scales a pool from 0 when a trigger exceeds its activationThreshold and back to 0
        # cooldownPeriod after the last one did: the router's demand is that trigger.
        activation = trigger(wake_query(sc, pool), ACTIVATION_ONLY, "AverageValue")
        activation["metadata"]["activationThreshold"] = "0"
        triggers.append(activation)
        spec["minReplicaCount"] = 0
        spec["cooldownPeriod"] = max(1, math.ceil(zero.idle_seconds))
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": _metadata(sc, pool),
        "spec": spec,
    }


# An AverageValue target no demand reaches: the wake trigger only activates a pool from zero
# (desired = ceil(demand / target) = 1), the pool's own triggers size it.
ACTIVATION_ONLY = 1e6


def wake_query(sc: ServingCluster, pool: Role) -> str:
    """The router demand that wakes `pool` from zero and keeps it awake (zero.py's rules):

    decode, and prefill in mode always: held + arrived over the window + in flight
    prefill in mode auto:               requests P/D would have taken over the window
    """
    scaling = sc.spec.autoscaling
    queries = demand_queries(sc.namespace, sc.name, scaling.metrics_window_seconds)
    if pool == "prefill" and sc.spec.router.disaggregation.mode != "always":
        return queries["prefill_wanted"]
    return " + ".join(f"({queries[key]} or vector(0))" for key in ("held", "arrived", "in_flight"))


def horizontal_pod_autoscaler(sc: ServingCluster, pool: Role) -> dict[str, Any]:
    """An autoscaling/v2 HPA reading prometheus-adapter's External (latency) and Pods metrics."""
    scaling = sc.spec.autoscaling
    policy = pool_policies(scaling)[pool]
    metrics: list[dict[str, Any]] = []
    if policy.target_latency_s is not None:
        selector = {"matchLabels": {"tandem_dev_cluster": sc.name, "tandem_dev_role": pool}}
        metrics.append(
            {
                "type": "External",
                "external": {
                    "metric": {"name": ADAPTER_LATENCY_METRIC[pool], "selector": selector},
                    "target": {"type": "Value", "value": quantity(policy.target_latency_s)},
                },
            }
        )
    per_pod = (
        (ADAPTER_WAITING_METRIC, policy.target_waiting_per_replica),
        (ADAPTER_KV_USAGE_METRIC, policy.max_kv_usage),
    )
    metrics += [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": name},
                "target": {"type": "AverageValue", "averageValue": quantity(target)},
            },
        }
        for name, target in per_pod
        if target is not None
    ]
    if scaling.scale_to_zero.enabled:
        # minReplicas 0 needs the HPAScaleToZero feature gate and an Object or External metric:
        # the routers' demand, which scales the pool from 0 and keeps it at 1 or more while
        # requests come; the pool reaches 0 after scaleDownStabilizationSeconds without any.
        metrics.append(
            {
                "type": "External",
                "external": {
                    "metric": {
                        "name": ADAPTER_DEMAND_METRIC,
                        "selector": {"matchLabels": {"tandem_dev_cluster": sc.name}},
                    },
                    "target": {"type": "AverageValue", "averageValue": quantity(ACTIVATION_ONLY)},
                },
            }
        )
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _metadata(sc, pool),
        "spec": {
            "scaleTargetRef": _target(sc, pool),
            "minReplicas": 0 if scaling.scale_to_zero.enabled else policy.min_replicas,
            "maxReplicas": policy.max_replicas,
            "metrics": metrics,
            "behavior": behavior(policy, scaling.interval_seconds),
        },
    }


def external_autoscalers(sc: ServingCluster, provider: str) -> list[dict[str, Any]]:
    """One object per rendered pool: `keda` -> ScaledObjects, `hpa` -> HPAs, anything else -> none."""
    if not sc.spec.autoscaling.enabled:
        return []
    render = {"keda": keda_scaled_object, "hpa": horizontal_pod_autoscaler}.get(provider)
    if render is None:
        return []
    return [render(sc, pool) for pool in rendered_roles(sc)]
