"""Handler logic: apply with owner references, idempotent re-runs, pruning, status and events.

The API server is replaced here by an in-memory store with server-side-apply semantics for
whole objects (FakeKube); the real kube-apiserver runs these same handlers in the e2e suite.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import kopf
import pytest
from sc_manifests import cluster, minimal

from tandem.operator import main as operator_main
from tandem.operator.child_apply import WORKLOAD_KINDS, apply_waves
from tandem.operator.kinds import CHILD_KINDS
from tandem.operator.kube import FIELD_MANAGER, KubeError, NotFound
from tandem.operator.reconcile import reconcile_body, retry_delay_s
from tandem.operator.reconcile_plan import ObjectKey, children_selector, stale_children
from tandem.operator.refresh import refresh_owner_status
from tandem.operator.render import render
from tandem.operator.resync import resync_once

UID = "0b8e2f1c-1111-2222-3333-444455556666"


class FakeKube:
    """An in-memory API server: objects by (apiVersion, kind, namespace, name). Each call holds
    one lock, so several reconciling threads (a concurrent resync) can share it."""

    def __init__(self, monitoring: bool = True) -> None:
        self.guard = threading.RLock()
        self.objects: dict[ObjectKey, dict[str, Any]] = {}
        self.monitoring = monitoring
        self.applies: list[ObjectKey] = []
        self.deletes: list[ObjectKey] = []
        self.fail_apply: str | None = None

    def apply(self, obj: dict[str, Any], force: bool = True) -> dict[str, Any]:
        with self.guard:
            if self.fail_apply and obj["kind"] == self.fail_apply:
                raise KubeError(403, "Forbidden", f"{obj['kind']} is forbidden for {FIELD_MANAGER}")
            key = ObjectKey.of(obj)
            if obj["kind"] == "RoleBinding":  # the escalation check reads the bound Role
                role = obj["roleRef"]["name"]
                if ObjectKey(key.api_version, "Role", key.namespace, role) not in self.objects:
                    raise KubeError(
                        404, "NotFound", f'roles.rbac.authorization.k8s.io "{role}" not found'
                    )
            old = self.objects.get(key)
            pinned = obj["metadata"].get("uid")  # the API server's uid precondition
            if pinned is not None and old is None:
                raise KubeError(409, "Conflict", f"uid mismatch: {pinned}, no existing object")
            if pinned is not None and pinned != old["metadata"].get("uid"):  # type: ignore[index]
                raise KubeError(422, "Invalid", "metadata.uid: field is immutable")
            self.applies.append(key)
            stored = copy.deepcopy(obj)
            if old and "status" in old:
                stored["status"] = old["status"]
            stored["metadata"]["uid"] = (
                (old or {}).get("metadata", {}).get("uid", f"uid-{key.kind}-{key.name}")
            )
            stored["metadata"].setdefault("generation", 1)
            self.objects[key] = stored
            return stored

    def create(self, obj: dict[str, Any], dry_run: bool = False) -> dict[str, Any] | None:
        with self.guard:
            key = ObjectKey.of(obj)
            if key in self.objects:
                return None
            stored = copy.deepcopy(obj)
            stored["metadata"]["uid"] = f"uid-{key.kind}-{key.name}"
            if not dry_run:
                self.objects[key] = stored
            return stored

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        with self.guard:
            found = self.objects.get(ObjectKey(api_version, kind, namespace, name))
            return copy.deepcopy(found) if found else None

    def list(
        self, api_version: str, kind: str, namespace: str, selector: str
    ) -> list[dict[str, Any]]:
        with self.guard:
            wanted = dict(term.split("=") for term in selector.split(","))
            return [
                copy.deepcopy(obj)
                for key, obj in self.objects.items()
                if (key.api_version, key.kind, key.namespace) == (api_version, kind, namespace)
                and wanted.items() <= obj["metadata"].get("labels", {}).items()
            ]

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        with self.guard:
            key = ObjectKey(api_version, kind, namespace, name)
            self.deletes.append(key)
            self.objects.pop(key, None)

    def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any]:
        with self.guard:
            key = ObjectKey(api_version, kind, namespace, name)
            if key not in self.objects:
                raise NotFound(404, "NotFound", name)
            self.objects[key]["status"] = {**self.objects[key].get("status", {}), **status}
            return copy.deepcopy(self.objects[key])

    def request(self, method: str, path: str) -> dict[str, Any]:
        with self.guard:
            assert method == "GET"
            parts = path.strip("/").split(
                "/"
            )  # apis/tandem.dev/v1alpha1[/namespaces/NS]/servingclusters
            namespace = parts[4] if "namespaces" in parts else None
            items = [
                copy.deepcopy(obj)
                for key, obj in self.objects.items()
                if key.kind == "ServingCluster" and namespace in (None, key.namespace)
            ]
            return {"items": items}

    def serves(self, api_version: str, kind: str) -> bool:
        return self.monitoring or not api_version.startswith("monitoring.coreos.com/")

    # helpers of the tests
    def add_cluster(self, document: dict[str, Any]) -> dict[str, Any]:
        body = copy.deepcopy(document)
        body["metadata"].update(uid=UID, generation=body["metadata"].get("generation", 1))
        self.objects[ObjectKey.of(body)] = body
        return body

    def cluster(self) -> dict[str, Any]:
        found = self.get("tandem.dev/v1alpha1", "ServingCluster", "ns", "m")
        assert found is not None
        return found

    def kinds(self) -> set[tuple[str, str]]:
        return {(k.kind, k.name) for k in self.objects if k.kind != "ServingCluster"}


class Events:
    def __init__(self) -> None:
        self.posted: list[tuple[str, str, str]] = []

    def __call__(self, body: Any, *, type: str, reason: str, message: str) -> None:
        self.posted.append((type, reason, message))

    def reasons(self) -> list[str]:
        return [reason for _, reason, _ in self.posted]


def run(kube: FakeKube, events: Events) -> str:
    return reconcile_body(kube, kube.cluster(), events)  # type: ignore[arg-type]


def mark_ready(kube: FakeKube) -> None:
    for key, obj in kube.objects.items():
        if key.kind == "Deployment":
            replicas = obj["spec"]["replicas"]
            obj["status"] = {
                "observedGeneration": 1, "replicas": replicas, "updatedReplicas": replicas,
                "readyReplicas": replicas, "availableReplicas": replicas,
                "conditions": [{"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"}],
            }  # fmt: skip


def test_create_applies_every_child_with_an_owner_reference() -> None:
    kube, events = FakeKube(), Events()
    kube.add_cluster(minimal())
    assert run(kube, events) == "Pending"
    assert ("Deployment", "m-prefill") in kube.kinds()
    assert ("PodMonitor", "m-engines") in kube.kinds()
    for key, obj in kube.objects.items():
        if key.kind == "ServingCluster":
            continue
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref == {
            "apiVersion": "tandem.dev/v1alpha1", "kind": "ServingCluster", "name": "m", "uid": UID,
            "controller": True, "blockOwnerDeletion": True,
        }  # fmt: skip
    status = kube.cluster()["status"]
    assert status["phase"] == "Pending"
    assert status["observedGeneration"] == 1
    assert status["endpoint"] == "http://m-router.ns:8000"
    assert events.reasons() == ["Applied", "Pending"]


def test_resume_is_idempotent_and_reports_ready() -> None:
    kube, events = FakeKube(), Events()
    kube.add_cluster(minimal())
    run(kube, events)
    before = copy.deepcopy({k: v for k, v in kube.objects.items() if k.kind != "ServingCluster"})
    mark_ready(kube)
    assert run(kube, events) == "Ready"  # a restart resumes: same objects, nothing duplicated
    after = {k: v for k, v in kube.objects.items() if k.kind != "ServingCluster"}
    assert set(before) == set(after)
    assert kube.deletes == []
    assert events.reasons() == ["Applied", "Pending", "Ready"]
    assert run(kube, events) == "Ready"
    assert events.reasons() == ["Applied", "Pending", "Ready"]  # no event without a change


def test_spec_changes_update_and_prune_children() -> None:
    kube, events = FakeKube(), Events()
    body = kube.add_cluster(minimal(networkPolicy={"enabled": True}))
    run(kube, events)
    assert ("NetworkPolicy", "m-prefill") in kube.kinds()
    body["spec"] = {**body["spec"], "networkPolicy": {"enabled": False}, "decode": {"replicas": 4}}
    body["spec"]["router"] = {"disaggregation": {"mode": "never"}}
    body["metadata"]["generation"] = 2
    run(kube, events)
    kinds = kube.kinds()
    assert not [name for kind, name in kinds if kind == "NetworkPolicy"]
    assert ("Deployment", "m-prefill") not in kinds
    assert ("Service", "m-prefill") not in kinds
    assert kube.get("apps/v1", "Deployment", "ns", "m-decode")["spec"]["replicas"] == 4  # type: ignore[index]
    assert "Pruned" in events.reasons()
    assert kube.cluster()["status"]["observedGeneration"] == 2


def test_pvcs_secrets_and_foreign_objects_are_never_pruned() -> None:
    labels = {"tandem.dev/cluster": "m", "app.kubernetes.io/managed-by": "tandem-operator"}
    owned = {
        "ownerReferences": [{"uid": UID, "controller": True}],
        "labels": labels,
        "namespace": "ns",
    }
    existing = [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "models", **owned},
        },
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf", **owned}},
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "other", "labels": labels, "namespace": "ns"},
        },
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "stale", **owned}},
    ]
    assert stale_children([], existing, UID) == [ObjectKey("v1", "ConfigMap", "ns", "stale")]
    assert (
        children_selector("m")
        == "tandem.dev/cluster=m,app.kubernetes.io/managed-by=tandem-operator"
    )


def test_monitors_skipped_without_the_prometheus_operator() -> None:
    kube, events = FakeKube(monitoring=False), Events()
    kube.add_cluster(minimal())
    run(kube, events)
    assert not {kind for kind, _ in kube.kinds()} & {"ServiceMonitor", "PodMonitor"}


def test_invalid_spec_is_reported_not_retried() -> None:
    kube, events = FakeKube(), Events()
    kube.add_cluster(minimal(prefill={"replicas": -1}))
    with pytest.raises(kopf.PermanentError, match=r"spec\.prefill\.replicas"):
        run(kube, events)
    status = kube.cluster()["status"]
    assert status["phase"] == "Degraded"
    assert status["conditions"][0]["reason"] == "InvalidSpec"
    assert events.posted[0][:2] == ("Warning", "InvalidSpec")
    assert kube.kinds() == set()


def test_apply_failure_is_retried_and_reported() -> None:
    kube, events = FakeKube(), Events()
    kube.add_cluster(minimal())
    kube.fail_apply = "Role"
    with pytest.raises(kopf.TemporaryError, match="forbidden"):
        run(kube, events)
    status = kube.cluster()["status"]
    degraded = {c["type"]: c for c in status["conditions"]}["Degraded"]
    assert (status["phase"], degraded["reason"]) == ("Degraded", "ApplyFailed")
    assert ("Warning", "ApplyFailed") in [(t, r) for t, r, _ in events.posted]


def test_retries_back_off_from_one_second_to_thirty() -> None:
    assert [retry_delay_s(n) for n in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert retry_delay_s(10_000) == 30


def test_a_first_failure_is_retried_after_a_second() -> None:
    kube, events = FakeKube(), Events()
    kube.add_cluster(minimal())
    kube.fail_apply = "Service"
    with pytest.raises(kopf.TemporaryError) as first:
        run(kube, events)
    with pytest.raises(kopf.TemporaryError) as fourth:
        reconcile_body(kube, kube.cluster(), events, retry=3)  # type: ignore[arg-type]
    assert (first.value.delay, fourth.value.delay) == (1, 8)


def test_waves_apply_each_role_before_its_binding_and_workloads_last() -> None:
    objects = render(cluster())
    waves = apply_waves(objects)
    applied = [ObjectKey.of(o) for wave in waves for o in wave]
    assert sorted(map(str, applied)) == sorted(str(ObjectKey.of(o)) for o in objects)
    wave_of = {(o["kind"], o["metadata"]["name"]): n for n, wave in enumerate(waves) for o in wave}
    bindings = [o for o in objects if o["kind"] == "RoleBinding"]
    assert bindings
    for binding in bindings:
        role = ("Role", binding["roleRef"]["name"])
        assert wave_of[role] < wave_of[("RoleBinding", binding["metadata"]["name"])]
    assert {o["kind"] for o in waves[-1]} <= WORKLOAD_KINDS
    assert all(o["kind"] not in WORKLOAD_KINDS for wave in waves[:-1] for o in wave)


def test_child_change_refreshes_status_and_deletion_reapplies() -> None:
    kube, events = FakeKube(), Events()
    kube.add_cluster(minimal())
    run(kube, events)
    mark_ready(kube)
    assert refresh_owner_status(kube, "ns", "m", events) == "Ready"  # type: ignore[arg-type]
    kube.delete("apps/v1", "Deployment", "ns", "m-decode")
    refresh_owner_status(kube, "ns", "m", events, reapply=True)  # type: ignore[arg-type]
    assert ("Deployment", "m-decode") in kube.kinds()
    assert refresh_owner_status(kube, "ns", "gone", events) is None  # type: ignore[arg-type]


def test_operator_settings() -> None:
    args = operator_main.parse_args([])
    settings = operator_main.operator_settings(args)
    assert settings.persistence.finalizer == "tandem.dev/finalizer"
    assert settings.peering.standalone is True
    assert settings.watching.server_timeout == 300
    assert isinstance(settings.persistence.progress_storage, kopf.AnnotationsProgressStorage)
    assert isinstance(settings.persistence.diffbase_storage, kopf.AnnotationsDiffBaseStorage)
    peered = operator_main.operator_settings(
        operator_main.parse_args(["--peering", "tandem", "-n", "a", "-n", "b"])
    )
    assert (peered.peering.standalone, peered.peering.name) == (False, "tandem")
    assert operator_main.parse_args(["-n", "a", "-n", "b"]).namespace == ["a", "b"]
    # Exact namespaces (the chart's namespaced mode) never list the cluster's namespaces.
    assert peered.scanning.disabled is True
    assert settings.scanning.disabled is False
    patterns = operator_main.operator_settings(operator_main.parse_args(["-n", "team-*"]))
    assert patterns.scanning.disabled is False


def test_handlers_register_without_finalizer_needs() -> None:
    from tandem.operator.handlers import register

    registry = kopf.OperatorRegistry()
    register(registry, resync_seconds=60)
    changing = {h.id.split("/")[0] for h in registry._changing.get_all_handlers()}
    watching = {h.id for h in registry._watching.get_all_handlers()}
    activities = {h.id for h in registry._activities.get_all_handlers()}
    assert {"reconcile", "deleted"} <= changing
    assert "child_changed" in watching
    assert {"resync", "stop_resync"} <= activities
    # No timers or daemons of our own: those would put a finalizer on every object.
    assert list(registry._spawning.get_all_handlers()) == []
    assert not any(h.requires_finalizer for h in registry._changing.get_all_handlers())
    # The autoscaler too: a watch-event handler, no daemon, so deletion never waits for it.
    assert operator_main.load_autoscaling(registry) is True
    assert "autoscaler" in {h.id for h in registry._watching.get_all_handlers()}
    assert list(registry._spawning.get_all_handlers()) == []
    assert not any(h.requires_finalizer for h in registry._changing.get_all_handlers())


def test_resync_reconciles_every_cluster() -> None:
    kube, events = FakeKube(), Events()
    kube.add_cluster(minimal())
    other = minimal()
    other["metadata"] = {
        "name": "gone",
        "namespace": "ns",
        "deletionTimestamp": "2026-01-01T00:00:00Z",
    }
    kube.add_cluster(other)
    assert resync_once(kube, ["n*"], events) == 1  # type: ignore[arg-type]
    assert ("Deployment", "m-decode") in kube.kinds()
    assert resync_once(kube, ["other"], events) == 0  # type: ignore[arg-type]


@pytest.mark.parametrize("provider", ["hpa", "keda"])
def test_every_rendered_kind_is_a_child_kind_the_operator_can_prune(provider: str) -> None:
    sc = cluster(
        monitoring={"enabled": True},
        networkPolicy={"enabled": True},
        autoscaling={"enabled": True, "provider": provider},
    )
    rendered = {(obj["apiVersion"], obj["kind"]) for obj in render(sc)}
    assert rendered <= {(k.api_version, k.kind) for k in CHILD_KINDS}
