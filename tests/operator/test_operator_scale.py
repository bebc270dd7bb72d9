"""Operator efficiency and HA units: requests per reconcile, no-op status patches, coalesced
refreshes, server-side watch selectors, and the peering rule that gates our own loops.

The API server is the in-memory FakeKube of test_operator_handlers (counting every call); the real
kube-apiserver runs the same code in e2e/test_operator_ha.py and benchmarks/operator_scale.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import logging
import threading
from typing import Any

import pytest
from sc_manifests import minimal
from test_operator_handlers import Events, FakeKube, mark_ready

from tandem.operator import main as operator_main
from tandem.operator.cache import Caches, ObjectCache
from tandem.operator.child_apply import needs_prune
from tandem.operator.peering import Leadership, is_active, peering_paths, replica_priority
from tandem.operator.reconcile import reconcile_body
from tandem.operator.refresh import CoalescedRefresh, ReconcileInProgress
from tandem.operator.refresh import refresh_owner_status as refresh
from tandem.operator.resync import resync_once
from tandem.operator.status import status_changes
from tandem.operator.status_report import status_lock


class CountingKube(FakeKube):
    """FakeKube that counts the requests a real client would send, by verb."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def apply(self, obj: dict[str, Any], force: bool = True) -> dict[str, Any]:
        self.calls.append("apply")
        return super().apply(obj, force)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls.append("get")
        return super().get(api_version, kind, namespace, name)

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[Any]:
        self.calls.append("list")
        return super().list(api_version, kind, namespace, selector)

    def patch_status(self, *args: Any) -> dict[str, Any]:
        self.calls.append("patch_status")
        return super().patch_status(*args)


def test_a_first_reconcile_applies_and_reports_without_listing_or_reading_children() -> None:
    kube, events = CountingKube(), Events()
    body = kube.add_cluster(minimal())
    reconcile_body(kube, body, events)  # type: ignore[arg-type]
    applies = kube.calls.count("apply")
    # The engine key's uid is recorded first; each child is read (is it someone else's?) and
    # applied (several at once, so in no fixed order); nothing can be stale at generation 1, so
    # nothing is listed; the Deployments' status comes from the apply replies; one read of the
    # cluster and one status patch end it.
    assert kube.calls[0] == "patch_status"
    assert sorted(kube.calls[1:-2]) == ["apply"] * applies + ["get"] * applies
    assert kube.calls[-2:] == ["get", "patch_status"]


def test_workloads_are_applied_after_everything_they_need() -> None:
    kube, events = FakeKube(), Events()
    kube.add_cluster(minimal(networkPolicy={"enabled": True}))
    reconcile_body(kube, kube.cluster(), events)  # type: ignore[arg-type]
    kinds = [key.kind for key in kube.applies]
    first_workload = kinds.index("Deployment")
    assert set(kinds[first_workload:]) == {"Deployment"}
    assert {"ServiceAccount", "ConfigMap", "NetworkPolicy", "PodDisruptionBudget"} <= set(
        kinds[:first_workload]
    )


def test_a_spec_change_prunes_and_a_resync_always_does() -> None:
    assert needs_prune(2, 1)
    assert needs_prune(2, None)
    assert not needs_prune(1, None)
    assert not needs_prune(3, 3)
    kube, events = CountingKube(), Events()
    body = kube.add_cluster(minimal())
    reconcile_body(kube, kube.cluster(), events)  # type: ignore[arg-type]
    body = kube.cluster()
    kube.calls.clear()
    reconcile_body(kube, body, events)  # type: ignore[arg-type]
    assert kube.calls.count("list") == 0  # same generation: nothing can have gone stale
    reconcile_body(kube, body, events, full=True)  # type: ignore[arg-type]
    assert kube.calls.count("list") > 0
    body["metadata"]["generation"] = 2
    kube.calls.clear()
    reconcile_body(kube, body, events)  # type: ignore[arg-type]
    assert kube.calls.count("list") > 0


