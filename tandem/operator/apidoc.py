"""The ServingCluster API reference (docs/api.md), generated from the models' fields and docstrings."""

from __future__ import annotations

import json
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel

from tandem.operator.api import API_VERSION, KIND, ServingClusterSpec
from tandem.operator.api_model import MAX_NAME_LENGTH, Quantity
from tandem.operator.api_status import ServingClusterStatus
from tandem.operator.crd import field_default, model_classes

INTRO = f"""# ServingCluster API reference ({API_VERSION})

Generated from `tandem/operator/api.py` and `tandem/common/routing.py` (the router policy the
router reads as it is) by `tandem crd --docs`; do not edit by hand.

A `{KIND}` turns one model into a prefill pool, a decode pool and a KV-aware router. Every field
below is optional unless marked **required**; defaults are applied by the API server (the CRD
schema carries them) and by `tandem render` / `tandem up` alike. Cross-field rules are checked by
CEL at admission and by the same rules in Python, with messages that name the field.

The object's name is a DNS-1035 label of at most {MAX_NAME_LENGTH} characters: children are named
`<name>-prefill`, `<name>-decode`, `<name>-router` and `<name>-engines`.
"""


def _anchor(cls: type[BaseModel]) -> str:
    return cls.__name__.lower()


def type_name(annotation: Any) -> str:
    """A reader's name for a field type, with links to nested models."""
    if annotation == Quantity:
        return "quantity (int or string)"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{_anchor(annotation)})"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if sorted(map(str, rest)) == ["<class 'int'>", "<class 'str'>"]:
            return "quantity (int or string)"
        return " or ".join(type_name(a) for a in rest)
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is dict:
        return "object" if args[1] is Any else f"map of {type_name(args[1])}"
    simple = {int: "integer", float: "number", str: "string", bool: "boolean"}
    if annotation is Any:
        return "any"
    return simple.get(annotation, str(annotation))


def _default_text(field: Any) -> str:
    if field.is_required():
        return "**required**"
    has_default, value = field_default(field)
    if not has_default:
        return ""
    if _nested(field.annotation):
        return "(see below)"
    return f"`{json.dumps(value)}`"


