"""The pure renderer: one ServingCluster → every Kubernetes object that serves it.

Nothing here talks to a cluster: `render(sc)` is a function of the object alone (spec, plus the
autoscaler's decisions kept in its status), so it can be snapshot-tested and run by `tandem render`.
Owner references are added by the apply layer, which knows the object's uid.
"""

from __future__ import annotations

from typing import Any

from tandem.operator import inference_pool as gateway
from tandem.operator.api import ServingCluster
from tandem.operator.autoscaling.external import external_autoscalers
from tandem.operator.common_render import (
    Component,
    child_meta,
    child_name,
    external_scaling,
    rendered_roles,
    selector_labels,
)
from tandem.operator.engine_render import engine_deployment, engine_service
from tandem.operator.monitor_render import monitors
from tandem.operator.network_render import network_policies
from tandem.operator.router_render import (
    router_admin_service,
    router_config_map,
    router_deployment,
    router_role,
    router_role_binding,
    router_service,
    router_service_account,
)


def disruption_budget(sc: ServingCluster, role: Component) -> dict[str, Any]:
    """At most one pod of a component down at a time from voluntary disruptions (drains).

    maxUnavailable rather than minAvailable: it follows the Deployment's current scale (the
    autoscaler's, or a router scaled from 3 to 5) without being re-rendered, and a pod that is
    already unready counts against it, so a drain never takes a second one."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_meta(sc, child_name(sc, role), role),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(sc, role)}},
    }


def render(sc: ServingCluster) -> list[dict[str, Any]]:
    """Every child object of a ServingCluster, in the order they are best applied."""
    objects: list[dict[str, Any]] = [
        router_service_account(sc),
        router_role(sc),
        router_role_binding(sc),
        router_config_map(sc),
    ]
    for role in rendered_roles(sc):
        objects += [
            engine_service(sc, role),
            engine_deployment(sc, role),
            disruption_budget(sc, role),
        ]
    objects += [
        router_service(sc),
        router_admin_service(sc),
        router_deployment(sc),
        *gateway.objects(sc),
    ]
    if sc.spec.router.replicas > 1:
        # One router pod has nothing to keep through a drain (a budget of maxUnavailable 1 would
        # allow evicting it anyway); dropping back to one prunes the budget.
        objects.append(disruption_budget(sc, "router"))
    if sc.spec.monitoring.enabled:
        objects += monitors(sc)
    if sc.spec.network_policy.enabled:
        objects += network_policies(sc)
    if external_scaling(sc):
        objects += provider_autoscalers(sc)
    return objects


def provider_autoscalers(sc: ServingCluster) -> list[dict[str, Any]]:
    """The ScaledObjects or HPAs of `spec.autoscaling.provider`, one per pool."""
    return external_autoscalers(sc, sc.spec.autoscaling.provider)