def test_a_refresh_that_changes_nothing_does_not_patch() -> None:
    kube, events = CountingKube(), Events()
    kube.add_cluster(minimal())
    reconcile_body(kube, kube.cluster(), events)  # type: ignore[arg-type]
    mark_ready(kube)
    assert refresh(kube, "ns", "m", events) == "Ready"  # type: ignore[arg-type]
    kube.calls.clear()
    assert refresh(kube, "ns", "m", events) == "Ready"  # type: ignore[arg-type]
    assert kube.calls == ["get", "list"]  # the cluster and one LIST of its Deployments
    assert events.reasons() == ["Applied", "Pending", "Ready"]


def test_status_changes() -> None:
    stored = {"phase": "Ready", "prefill": {"ready": 1}}
    assert not status_changes(stored, {"phase": "Ready", "prefill": {"ready": 1}, "router": None})
    assert status_changes(stored, {"phase": "Degraded"})
    assert status_changes(stored, {"prefill": None})
    assert status_changes({}, {"endpoint": "http://x"})


async def drained(refresher: CoalescedRefresh) -> None:
    """Until every requested refresh has run: each cluster's drain task ends when nothing is
    pending (bounded generously, for a loaded machine)."""
    await asyncio.wait_for(asyncio.gather(*refresher.tasks.values()), timeout=30)


def test_refreshes_coalesce_per_cluster() -> None:
    runs: list[tuple[str, str, bool]] = []

    def slow_refresh(namespace: str, name: str, reapply: bool) -> None:
        runs.append((namespace, name, reapply))

    async def scenario() -> None:
        refresher = CoalescedRefresh(slow_refresh, delay_s=0.05)
        for _ in range(50):
            refresher.request("ns", "a")
        refresher.request("ns", "a", reapply=True)
        refresher.request("ns", "b")
        await drained(refresher)
        refresher.request("ns", "a")
        await drained(refresher)
        await refresher.stop()

    asyncio.run(scenario())
    assert sorted(runs[:2]) == [("ns", "a", True), ("ns", "b", False)]
    assert runs[2:] == [("ns", "a", False)]


def test_settings_filter_the_deployment_watch_on_the_server_and_post_no_kopf_logs() -> None:
    settings = operator_main.operator_settings(operator_main.parse_args([]))
    selectors = dict(settings.watching.label_selectors.items())
    assert list(selectors.values()) == ["app.kubernetes.io/managed-by=tandem-operator"]
    (selector,) = selectors
    assert (selector.group, selector.any_name) == ("apps", "deployments")
    assert settings.posting.level >= 30  # WARNING: kopf's INFO lines stay in the log only
    peered = operator_main.operator_settings(
        operator_main.parse_args(["--peering", "tandem", "--peering-lifetime", "9"])
    )
    assert (peered.peering.lifetime, peered.peering.mandatory) == (9, True)


NOW = datetime.datetime(2026, 12, 1, 2, 0, tzinfo=datetime.UTC)


def peer(priority: int, seen_s_ago: float, lifetime: int = 15) -> dict[str, Any]:
    lastseen = (NOW - datetime.timedelta(seconds=seen_s_ago)).isoformat()
    return {"priority": priority, "lifetime": lifetime, "lastseen": lastseen}


@pytest.mark.parametrize(
    ("others", "active"),
    [
        ({}, True),
        ({"b": peer(5, 1)}, True),  # a lower priority waits
        ({"b": peer(20, 1)}, False),  # a higher one leads
        ({"b": peer(10, 1)}, False),  # kopf pauses both on a tie
        ({"b": peer(20, 16)}, True),  # a killed leader stops counting after its lifetime
    ],
)
def test_is_active_follows_kopfs_rule(others: dict[str, Any], active: bool) -> None:
    peers = {"a": peer(10, 1), **others}
    assert is_active(peers, "a", 10, NOW) is active


