"""Secure by default, proven on the real control plane with the chart's operator.

- PodSecurity: the API server's built-in admission enforcing "restricted" on the operator's
  namespace and on a ServingCluster's namespace admits every pod; a root override is refused
  there and admitted under "baseline".
- Auth: a client key from a Secret is needed at the router; the engines demand the generated key.
- SubjectAccessReview (`kubectl auth can-i` as the chart's ServiceAccount) in cluster mode and in
  namespaced mode: what the operator must never be able to do.
- Deleting an autoscaled ServingCluster with the operator stopped.
- A hand-made object of a rendered name is a conflict, not taken over; a missing Secret and PVC
  are a Degraded condition naming them.
The tests share the chart's release and run in order.
"""

from __future__ import annotations

import copy
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client as k8s

from e2e.conftest import CHART, OPERATOR_NAMESPACE, RELEASE, wait_for_operator
from e2e.harness.kube import eventually, gone
from e2e.harness.podrunner import PodRunner, RunningPod
from e2e.harness.tools import Clients

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

GROUP, VERSION, PLURAL = "tandem.dev", "v1alpha1", "servingclusters"
RESTRICTED, BASELINE, TEAM = "sec-restricted", "sec-baseline", "sec-team"
TEAM_RELEASE = "tandem-team"  # a second install of the chart, in namespaced mode
OPERATOR_SA = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{RELEASE}"
TEAM_SA = f"system:serviceaccount:{TEAM_RELEASE}:{TEAM_RELEASE}"
CLIENT_KEY = "e2e-client-key"


def manifest(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    """A small ServingCluster: one decode pod behind one router unless `spec` says otherwise."""
    body: dict[str, Any] = {
        "model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "servedName": "llama-8b"},
        "decode": {"replicas": 1, "resources": {"limits": {"nvidia.com/gpu": 1}}},
        "router": {"replicas": 1, "disaggregation": {"mode": "never"}},
        "monitoring": {"enabled": False},
    }
    for key, value in spec.items():
        body[key] = {**body.get(key, {}), **value} if isinstance(value, dict) else value
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ServingCluster",
        "metadata": {"name": name, "namespace": namespace},
        "spec": body,
    }


class Api:
    def __init__(self, api: k8s.ApiClient) -> None:
        self.core = k8s.CoreV1Api(api)
        self.apps = k8s.AppsV1Api(api)
        self.custom = k8s.CustomObjectsApi(api)

    def create(self, body: dict[str, Any]) -> None:
        meta = body["metadata"]
        self.custom.create_namespaced_custom_object(
            GROUP, VERSION, meta["namespace"], PLURAL, copy.deepcopy(body)
        )

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        result: dict[str, Any] = self.custom.get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name
        )
        return result

    def delete(self, namespace: str, name: str) -> None:
        try:
            self.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except k8s.ApiException as error:
            if error.status != 404:
                raise

    def condition(self, namespace: str, name: str, kind: str) -> dict[str, Any] | None:
        conditions = (self.get(namespace, name).get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == kind), None)

    def events(self, namespace: str, name: str) -> list[str]:
        listing = self.core.list_namespaced_event(
            namespace, field_selector=f"involvedObject.name={name}"
        )
        return [event.reason for event in listing.items]

    def namespace(self, name: str, level: str | None = None) -> None:
        labels = {}
        if level:
            labels = {f"pod-security.kubernetes.io/{mode}": level for mode in ("enforce", "warn")}
        body = k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=name, labels=labels))
        try:
            self.core.create_namespace(body)
        except k8s.ApiException as error:
            if error.status != 409:
                raise


@pytest.fixture(scope="module")
def kube(tandem_release: RunningPod, api: k8s.ApiClient) -> Iterator[Api]:
    kube = Api(api)
    kube.namespace(RESTRICTED, "restricted")
    kube.namespace(BASELINE, "baseline")
    kube.namespace(TEAM)
    yield kube
    for namespace in (RESTRICTED, BASELINE, TEAM):
        for item in kube.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)[
            "items"
        ]:
            kube.delete(namespace, item["metadata"]["name"])


def degraded_with(kube: Api, namespace: str, name: str, reason: str) -> dict[str, Any] | None:
    condition = kube.condition(namespace, name, "Degraded")
    if condition and condition["status"] == "True" and condition["reason"] == reason:
        return condition
    return None


