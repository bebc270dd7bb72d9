"""Several operator replicas: kopf peering picks the active one; this module adds what kopf leaves
to us.

kopf pauses a replica's watch streams (and so its handlers, daemons and timers) while another
live peer of the same KopfPeering has a higher priority, and pauses *all* replicas when two share
a priority. Two things are therefore ours to do:

- every replica needs its own priority: `replica_priority` draws one at random unless given;
- our own background loops (the drift-repair resync, the autoscaler's loops) are not kopf's, so
  kopf's pause does not reach them: `Leadership` follows the same peering object and applies the
  same rule (`is_active`), so they run on the active replica only.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import random
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tandem.operator.kube import Kube, KubeError

log = logging.getLogger("tandem.operator.peering")

PEERING_API = "kopf.dev/v1"
# A killed replica's entry counts as alive for this long after its last keep-alive (kopf's
# default is 60 s; a standby must take over well within 30 s).
DEFAULT_LIFETIME_S = 15
POLL_S = 2.0


def replica_identity() -> str:
    """This replica's peer id: the pod's hostname (its name) plus the process id."""
    return f"{socket.gethostname()}-{os.getpid()}"


def replica_priority(given: int | None) -> int:
    """The priority to peer with: the one given, else a random one, so no two replicas tie
    (a tie pauses every replica)."""
    return given if given is not None else random.randint(1, 2**31 - 1)


def _parse_time(text: str) -> datetime.datetime:
    parsed = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=datetime.UTC)


def peer_live(info: Mapping[str, Any], now: datetime.datetime) -> bool:
    """Whether a peer's entry is live: lastseen + lifetime > now (kopf writes `lastseen` and
    `lifetime` into the peering object's status)."""
    lastseen = info.get("lastseen")
    if lastseen is None:
        return False
    deadline = _parse_time(str(lastseen)) + datetime.timedelta(
        seconds=int(info.get("lifetime", 60))
    )
    return deadline > now


def is_active(
    peers: Mapping[str, Mapping[str, Any]], identity: str, priority: int, now: datetime.datetime
) -> bool:
    """kopf's rule, as seen by the replica `identity`: active when its own entry is live and no
    other live peer has a priority >= `priority` (`peer_live`)."""
    own = peers.get(identity)
    if own is None or not peer_live(own, now):
        return False
    return not any(
        peer_live(info, now) and int(info.get("priority", 0)) >= priority
        for peer, info in peers.items()
        if peer != identity
    )


def peering_paths(name: str, namespaces: Sequence[str]) -> list[str]:
    """The peering objects kopf keeps: one ClusterKopfPeering for a cluster-wide operator, else a
    KopfPeering in each served namespace."""
    if not namespaces:
        return [f"/apis/{PEERING_API}/clusterkopfpeerings/{name}"]
    return [f"/apis/{PEERING_API}/namespaces/{ns}/kopfpeerings/{name}" for ns in namespaces]


def ensure_peering_objects(kube: Kube, name: str, namespaces: Sequence[str]) -> None:
    """Create the peering objects kopf writes its keep-alives into (kopf only patches them, so a
    missing one would leave every replica paused); one that exists already is left as it is."""
    for path in peering_paths(name, namespaces):
        collection, _, _ = path.rpartition("/")
        kind = "ClusterKopfPeering" if not namespaces else "KopfPeering"
        meta: dict[str, Any] = {"name": name}
        if namespaces:
            meta["namespace"] = path.split("/namespaces/")[1].split("/")[0]
        try:
            kube.request(
                "POST", collection, body={"apiVersion": PEERING_API, "kind": kind, "metadata": meta}
            )
        except KubeError as exc:
            if exc.status != 409:  # 409 AlreadyExists: another replica made it
                raise


class Leadership:
    """Whether this replica is the active one, refreshed every POLL_S from the peering objects
    (active in every one of them). A standalone operator is always active."""

    def __init__(
        self,
        identity: str,
        priority: int,
        paths: Sequence[str] = (),
        poll_s: float = POLL_S,
    ) -> None:
        self.identity = identity
        self.priority = priority
        self.paths = list(paths)
        self.poll_s = poll_s
        self.active = not self.paths

    def refresh(self, kube: Kube) -> bool:
        now = datetime.datetime.now(datetime.UTC)
        active = True
        for path in self.paths:
            try:
                peering = kube.request("GET", path) or {}
            except KubeError as exc:
                log.warning("peering: cannot read %s: %s", path, exc)
                active = False  # unreachable or missing: act as a standby, never as a second leader
                break
            active = active and is_active(
                peering.get("status") or {}, self.identity, self.priority, now
            )
        if active != self.active:
            log.info("peering: this replica is now %s", "active" if active else "standby")
        self.active = active
        return active

    async def follow(self, client: Callable[[], Kube]) -> None:
        """Refresh until cancelled (nothing to follow when standalone)."""
        while self.paths:
            await asyncio.to_thread(self.refresh, client())
            await asyncio.sleep(self.poll_s)