def test_not_active_before_the_own_keepalive() -> None:
    assert not is_active({}, "a", 10, NOW)
    assert not is_active({"a": peer(10, 30)}, "a", 10, NOW)


def test_leadership_paths_and_priorities() -> None:
    assert peering_paths("t", []) == ["/apis/kopf.dev/v1/clusterkopfpeerings/t"]
    assert peering_paths("t", ["x"]) == ["/apis/kopf.dev/v1/namespaces/x/kopfpeerings/t"]
    assert replica_priority(7) == 7
    assert len({replica_priority(None) for _ in range(20)}) == 20
    assert Leadership("a", 1).active  # standalone
    assert not Leadership("a", 1, ["/p"]).active  # a peer is a standby until it reads the peering


def test_only_the_active_replica_autoscales(monkeypatch: pytest.MonkeyPatch) -> None:
    """The autoscaler's loop is ours, not kopf's: a standby replica skips every evaluation."""
    from tandem.operator.autoscaling import handlers as autoscaling

    evaluated: list[bool] = []
    turns = iter([False, False, True, True, False, True])
    leading_now = {"value": False}

    def leading() -> bool:
        leading_now["value"] = next(turns)
        return leading_now["value"]

    async def evaluate(*_: Any) -> None:
        evaluated.append(leading_now["value"])

    real_sleep = asyncio.sleep

    async def no_wait(_: float) -> None:
        await real_sleep(0)

    monkeypatch.setattr(autoscaling, "evaluate", evaluate)
    monkeypatch.setattr(autoscaling.asyncio, "sleep", no_wait)
    body = minimal(autoscaling={"enabled": True})

    async def scenario() -> None:
        task = asyncio.get_running_loop().create_task(
            autoscaling.autoscale(None, lambda: body, logging.getLogger("t"), leading)  # type: ignore[arg-type]
        )
        with contextlib.suppress(StopIteration, RuntimeError):
            await task

    asyncio.run(scenario())
    assert evaluated == [True, True, True]  # the three turns it led, never a standby's


def test_with_the_watch_cache_a_refresh_that_changes_nothing_sends_nothing() -> None:
    kube, events, caches = CountingKube(), Events(), Caches()
    body = kube.add_cluster(minimal())
    caches.clusters.put(body)  # as the ServingCluster watch would
    reconcile_body(kube, body, events, caches=caches)  # type: ignore[arg-type]
    mark_ready(kube)
    for key, obj in kube.objects.items():
        if key.kind == "Deployment":
            caches.deployments.put({**obj, "metadata": {**obj["metadata"], "resourceVersion": "9"}})
    kube.calls.clear()
    assert refresh(kube, "ns", "m", events, caches=caches) == "Ready"  # type: ignore[arg-type]
    assert kube.calls == ["patch_status"]  # Pending -> Ready; read from the caches
    # the patch's reply is cached, so the next refresh compares with it and sends nothing
    assert refresh(kube, "ns", "m", events, caches=caches) == "Ready"  # type: ignore[arg-type]
    assert kube.calls == ["patch_status"]
    assert events.reasons().count("Ready") == 1
    # a Deployment the cache has not seen yet: one LIST instead
    caches.deployments.drop("ns", "m-decode")
    kube.calls.clear()
    refresh(kube, "ns", "m", events, caches=caches)  # type: ignore[arg-type]
    assert kube.calls == ["list"]


def test_the_cache_keeps_the_newest_body() -> None:
    cache = ObjectCache()

    def body(version: str, phase: str) -> dict[str, Any]:
        meta = {"namespace": "ns", "name": "m", "resourceVersion": version, "labels": {"a": "1"}}
        return {"metadata": meta, "status": {"phase": phase}}

    cache.put(body("10", "Ready"))
    cache.put(body("9", "Pending"))  # a watch event older than our own write's reply
    assert cache.get("ns", "m")["status"]["phase"] == "Ready"  # type: ignore[index]
    cache.put(body("11", "Degraded"))
    assert cache.get("ns", "m")["status"]["phase"] == "Degraded"  # type: ignore[index]
    assert cache.labelled("ns", {"a": "1"})
    assert not cache.labelled("ns", {"a": "2"})
    cache.drop("ns", "m")
    assert cache.get("ns", "m") is None


