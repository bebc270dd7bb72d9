"""A ServingCluster's whole life on the real control plane, with the operator installed by Helm.

kubectl apply of the example → children with owner references → pods Running (KWOK) and served
by real engine and router processes → status Ready → a chat completion through the router via a
prefill and a decode pod → a spec update rolls → a replica change → an operator restart resumes
without duplicates → delete garbage-collects everything. The steps share one object, in order.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s

from e2e.conftest import OPERATOR_NAMESPACE, wait_for_operator
from e2e.harness.kube import eventually, gone
from e2e.harness.podrunner import PodRunner, RunningPod
from e2e.harness.podspec import expand
from e2e.harness.tools import Clients
from tandem.operator.common_render import ROUTER_ADMIN_PORT
from tandem.operator.kinds import CHILD_KINDS
from tandem.operator.kube import Kube

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "llama-8b-pd.yaml"
MANIFEST = yaml.safe_load(EXAMPLE.read_text())
NAME = MANIFEST["metadata"]["name"]
NAMESPACE = MANIFEST["metadata"]["namespace"]
MODEL = MANIFEST["spec"]["model"]["servedName"]
SELECTOR = f"tandem.dev/cluster={NAME}"
GROUP, VERSION, PLURAL = "tandem.dev", "v1alpha1", "servingclusters"
# A prompt long enough (in uncached tokens) for the router's auto mode to disaggregate it.
LONG_PROMPT = " ".join(
    f"fact {i}: the tandem router relays kv transfer params." for i in range(120)
)


class Cluster:
    """Reads of the one ServingCluster under test and everything it owns."""

    def __init__(self, api: k8s.ApiClient, pod_runner: PodRunner) -> None:
        self.api = api
        self.core = k8s.CoreV1Api(api)
        self.apps = k8s.AppsV1Api(api)
        self.custom = k8s.CustomObjectsApi(api)
        self.pod_runner = pod_runner

    def object(self) -> dict[str, Any]:
        result: dict[str, Any] = self.custom.get_namespaced_custom_object(
            GROUP, VERSION, NAMESPACE, PLURAL, NAME
        )
        return result

    def children(self) -> dict[str, list[dict[str, Any]]]:
        """Every child kind the operator renders, by kind, as the plain dicts the API sent (an
        empty list where this API server does not serve the kind, e.g. monitors without CRDs)."""
        kube = Kube(self.api.configuration)
        return {
            kind.kind: kube.list(kind.api_version, kind.kind, NAMESPACE, SELECTOR)
            for kind in CHILD_KINDS
        }

    def pods(self, role: str) -> list[k8s.V1Pod]:
        listing = self.core.list_namespaced_pod(
            NAMESPACE, label_selector=f"{SELECTOR},tandem.dev/role={role}"
        )
        return [pod for pod in listing.items if pod.metadata.deletion_timestamp is None]

    def deployment(self, role: str) -> k8s.V1Deployment:
        return self.apps.read_namespaced_deployment(f"{NAME}-{role}", NAMESPACE)

    def processes(self, role: str) -> list[RunningPod]:
        return [p for p in self.pod_runner.by_role(role, NAMESPACE) if p.child.alive()]

    def settled(self, prefill: int, decode: int, router: int = 1) -> dict[str, Any] | None:
        """The object once status says Ready with these counts for its current generation, every
        pod is Running on the current template and each has exactly one live, healthy process."""
        body = self.object()
        status = body.get("status") or {}
        wanted = {"prefill": prefill, "decode": decode, "router": router}
        if (
            status.get("phase") != "Ready"
            or status.get("observedGeneration") != body["metadata"]["generation"]
        ):
            return None
        for role, count in wanted.items():
            if status.get(role, {}).get("desired") != count or status[role].get("ready") != count:
                return None
            deployment = self.deployment(role)
            if (deployment.status.updated_replicas or 0) != count or (
                deployment.status.replicas or 0
            ) != count:
                return None
            pods = self.pods(role)
            if len(pods) != count or any(p.status.phase != "Running" for p in pods):
                return None
            processes = self.processes(role)
            if sorted(p.name for p in processes) != sorted(p.metadata.name for p in pods):
                return None
            # KWOK reports pods Ready at once; the process behind each must really answer.
            if not all(healthy(p.ip) for p in processes):
                return None
        return body

    def wait_serving(self) -> None:
        """Every pod of every role has a live process answering its health endpoint."""

        def serving() -> bool:
            for role in ("prefill", "decode", "router"):
                pods = {p.metadata.name for p in self.pods(role)}
                processes = self.processes(role)
                if not pods or pods != {p.name for p in processes}:
                    return False
                if not all(healthy(p.ip) for p in processes):
                    return False
            return True

        eventually(serving, timeout_s=90, what="every pod served", details=self.pod_runner.report)

    def wait_routable(self) -> None:
        """The router sees a healthy prefill and a healthy decode engine. Its discovery and
        health checks follow the pods by up to one check interval; until then it serves a long
        prompt locally on the decode pod, as it must with no prefill engine."""

        def routable() -> bool:
            [router] = self.processes("router")
            try:
                url = f"http://{router.ip}:{ROUTER_ADMIN_PORT}/engines"
                with urllib.request.urlopen(url, timeout=2) as response:
                    engines = json.load(response)
            except OSError:
                return False
            healthy = {role for engine in engines if engine["healthy"] for role in engine["roles"]}
            return {"prefill", "decode"} <= healthy

        eventually(routable, timeout_s=60, what="the router to see healthy prefill and decode",
                   details=self.pod_runner.report)  # fmt: skip

    def wait_settled(
        self, prefill: int, decode: int, router: int = 1, timeout_s: float = 120
    ) -> dict[str, Any]:
        return eventually(
            lambda: self.settled(prefill, decode, router),
            timeout_s=timeout_s,
            what=f"{NAME} Ready with prefill={prefill} decode={decode} router={router}",
            details=lambda: (
                f"status: {json.dumps(self.object().get('status'), indent=1)}\n{self.pod_runner.report()}"
            ),
        )

    def patch(self, spec: dict[str, Any]) -> int:
        body = self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, NAMESPACE, PLURAL, NAME, {"spec": spec}
        )
        return int(body["metadata"]["generation"])


def healthy(ip: str) -> bool:
    """The engine or router on this pod IP answers its health endpoint (the readiness probe)."""
    try:
        with urllib.request.urlopen(f"http://{ip}:8000/health", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def post_json(
    url: str, body: dict[str, Any], timeout_s: float = 30
) -> tuple[dict[str, Any], dict[str, str]]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read()), {k.lower(): v for k, v in response.headers.items()}


def metric_total(ip: str, name: str) -> float:
    """Sum of one metric's samples on an engine's /metrics."""
    with urllib.request.urlopen(f"http://{ip}:8000/metrics", timeout=5) as response:
        text = response.read().decode()
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", re.MULTILINE)
    return sum(float(value) for value in pattern.findall(text))


def router_url(cluster: Cluster) -> str:
    [router] = cluster.processes("router")
    return f"http://{router.ip}:8000"


def chat(
    cluster: Cluster, content: str, max_tokens: int = 8
) -> tuple[dict[str, Any], dict[str, str]]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
    }

    def attempt() -> tuple[dict[str, Any], dict[str, str]] | None:
        # The router discovers engines by watching Pods; right after a rollout it may not know
        # them yet and the engines may still be starting.
        try:
            return post_json(f"{router_url(cluster)}/v1/chat/completions", body)
        except OSError:
            return None

    return eventually(
        attempt,
        timeout_s=60,
        interval_s=0.5,
        what="a chat completion",
        details=cluster.pod_runner.report,
    )


@pytest.fixture(scope="module")
def cluster(
    tandem_release: RunningPod, clients: Clients, api: k8s.ApiClient, pod_runner: PodRunner
) -> Iterator[Cluster]:
    # The example expects its Hugging Face token Secret, as its header comment says.
    clients.kubectl(
        "-n", NAMESPACE, "create", "secret", "generic", "hf-token", "--from-literal=token=hf_e2e"
    )
    applied = clients.kubectl("apply", "-f", str(EXAMPLE))
    assert f"servingcluster.tandem.dev/{NAME} created" in applied.stdout, applied.stdout
    yield Cluster(api, pod_runner)
    clients.kubectl("delete", "-f", str(EXAMPLE), "--ignore-not-found", "--wait=false", check=False)
    clients.kubectl(
        "-n", NAMESPACE, "delete", "secret", "hf-token", "--ignore-not-found", check=False
    )


def test_every_child_exists_with_an_owner_reference(cluster: Cluster) -> None:
    expected = {
        "Deployment": {f"{NAME}-prefill", f"{NAME}-decode", f"{NAME}-router"},
        "Service": {f"{NAME}-prefill", f"{NAME}-decode", f"{NAME}-router"},
        "ConfigMap": {f"{NAME}-router"},
        "ServiceAccount": {f"{NAME}-router"},
        "Role": {f"{NAME}-router"},
        "RoleBinding": {f"{NAME}-router"},
    }
    children = eventually(
        lambda: (
            (c := cluster.children())
            and all({o["metadata"]["name"] for o in c[k]} >= v for k, v in expected.items())
            and c
        ),
        timeout_s=60,
        what="the operator to create every child",
        details=cluster.pod_runner.report,
    )
    uid = cluster.object()["metadata"]["uid"]
    for kind, objects in children.items():
        for obj in objects:
            [owner] = obj["metadata"]["ownerReferences"]
            assert owner["uid"] == uid, f"{kind} {obj['metadata']['name']}"
            assert owner["kind"] == "ServingCluster"
            assert owner["controller"] is True
    assert len(children["PodDisruptionBudget"]) >= 1


def test_pods_run_and_status_is_ready_with_counts(cluster: Cluster, clients: Clients) -> None:
    body = cluster.wait_settled(prefill=2, decode=2)
    status = body["status"]
    assert status["endpoint"].startswith(f"http://{NAME}-router.{NAMESPACE}")
    assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "True"
    table = clients.kubectl("-n", NAMESPACE, "get", "servingclusters").stdout
    assert NAME in table, table
    assert "Ready" in table, table


def test_engines_run_the_rendered_vllm_command_line(cluster: Cluster) -> None:
    cluster.wait_serving()
    for role in ("prefill", "decode"):
        [container] = cluster.deployment(role).spec.template.spec.containers
        assert container.command == ["vllm", "serve"]
        for process in cluster.processes(role):
            # The emulator was given the pod's own arguments, in order, bound to the pod's IP.
            argv = process.plan.argv
            assert "emulate" in argv
            # $(VAR) references (the engine key) are expanded from the environment, as by a kubelet.
            rendered = [
                expand(a, process.plan.env)
                for a in container.args
                if a not in ("--host", "0.0.0.0")
            ]
            given = [
                a for a in argv[argv.index("emulate") + 1 :] if a not in ("--host", process.ip)
            ]
            assert given[: len(rendered)] == rendered
            assert process.plan.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == process.ip


def test_chat_completion_goes_through_prefill_and_decode_pods(cluster: Cluster) -> None:
    cluster.wait_serving()
    cluster.wait_routable()
    engines = {role: cluster.processes(role) for role in ("prefill", "decode")}
    before = {
        p.name: metric_total(p.ip, "vllm:request_success_total")
        for ps in engines.values()
        for p in ps
    }
    reply, headers = chat(cluster, LONG_PROMPT)
    assert reply["object"] == "chat.completion"
    assert reply["choices"][0]["message"]["content"]
    after = {
        p.name: metric_total(p.ip, "vllm:request_success_total")
        for ps in engines.values()
        for p in ps
    }
    served = {name for name in after if after[name] > before[name]}
    assert any(p.name in served for p in engines["prefill"]), (headers, served)
    assert any(p.name in served for p in engines["decode"]), (headers, served)
    assert headers.get("x-tandem-route") == "disaggregated", headers
    # pod addresses reach only trusted clients that ask (x-tandem-debug with an admin key)
    assert not headers.get("x-tandem-decode-engine"), headers


def test_a_spec_update_rolls_the_pool(cluster: Cluster) -> None:
    old = {p.metadata.name for p in cluster.pods("decode")}
    cluster.patch({"decode": {"maxNumSeqs": 128}})
    cluster.wait_settled(prefill=2, decode=2)
    new = cluster.pods("decode")
    assert not old & {p.metadata.name for p in new}, "decode pods were replaced"
    for process in cluster.processes("decode"):
        argv = process.plan.argv
        assert argv[argv.index("--max-num-seqs") + 1] == "128"
    assert chat(cluster, "hello after the rollout")[0]["choices"]


def test_a_replica_change_changes_the_counts(cluster: Cluster) -> None:
    cluster.patch({"prefill": {"replicas": 1}, "decode": {"replicas": 3}})
    body = cluster.wait_settled(prefill=1, decode=3)
    assert body["status"]["prefill"]["summary"] == "1/1"
    assert body["status"]["decode"]["summary"] == "3/3"
    assert cluster.deployment("decode").spec.replicas == 3


def _identity(cluster: Cluster) -> dict[str, set[tuple[str, str]]]:
    """(name, uid) of every child and ReplicaSet: a duplicate or a re-creation changes it."""
    ids = {
        kind: {(o["metadata"]["name"], o["metadata"]["uid"]) for o in objs}
        for kind, objs in cluster.children().items()
    }
    replica_sets = cluster.apps.list_namespaced_replica_set(
        NAMESPACE, label_selector=SELECTOR
    ).items
    ids["ReplicaSet"] = {(r.metadata.name, r.metadata.uid) for r in replica_sets}
    return ids


def test_an_operator_restart_resumes_without_duplicates(
    cluster: Cluster, pod_runner: PodRunner, api: k8s.ApiClient
) -> None:
    before = _identity(cluster)
    [operator] = [p for p in pod_runner.by_role("operator", OPERATOR_NAMESPACE) if p.child.alive()]
    k8s.CoreV1Api(api).delete_namespaced_pod(operator.name, OPERATOR_NAMESPACE)
    restarted = wait_for_operator(pod_runner, not_named=operator.name)
    assert restarted.name != operator.name
    # The new operator resumes the object (kopf's resume handler reconciles it once) ...
    generation = cluster.object()["metadata"]["generation"]
    cluster.wait_settled(prefill=1, decode=3)
    assert _identity(cluster) == before, "the restart created or re-created objects"
    # ... and keeps serving changes.
    assert cluster.patch({"decode": {"replicas": 2}}) == generation + 1
    cluster.wait_settled(prefill=1, decode=2)
    after = _identity(cluster)
    assert {k: v for k, v in after.items() if k != "ReplicaSet"} == {
        k: v for k, v in before.items() if k != "ReplicaSet"
    }


def test_delete_garbage_collects_everything(cluster: Cluster, clients: Clients) -> None:
    clients.kubectl("delete", "-f", str(EXAMPLE), "--wait=true", "--timeout=60s")
    eventually(lambda: gone(cluster.object), timeout_s=30, what="the ServingCluster to go")

    def all_gone() -> bool:
        leftovers = {kind: objs for kind, objs in cluster.children().items() if objs}
        pods = cluster.core.list_namespaced_pod(NAMESPACE, label_selector=SELECTOR).items
        return not leftovers and not pods

    eventually(all_gone, timeout_s=90, what="garbage collection of every child and pod")
    eventually(
        lambda: (
            not [
                p
                for p in cluster.pod_runner.snapshot()
                if p.namespace == NAMESPACE and p.child.alive()
            ]
        ),
        timeout_s=30,
        what="every pod process to stop",
    )
    # The Secret the user made is theirs: never deleted.
    assert cluster.core.read_namespaced_secret("hf-token", NAMESPACE)


def test_the_operator_never_lacked_a_permission(pod_runner: PodRunner) -> None:
    """The chart's RBAC was enough for everything above: no request of any operator process
    (the first one and the one after the restart) was forbidden."""
    operators = [p for p in pod_runner.history if p.role == "operator"]
    assert operators, "the chart's operator ran"
    for operator in operators:
        refused = [
            line
            for line in operator.child.log.read_text(errors="replace").splitlines()
            if "forbidden" in line.lower() and "being terminated" not in line
        ]
        assert not refused, "\n".join(refused[:5])