def _nested(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        found += _nested(arg)
    return found


def _escape(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def model_section(cls: type[BaseModel], path: str) -> str:
    rows = ["| Field | Type | Default | Description |", "|---|---|---|---|"]
    for name, field in cls.model_fields.items():
        key = field.alias or name
        rows.append(
            f"| `{key}` | {type_name(field.annotation)} | {_default_text(field)} "
            f"| {_escape(field.description or '')} |"
        )
    doc = _escape(cls.__doc__ or "")
    return (
        f'<a id="{_anchor(cls)}"></a>\n### {cls.__name__}\n\n`{path}` — {doc}\n\n'
        + "\n".join(rows)
        + "\n"
    )


OBJECTS = """## What the operator creates

For a ServingCluster `NAME` (every object labelled `app.kubernetes.io/name: tandem`,
`app.kubernetes.io/instance: NAME`, `app.kubernetes.io/managed-by: tandem-operator`,
`tandem.dev/cluster: NAME`, `tandem.dev/role: prefill|decode|router`, and owned by the
ServingCluster so that deleting it garbage-collects them; PVCs and Secrets are only referenced):

| Object | Name | Notes |
|---|---|---|
| Deployment | `NAME-prefill`, `NAME-decode` | `vllm serve` with NixlConnector (`kv_producer` / `kv_consumer`), KV events on ports 5557 (PUB) and 5558 (replay), NIXL side channel 5600, HTTP 8000, probes on `/health`; no prefill pool when `router.disaggregation.mode` is `never` |
| Service (headless) | `NAME-prefill`, `NAME-decode` | ports `http`, `kv-events`, `kv-replay`, `nixl` |
| PodDisruptionBudget | `NAME-prefill`, `NAME-decode`; `NAME-router` when `router.replicas` > 1 | `maxUnavailable: 1` (follows the current scale; an unready pod counts against it) |
| Deployment, Service | `NAME-router` | `tandem router --config /etc/tandem/router.yaml`; the Service is the endpoint clients use; liveness probe `/livez`, readiness `/health` |
| Service | `NAME-router-admin` | ClusterIP, port `admin` (9901): the router's `/metrics` (scraped by the ServiceMonitor) and `/engines` |
| ConfigMap | `NAME-router` | key `router.yaml`: the router's configuration (a change rolls the router pods) |
| ServiceAccount, Role, RoleBinding | `NAME-router` | the router may get/list/watch Pods and get/list Deployments and ReplicaSets in the namespace (engine discovery admits only the pools' own Pods) |
| ServiceMonitor, PodMonitor | `NAME-router`, `NAME-engines` | when `monitoring.enabled` and the monitoring.coreos.com CRDs exist |
| NetworkPolicy | `NAME-engines`, `NAME-router` | when `networkPolicy.enabled` |

## Status conditions

| Type | True when | Reasons |
|---|---|---|
| `Ready` | every pool has all desired pods ready on the current spec | `AllPodsReady`, `PodsStarting`, `PodsNotReady`, `SpecNotApplied`, `InvalidSpec` |
| `Progressing` | a pool is rolling out a new spec or starting pods (scale-up, a replaced pod) | `Applying`, `RollingOut`, `PodsStarting`, `RolloutComplete`, `ProgressDeadlineExceeded` |
| `Degraded` | an apply failed, a rollout failed, a rolled-out pool fell below minimum availability, an object of a rendered name is not Tandem's, a referenced Secret or PVC is missing, or a reconcile raised | `ApplyFailed`, `RolloutFailed`, `PodsUnavailable`, `InvalidSpec`, `Conflict`, `DependencyMissing`, `ReconcileFailed`, `AsExpected` |
| `ScalingLimited` | the autoscaler wanted more pods than a limit allows (written by the autoscaler) | `AutoscalingDisabled` when off; the autoscaler's reasons when on (docs/autoscaling.md) |
| `MetricsUnavailable` | the autoscaler could not read Prometheus, or read a malformed or non-finite value (written by the autoscaler, only while on) | see docs/autoscaling.md |
| `ScalingActive` | the autoscaler's last evaluation completed (False: it raised; sizes are held) | `Evaluated`, `EvaluationFailed` |

`status.phase` is `Pending` (no pod ready yet), `Progressing`, `Ready` or `Degraded`.

## Permissions the operator needs

The chart grants them from one file, `charts/tandem/files/operator-rules.yaml`, in a cluster mode
(ClusterRole) or a namespaced mode (a Role per watched namespace); docs/security.md lists them in
a table that a test keeps equal to that file. The operator never reads Secrets (it may only create
them), and no handler needs a finalizer, so deleting a ServingCluster never waits for it.
"""


def rules_section() -> str:
    """Every cross-field (CEL) rule, where it sits and its message."""
    rows = ["| Object | Field | Rule (CEL) | Message |", "|---|---|---|---|"]
    for cls in model_classes(ServingClusterSpec).values():
        for rule in getattr(cls, "cel_rules", ()):
            rows.append(
                f"| {cls.__name__} | `{rule.field}` | `{_escape(rule.cel)}` | {rule.message} |"
            )
    return "## Cross-field rules\n\n" + "\n".join(rows) + "\n"


def api_reference_markdown() -> str:
    """docs/api.md: one table per model, spec first, then status."""
    sections = [INTRO]
    for title, root, root_path in (
        ("Spec", ServingClusterSpec, "spec"),
        ("Status", ServingClusterStatus, "status"),
    ):
        sections.append(f"## {title}\n")
        seen: set[str] = set()
        pending: list[tuple[type[BaseModel], str]] = [(root, root_path)]
        while pending:
            cls, path = pending.pop(0)
            if cls.__name__ in seen:
                continue
            seen.add(cls.__name__)
            sections.append(model_section(cls, path))
            for name, field in cls.model_fields.items():
                suffix = "[]" if typing.get_origin(field.annotation) is list else ""
                for nested in _nested(field.annotation):
                    pending.append((nested, f"{path}.{field.alias or name}{suffix}"))
    return "\n".join([*sections, rules_section(), OBJECTS])