class MeetingKube(FakeKube):
    """Applies wait until `meet` ServingClusters are being applied at once (bounded generously,
    for a loaded machine), so a resync that runs that many together is seen to, however its
    threads are scheduled; notes the most being applied at once."""

    def __init__(self, meet: int) -> None:
        super().__init__()
        self.meet = meet
        self.met = threading.Event()
        self.applying: dict[str, int] = {}
        self.most_at_once = 0

    def apply(self, obj: dict[str, Any], force: bool = True) -> dict[str, Any]:
        owner = obj["metadata"]["labels"]["tandem.dev/cluster"]
        with self.guard:
            self.applying[owner] = self.applying.get(owner, 0) + 1
            self.most_at_once = max(self.most_at_once, len(self.applying))
            if len(self.applying) >= self.meet:
                self.met.set()
        if not self.met.wait(30):
            self.met.set()  # they never met: the rest go on, and most_at_once says so
        with self.guard:
            self.applying[owner] -= 1
            if not self.applying[owner]:
                del self.applying[owner]
            return super().apply(obj, force)


def add_clusters(kube: FakeKube, count: int) -> None:
    for i in range(count):
        body = minimal()
        body["metadata"] = {"name": f"c{i}", "namespace": "ns"}
        added = kube.add_cluster(body)
        added["metadata"]["uid"] = f"uid-c{i}"


@pytest.mark.parametrize("concurrency", [1, 4])
def test_resync_reconciles_a_bounded_number_of_clusters_at_once(concurrency: int) -> None:
    kube, events = MeetingKube(meet=concurrency), Events()
    add_clusters(kube, 12)
    assert resync_once(kube, ["ns"], events, concurrency=concurrency) == 12  # type: ignore[arg-type]
    assert kube.most_at_once == concurrency
    deployments = {k.name for k in kube.objects if k.kind == "Deployment"}
    assert deployments == {
        f"c{i}-{role}" for i in range(12) for role in ("prefill", "decode", "router")
    }


def test_one_failing_cluster_does_not_stop_a_concurrent_resync() -> None:
    kube, events = FakeKube(), Events()
    add_clusters(kube, 6)
    broken = kube.get("tandem.dev/v1alpha1", "ServingCluster", "ns", "c3")
    assert broken is not None
    broken["spec"]["router"] = {"replicas": -1}  # accepted by no schema: a PermanentError
    kube.objects[next(k for k in kube.objects if k.name == "c3")] = broken
    assert resync_once(kube, ["ns"], events, concurrency=3) == 5  # type: ignore[arg-type]
    assert "InvalidSpec" in events.reasons()


def test_a_refresh_during_a_reconcile_is_asked_again_instead_of_reporting_half_applied() -> None:
    kube, events, caches = CountingKube(), Events(), Caches()
    caches.clusters.put(kube.add_cluster(minimal()))
    lock = status_lock("ns", "m")
    holding, release = threading.Event(), threading.Event()

    def reconciling() -> None:  # what reconcile_body does for its whole run
        with lock:
            holding.set()
            release.wait(5)

    thread = threading.Thread(target=reconciling)
    thread.start()
    holding.wait(5)
    try:
        with pytest.raises(ReconcileInProgress):
            refresh(kube, "ns", "m", events, caches=caches, wait=False)  # type: ignore[arg-type]
        assert kube.calls == []  # nothing read, nothing patched
    finally:
        release.set()
        thread.join()
    refresh(kube, "ns", "m", events, caches=caches, wait=False)  # type: ignore[arg-type]
    assert kube.calls == ["list", "patch_status"]  # no Deployment yet: one LIST, then Pending


