"""The kubelet's readiness probe of an engine pod, for the pod runner.

KWOK starts engine pods Running but not Ready (e2e/cluster/kwok.yaml); the runner marks one Ready
when its process first answers the container's readiness probe, as a kubelet does. A Deployment's
rollout therefore waits for each new engine to serve before it takes the next old one down, and
the router's Pod watch admits an engine only once it answers. Not modelled: a Ready pod turning
unready again when its probe later fails (the router's own health checks cover that here).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Mapping
from typing import Any

PROBE_TIMEOUT_S = 0.5
ENGINE_ROLES = ("prefill", "decode")


def awaits_readiness(pod: Mapping[str, Any]) -> bool:
    """An engine pod KWOK has left unready, whose readiness is the runner's to report."""
    role = (pod["metadata"].get("labels") or {}).get("tandem.dev/role")
    conditions = (pod.get("status") or {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return role in ENGINE_ROLES and not ready


def probe_passes(pod: Mapping[str, Any]) -> bool:
    """Whether the first container's readiness probe (an httpGet) answers 2xx/3xx now; a pod
    without an httpGet readiness probe is ready as soon as it runs."""
    container = pod["spec"]["containers"][0]
    get = (container.get("readinessProbe") or {}).get("httpGet")
    if get is None:
        return True
    port = get["port"]
    if not str(port).isdigit():
        named = {p.get("name"): p["containerPort"] for p in container.get("ports") or []}
        port = named[port]
    url = f"http://{pod['status']['podIP']}:{port}{get.get('path', '/')}"
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S) as answer:
            return bool(200 <= answer.status < 400)
    except OSError:
        return False


def ready_patch(now: str) -> dict[str, Any]:
    """The status patch a kubelet makes when the probe first passes."""
    return {
        "status": {
            "conditions": [
                {"type": "ContainersReady", "status": "True", "lastTransitionTime": now},
                {"type": "Ready", "status": "True", "lastTransitionTime": now},
            ]
        }
    }