def post_chat(url: str, key: str | None) -> int:
    body = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(
        url + "/v1/chat/completions", json.dumps(body).encode(), headers, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except OSError:
        return 0


def live(pod_runner: PodRunner, role: str, namespace: str) -> list[RunningPod]:
    return [p for p in pod_runner.by_role(role, namespace) if p.child.alive()]


# --- PodSecurity ----------------------------------------------------------------------------------


def test_operator_namespace_enforces_restricted_and_the_operator_is_admitted(
    kube: Api, clients: Clients, pod_runner: PodRunner
) -> None:
    labels = [f"pod-security.kubernetes.io/{m}=restricted" for m in ("enforce", "warn")]
    # A server-side dry run names every running pod that the new level would refuse.
    dry = clients.kubectl(
        "label", "namespace", OPERATOR_NAMESPACE, *labels, "--overwrite", "--dry-run=server"
    )
    assert "violate" not in dry.stderr, dry.stderr
    clients.kubectl("label", "namespace", OPERATOR_NAMESPACE, *labels, "--overwrite")
    [operator] = live(pod_runner, "operator", OPERATOR_NAMESPACE)
    kube.core.delete_namespaced_pod(operator.name, OPERATOR_NAMESPACE)
    restarted = wait_for_operator(pod_runner, not_named=operator.name)  # admitted anew
    pod = kube.core.read_namespaced_pod(restarted.name, OPERATOR_NAMESPACE)
    assert pod.spec.security_context.run_as_non_root is True


def test_restricted_namespace_admits_router_and_engines_and_auth_holds(
    kube: Api, clients: Clients, pod_runner: PodRunner
) -> None:
    clients.kubectl(
        "-n", RESTRICTED, "create", "secret", "generic", "clients",
        f"--from-literal=api-keys={CLIENT_KEY}",
    )  # fmt: skip
    body = manifest(
        "secure",
        RESTRICTED,
        router={"auth": {"clientKeysSecret": {"name": "clients"}}},
    )
    body["spec"]["router"]["disaggregation"] = {"mode": "always"}
    body["spec"]["prefill"] = {"replicas": 1, "resources": {"limits": {"nvidia.com/gpu": 1}}}
    kube.create(body)
    eventually(
        lambda: (kube.get(RESTRICTED, "secure").get("status") or {}).get("phase") == "Ready",
        timeout_s=120,
        what="the ServingCluster Ready in a namespace enforcing restricted",
        details=lambda: json.dumps(kube.get(RESTRICTED, "secure").get("status"), indent=1),
    )
    for role in ("router", "prefill", "decode"):
        deployment = kube.apps.read_namespaced_deployment(f"secure-{role}", RESTRICTED)
        failures = [c for c in deployment.status.conditions or [] if c.type == "ReplicaFailure"]
        assert not failures, (role, failures)
    secret = kube.core.read_namespaced_secret("secure-engine-key", RESTRICTED)
    assert secret.metadata.owner_references[0].kind == "ServingCluster"
    assert len(secret.data["api-key"]) >= 40
    # Clients need a key at the router; the engines need the engine key the router sends.
    [router] = eventually(
        lambda: live(pod_runner, "router", RESTRICTED), timeout_s=60, what="the router process"
    )
    url = f"http://{router.ip}:8000"
    assert eventually(
        lambda: post_chat(url, CLIENT_KEY) == 200 or None,
        timeout_s=60,
        interval_s=0.5,
        what="a chat completion with the client key",
        details=pod_runner.report,
    )
    assert post_chat(url, None) == 401
    assert post_chat(url, "wrong") == 401
    for role in ("prefill", "decode"):
        [engine] = live(pod_runner, role, RESTRICTED)
        assert post_chat(f"http://{engine.ip}:8000", None) == 401, role


def test_a_root_engine_is_refused_under_restricted_and_admitted_under_baseline(
    kube: Api,
) -> None:
    root = {"podSecurityContext": {"runAsNonRoot": False, "runAsUser": 0}}
    for namespace in (RESTRICTED, BASELINE):
        body = manifest("rooted", namespace, decode=root, router={"replicas": 0})
        kube.create(body)
    refused = eventually(
        lambda: degraded_with(kube, RESTRICTED, "rooted", "RolloutFailed"),
        timeout_s=90,
        what="the root pool refused by PodSecurity and reported Degraded",
        details=lambda: json.dumps(kube.get(RESTRICTED, "rooted").get("status"), indent=1),
    )
    assert "violates PodSecurity" in refused["message"], refused
    assert "restricted" in refused["message"], refused
    eventually(
        lambda: (
            kube.apps.read_namespaced_deployment("rooted-decode", BASELINE).status.ready_replicas
            == 1
        ),
        timeout_s=90,
        what="the root pool admitted under baseline",
    )
    for namespace in (RESTRICTED, BASELINE):
        kube.delete(namespace, "rooted")


# --- conflicts and missing dependencies ---------------------------------------------------------


def test_a_hand_made_object_is_a_conflict_and_left_alone(kube: Api) -> None:
    mine = k8s.V1ConfigMap(
        metadata=k8s.V1ObjectMeta(name="squat-router", namespace=RESTRICTED, labels={"a": "b"}),
        data={"owner": "a person"},
    )
    kube.core.create_namespaced_config_map(RESTRICTED, mine)
    kube.create(manifest("squat", RESTRICTED, decode={"replicas": 0}, router={"replicas": 0}))
    condition = eventually(
        lambda: degraded_with(kube, RESTRICTED, "squat", "Conflict"),
        timeout_s=60,
        what="a Conflict condition",
    )
    assert "ConfigMap/squat-router" in condition["message"]
    after = kube.core.read_namespaced_config_map("squat-router", RESTRICTED)
    assert after.data == {"owner": "a person"}
    assert not after.metadata.owner_references
    assert after.metadata.labels == {"a": "b"}
    assert "Conflict" in eventually(
        lambda: kube.events(RESTRICTED, "squat"), timeout_s=30, what="Events"
    )
    assert kube.apps.read_namespaced_deployment("squat-decode", RESTRICTED)  # the rest applied
    kube.delete(RESTRICTED, "squat")
    assert kube.core.read_namespaced_config_map("squat-router", RESTRICTED)  # never pruned


def test_a_missing_secret_and_pvc_are_degraded_naming_them(kube: Api) -> None:
    body = manifest(
        "needy",
        RESTRICTED,
        model={"hfTokenSecret": {"name": "no-such-token"}, "cache": {"pvc": "no-such-pvc"}},
        decode={"replicas": 0},
        router={"replicas": 0},
    )
    kube.create(body)
    condition = eventually(
        lambda: degraded_with(kube, RESTRICTED, "needy", "DependencyMissing"),
        timeout_s=60,
        what="a DependencyMissing condition",
    )
    assert (
        f"Secret {RESTRICTED}/no-such-token (model.hfTokenSecret) not found" in condition["message"]
    )
    assert (
        f"PersistentVolumeClaim {RESTRICTED}/no-such-pvc (model.cache) not found"
        in condition["message"]
    )
    assert kube.get(RESTRICTED, "needy")["status"]["phase"] == "Degraded"
    assert "DependencyMissing" in eventually(
        lambda: kube.events(RESTRICTED, "needy"), timeout_s=30, what="Events"
    )
    kube.delete(RESTRICTED, "needy")


# --- RBAC: SubjectAccessReview ------------------------------------------------------------------

NEVER = [
    ("get", "secrets"), ("list", "secrets"), ("watch", "secrets"), ("patch", "secrets"),
    ("create", "pods"), ("create", "pods/exec"), ("create", "pods/attach"),
    ("create", "pods/portforward"), ("get", "nodes"), ("escalate", "roles"), ("bind", "roles"),
    ("impersonate", "serviceaccounts"), ("create", "serviceaccounts/token"),
    ("delete", "persistentvolumeclaims"), ("delete", "secrets"),
]  # fmt: skip


def can(clients: Clients, subject: str, verb: str, resource: str, namespace: str) -> bool:
    """The API server's own answer (SubjectAccessReview through impersonation). `pods/exec` is a
    subresource (kubectl would read "pods/exec" as the pod named exec)."""
    kind, _, subresource = resource.partition("/")
    extra = [f"--subresource={subresource}"] if subresource else []
    result = clients.kubectl(
        "auth", "can-i", verb, kind, *extra, "-n", namespace, f"--as={subject}", check=False
    )
    assert result.stdout.strip() in ("yes", "no"), result.stdout + result.stderr
    return result.stdout.strip() == "yes"


def test_cluster_mode_operator_cannot_read_secrets_exec_or_escalate(clients: Clients) -> None:
    for namespace in (RESTRICTED, OPERATOR_NAMESPACE, "kube-system"):
        for verb, resource in NEVER:
            assert not can(clients, OPERATOR_SA, verb, resource, namespace), (verb, resource)
    assert can(clients, OPERATOR_SA, "create", "secrets", RESTRICTED)  # the engine key only
    assert can(clients, OPERATOR_SA, "patch", "deployments", RESTRICTED)
    assert not can(clients, OPERATOR_SA, "create", "horizontalpodautoscalers", RESTRICTED)


# --- deletion with the operator stopped -----------------------------------------------------------


def scale_operator(clients: Clients, pod_runner: PodRunner, replicas: int) -> None:
    clients.kubectl(
        "-n", OPERATOR_NAMESPACE, "scale", "deployment", RELEASE, f"--replicas={replicas}"
    )
    if replicas == 0:
        eventually(
            lambda: not live(pod_runner, "operator", OPERATOR_NAMESPACE),
            timeout_s=60,
            what="the operator to stop",
        )
    else:
        wait_for_operator(pod_runner)


def test_deleting_an_autoscaled_cluster_needs_no_operator(
    kube: Api, clients: Clients, pod_runner: PodRunner
) -> None:
    body = manifest(
        "scaled",
        BASELINE,
        router={"replicas": 0},
        autoscaling={"enabled": True, "intervalSeconds": 1, "prometheusURL": "http://127.0.0.1:9",
                     "decode": {"min": 1, "max": 2}},
    )  # fmt: skip
    kube.create(body)
    eventually(  # the autoscaler's loop runs for this object
        lambda: kube.condition(BASELINE, "scaled", "MetricsUnavailable"),
        timeout_s=60,
        what="the autoscaler to evaluate",
    )
    assert not kube.get(BASELINE, "scaled")["metadata"].get("finalizers")
    scale_operator(clients, pod_runner, 0)
    try:
        clients.kubectl("-n", BASELINE, "delete", PLURAL, "scaled", "--timeout=30s")
        assert gone(lambda: kube.get(BASELINE, "scaled"))
        eventually(
            lambda: gone(lambda: kube.apps.read_namespaced_deployment("scaled-decode", BASELINE)),
            timeout_s=60,
            what="the children garbage-collected without the operator",
        )
    finally:
        scale_operator(clients, pod_runner, 1)


# --- namespaced mode ------------------------------------------------------------------------------


def team_operator(pod_runner: PodRunner) -> RunningPod | None:
    running = live(pod_runner, "operator", TEAM_RELEASE)
    return running[0] if running else None


def test_namespaced_mode_runs_and_cannot_touch_other_namespaces(
    kube: Api, clients: Clients, pod_runner: PodRunner
) -> None:
    """The cluster-mode operator is stopped meanwhile, so only the namespaced one serves TEAM."""
    scale_operator(clients, pod_runner, 0)
    try:
        clients.helm(
            "install", TEAM_RELEASE, str(CHART), "--namespace", TEAM_RELEASE, "--create-namespace",
            "--skip-crds", "--set", f"operator.watchNamespaces={{{TEAM}}}", "--wait", "--timeout", "2m",
        )  # fmt: skip
        operator = eventually(
            lambda: team_operator(pod_runner), timeout_s=60, what="the namespaced operator"
        )
        kube.create(manifest("team", TEAM, decode={"replicas": 0}, router={"replicas": 0}))
        eventually(
            lambda: (kube.get(TEAM, "team").get("status") or {}).get("observedGeneration") == 1,
            timeout_s=60,
            what="the namespaced operator to reconcile",
            details=lambda: pod_runner.logs(operator.name),
        )
        assert kube.apps.read_namespaced_deployment("team-decode", TEAM)
        log = operator.child.log.read_text(errors="replace").lower()
        assert "forbidden" not in log, pod_runner.logs(operator.name)
        assert can(clients, TEAM_SA, "patch", "deployments", TEAM)
        for namespace in (RESTRICTED, "default", OPERATOR_NAMESPACE):
            for verb, resource in [("create", "deployments"), ("list", "servingclusters"),
                                   ("patch", "servingclusters"), ("create", "secrets"),
                                   ("list", "pods"), ("create", "events")]:  # fmt: skip
                assert not can(clients, TEAM_SA, verb, resource, namespace), (namespace, verb)
        for verb, resource in NEVER:
            assert not can(clients, TEAM_SA, verb, resource, TEAM), (verb, resource)
        for verb, resource in [("list", "namespaces"), ("list", "clusterroles"), ("get", "nodes")]:
            assert not can(clients, TEAM_SA, verb, resource, "default"), (verb, resource)
        kube.delete(TEAM, "team")
    finally:
        clients.helm("uninstall", TEAM_RELEASE, "--namespace", TEAM_RELEASE, "--wait", check=False)
        scale_operator(clients, pod_runner, 1)


def test_the_operator_never_lacked_a_permission_here(pod_runner: PodRunner) -> None:
    for operator in [p for p in pod_runner.history if p.role == "operator"]:
        refused = [
            line
            for line in operator.child.log.read_text(errors="replace").splitlines()
            if "forbidden" in line.lower() and "being terminated" not in line
        ]
        assert not refused, "\n".join(refused[:5])