def test_the_coalescer_asks_again_after_a_reconcile_in_progress() -> None:
    runs: list[bool] = []

    def refresh_once_busy(namespace: str, name: str, reapply: bool) -> None:
        runs.append(reapply)
        if len(runs) == 1:
            raise ReconcileInProgress(f"{namespace}/{name}")

    async def scenario() -> None:
        refresher = CoalescedRefresh(refresh_once_busy, delay_s=0.02)
        refresher.request("ns", "a", reapply=True)
        await drained(refresher)
        await refresher.stop()

    asyncio.run(scenario())
    assert runs == [True, True]  # the deletion's reapply is kept for the second try


class VersionedKube(FakeKube):
    """FakeKube whose apply replies carry a resourceVersion, as the API server's do."""

    def apply(self, obj: dict[str, Any], force: bool = True) -> dict[str, Any]:
        stored = super().apply(obj, force)
        stored["metadata"]["resourceVersion"] = "5"
        return stored


def test_a_reconcile_reports_the_newest_deployment_the_watch_delivered() -> None:
    """A Deployment status change that the watch delivered while the reconcile ran (its refresh
    was asked again, not run) is in the reconcile's own report."""
    kube, events, caches = VersionedKube(), Events(), Caches()
    caches.clusters.put(kube.add_cluster(minimal()))
    reconcile_body(kube, kube.cluster(), events, caches=caches)  # type: ignore[arg-type]
    mark_ready(kube)
    for key, obj in kube.objects.items():
        if key.kind == "Deployment":
            newer = copy.deepcopy(obj)
            newer["metadata"]["resourceVersion"] = "99"
            caches.deployments.put(newer)
            del obj["status"]  # the apply replies still say nothing is ready
    body = kube.cluster()
    body["metadata"]["generation"] = 2
    assert reconcile_body(kube, body, events, caches=caches) == "Ready"  # type: ignore[arg-type]


def test_a_later_reconcile_applies_its_own_children_without_reading_them() -> None:
    """The uids of the first reconcile's applies are the preconditions of the next one's."""
    kube, events, caches = CountingKube(), Events(), Caches()
    caches.clusters.put(kube.add_cluster(minimal()))
    reconcile_body(kube, kube.cluster(), events, caches=caches)  # type: ignore[arg-type]
    applies = kube.calls.count("apply")
    body = kube.cluster()
    body["metadata"]["generation"] = 2
    kube.calls.clear()
    reconcile_body(kube, body, events, caches=caches)  # type: ignore[arg-type]
    assert kube.calls.count("get") == 0
    assert kube.calls.count("apply") == applies


def test_a_child_re_created_by_someone_else_is_read_and_left_alone() -> None:
    """The uid precondition fails on the new object (422), the read finds a stranger's object,
    and the reconcile reports the conflict instead of applying over it."""
    kube, events, caches = CountingKube(), Events(), Caches()
    caches.clusters.put(kube.add_cluster(minimal()))
    reconcile_body(kube, kube.cluster(), events, caches=caches)  # type: ignore[arg-type]
    key = next(k for k in kube.objects if k.kind == "Service" and k.name == "m-router")
    stranger = {"apiVersion": "v1", "kind": "Service",
                "metadata": {"name": "m-router", "namespace": "ns", "uid": "someone-else"},
                "spec": {"ports": [{"port": 1}]}}  # fmt: skip
    kube.objects[key] = stranger
    del kube.objects[next(k for k in kube.objects if k.kind == "ConfigMap")]  # simply deleted
    body = kube.cluster()
    body["metadata"]["generation"] = 2
    kube.calls.clear()
    assert reconcile_body(kube, body, events, caches=caches) == "Degraded"  # type: ignore[arg-type]
    assert kube.objects[key] == stranger
    assert kube.calls.count("get") == 2  # the stranger and the deleted one (no other child)
    assert ("ConfigMap", "m-router") in kube.kinds()  # re-created
    assert "Conflict" in events.reasons()
