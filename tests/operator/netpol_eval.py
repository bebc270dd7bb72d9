"""A small NetworkPolicy evaluator (networking.k8s.io/v1 semantics) for the reachability matrix.

No network plugin runs in these tests, so the rendered policies are evaluated here, by the rules
of the API reference: a pod selected by no policy of a direction allows everything in it; a
selected pod allows only what some rule of a selecting policy allows; a connection needs the
source's egress and the destination's ingress. `ipBlock` peers match only endpoints outside the
pod network (the API leaves pod IPs in an ipBlock to the plugin, so the strict reading is used).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Endpoint:
    """A pod (namespace, labels, named ports) or, with namespace None, an address outside pods."""

    name: str
    namespace: str | None
    labels: Mapping[str, str] = field(default_factory=dict)
    ports: Mapping[str, int] = field(default_factory=dict)  # container port names


def selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions) against labels; {} selects all."""
    if selector is None:
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values") or []
        present = key in labels
        if operator == "In" and not (present and labels[key] in values):
            return False
        if operator == "NotIn" and present and labels[key] in values:
            return False
        if operator == "Exists" and not present:
            return False
        if operator == "DoesNotExist" and present:
            return False
    return True


def _peer_matches(
    peer: Mapping[str, Any],
    policy_namespace: str,
    other: Endpoint,
    namespaces: Mapping[str, Mapping[str, str]],
) -> bool:
    if "ipBlock" in peer:
        return other.namespace is None
    if other.namespace is None:
        return False
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], namespaces.get(other.namespace, {})):
            return False
    elif other.namespace != policy_namespace:
        return False
    return "podSelector" not in peer or selects(peer["podSelector"], other.labels)


def _port_matches(
    ports: list[Mapping[str, Any]] | None, target: Endpoint, port: int, protocol: str
) -> bool:
    if not ports:
        return True
    for entry in ports:
        if entry.get("protocol", "TCP") != protocol:
            continue
        wanted = entry.get("port")
        if wanted is None:
            return True
        number = target.ports.get(wanted) if isinstance(wanted, str) else wanted
        if number is None:
            continue
        if number <= port <= entry.get("endPort", number):
            return True
    return False


@dataclass(frozen=True)
class Connection:
    """A connection attempt: to `target` (whose named ports resolve a rule's ports) on a port."""

    target: Endpoint
    port: int
    protocol: str


def _allowed(
    policies: Iterable[Mapping[str, Any]],
    ends: tuple[Endpoint, Endpoint],
    connection: Connection,
    direction: str,
    namespaces: Mapping[str, Mapping[str, str]],
) -> bool:
    """Whether the policies of `subject` (ends[0]) of `direction` let `connection` to or from
    `other` (ends[1])."""
    subject, other = ends
    if subject.namespace is None:
        return True  # outside the pod network: no policy applies
    kind = "Ingress" if direction == "ingress" else "Egress"
    selecting = [
        p
        for p in policies
        if p["metadata"]["namespace"] == subject.namespace
        and kind in p["spec"].get("policyTypes", ["Ingress"])
        and selects(p["spec"]["podSelector"], subject.labels)
    ]
    if not selecting:
        return True
    peers_key = "from" if direction == "ingress" else "to"
    for policy in selecting:
        for rule in policy["spec"].get(direction) or []:
            peers = rule.get(peers_key)
            if peers and not any(
                _peer_matches(peer, policy["metadata"]["namespace"], other, namespaces)
                for peer in peers
            ):
                continue
            if _port_matches(
                rule.get("ports"), connection.target, connection.port, connection.protocol
            ):
                return True
    return False


def reachable(
    policies: list[Mapping[str, Any]],
    source: Endpoint,
    destination: Endpoint,
    port: int,
    protocol: str = "TCP",
    namespaces: Mapping[str, Mapping[str, str]] | None = None,
) -> bool:
    """Whether `source` may open a connection to `destination` on `port`."""
    spaces = namespaces or {}
    connection = Connection(destination, port, protocol)
    return _allowed(policies, (source, destination), connection, "egress", spaces) and _allowed(
        policies, (destination, source), connection, "ingress", spaces
    )
