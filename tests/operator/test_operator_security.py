"""Secure defaults of the rendered objects and the reconciler: NetworkPolicy reachability, pod
security contexts, the engine key, conflicts with foreign objects, missing dependencies and
failures that must surface as conditions and Events."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kopf
import pytest
from netpol_eval import Endpoint, reachable
from sc_manifests import cluster, minimal
from test_operator_handlers import Events, FakeKube, run

from tandem.operator.common_render import ENGINE_KEY_ENV, NIXL_SIDE_CHANNEL_PORT
from tandem.operator.manifest import load_manifest
from tandem.operator.network_render import network_policies
from tandem.operator.ownership import Dependency, dependencies, foreign_owner
from tandem.operator.reconcile import reconcile_reporting
from tandem.operator.reconcile_plan import ObjectKey
from tandem.operator.render import render
from tandem.operator.resync import resync_once
from tandem.operator.router_render import router_config

ROOT = Path(__file__).resolve().parents[2]
SECURITY_DOC = ROOT / "docs" / "security.md"

# --- NetworkPolicy reachability -----------------------------------------------------------------

ENGINE_PORTS = {"http": 8000, "kv-events": 5557, "kv-replay": 5558, "nixl": 5600}
NAMESPACES = {
    "serving": {"kubernetes.io/metadata.name": "serving"},
    "apps": {"kubernetes.io/metadata.name": "apps"},
    "monitoring": {"kubernetes.io/metadata.name": "monitoring"},
    "kube-system": {"kubernetes.io/metadata.name": "kube-system"},
}


def _pod(name: str, cluster_name: str | None, role: str | None, ns: str = "serving") -> Endpoint:
    labels = {}
    if cluster_name:
        labels["tandem.dev/cluster"] = cluster_name
    if role:
        labels["tandem.dev/role"] = role
    ports = {"http": 8000, "admin": 9901} if role == "router" else ENGINE_PORTS if role else {}
    return Endpoint(name, ns, labels, ports)


ENDPOINTS = [
    _pod("router", "llama", "router"),
    _pod("prefill", "llama", "prefill"),
    _pod("decode", "llama", "decode"),
    _pod("other-decode", "other", "decode"),  # another ServingCluster in the same namespace
    _pod("unlabelled", None, None),  # any other pod of the namespace
    _pod("client", None, None, "apps"),
    Endpoint("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"}),
    Endpoint("kube-dns", "kube-system", {"k8s-app": "kube-dns"}),
    Endpoint("outside", None),  # the internet, the API server: anything that is not a pod
]
TANDEM_PODS = {"router", "prefill", "decode"}  # the ServingCluster "llama" under test
PROBES = [
    ("8000", 8000, "TCP"), ("5557", 5557, "TCP"), ("5558", 5558, "TCP"),
    ("5600", NIXL_SIDE_CHANNEL_PORT, "TCP"), ("5601-5699", 5650, "TCP"),
    ("53/udp", 53, "UDP"), ("443", 443, "TCP"), ("6443", 6443, "TCP"), ("9901", 9901, "TCP"),
]  # fmt: skip


def matrix(policies: list[dict[str, Any]]) -> dict[tuple[str, str], list[str]]:
    """(source, destination) -> the probe ports allowed, for connections from or to llama's pods."""
    out = {}
    for source in ENDPOINTS:
        for destination in ENDPOINTS:
            if source is destination:
                continue
            allowed = [
                label
                for label, port, protocol in PROBES
                if reachable(policies, source, destination, port, protocol, NAMESPACES)
            ]
            if allowed and {source.name, destination.name} & TANDEM_PODS:
                out[(source.name, destination.name)] = allowed
    return out


def matrix_markdown(cells: dict[tuple[str, str], list[str]]) -> str:
    lines = ["| from | to | ports |", "| --- | --- | --- |"]
    lines += [f"| {src} | {dst} | {', '.join(ports)} |" for (src, dst), ports in cells.items()]
    return "\n".join(lines) + "\n"


def _llama(**spec: Any) -> list[dict[str, Any]]:
    sc = cluster(**spec)
    sc.metadata.name, sc.metadata.namespace = "llama", "serving"
    return network_policies(sc)


def _with_other_cluster(policies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    other = cluster()
    other.metadata.name, other.metadata.namespace = "other", "serving"
    return policies + network_policies(other)


def test_default_policies_allow_exactly_the_traffic_tandem_has() -> None:
    cells = matrix(_with_other_cluster(_llama()))
    # Only the pods of the serving namespace are policed here; "outside" is not a pod.
    assert cells[("router", "prefill")] == ["8000", "5557", "5558"]
    assert cells[("router", "decode")] == ["8000", "5557", "5558"]
    assert cells[("prefill", "decode")] == ["5600", "5601-5699"]
    assert cells[("decode", "prefill")] == ["5600", "5601-5699"]
    assert cells[("client", "router")] == ["8000"]
    assert cells[("unlabelled", "router")] == ["8000"]
    # http like any client, and the admin port, where /metrics lives
    assert cells[("prometheus", "router")] == ["8000", "9901"]
    assert cells[("prometheus", "prefill")] == ["8000"]
    assert cells[("prometheus", "decode")] == ["8000"]
    for pod in ("router", "prefill", "decode"):
        assert cells[(pod, "kube-dns")] == ["53/udp"]
    assert cells[("router", "outside")] == ["443", "6443"]  # the API server
    assert cells[("prefill", "outside")] == ["443"]  # model download
    assert cells[("outside", "router")] == ["8000"]
    # What must never happen: engines reached by anyone but their router, Prometheus and peer pool.
    for source in ("unlabelled", "client", "other-decode", "outside"):
        for engine in ("prefill", "decode"):
            assert (source, engine) not in cells, (source, engine)
    for engine in ("prefill", "decode"):
        assert (engine, "other-decode") not in cells  # no NIXL to another cluster's pools
        assert (engine, "router") not in cells
        assert (engine, "unlabelled") not in cells
    assert ("router", "other-decode") not in cells


def test_router_clients_restricted_by_allow_from() -> None:
    apps = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "apps"}}}
    cells = matrix(_llama(networkPolicy={"allowFrom": [apps]}))
    assert cells[("client", "router")] == ["8000"]
    assert cells[("prometheus", "router")] == ["9901"]
    assert ("unlabelled", "router") not in cells
    assert ("outside", "router") not in cells
    assert ("client", "decode") not in cells  # allowFrom never reaches engines


def test_read_only_cache_drops_the_download_and_colocated_drops_nixl() -> None:
    cells = matrix(_llama(model={"name": "m", "cache": {"pvc": "weights", "readOnly": True}}))
    assert ("prefill", "outside") not in cells
    colocated = matrix(_llama(router={"disaggregation": {"mode": "never"}}))
    assert ("decode", "prefill") not in colocated
    assert not any(dst == "decode" and "5600" in ports for (_, dst), ports in colocated.items())


def test_security_doc_shows_the_rendered_matrix() -> None:
    table = matrix_markdown(matrix(_with_other_cluster(_llama())))
    assert table in SECURITY_DOC.read_text(), (
        f"docs/security.md's reachability matrix is stale; it should contain:\n{table}"
    )


# --- pod security -------------------------------------------------------------------------------


def _pod_specs(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        o["metadata"]["name"]: o["spec"]["template"]["spec"]
        for o in objects
        if o["kind"] == "Deployment"
    }


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """The checks of the "restricted" Pod Security Standard (v1.34) that a renderer can break."""
    problems = []
    pod_ctx = pod.get("securityContext") or {}
    for container in pod["containers"]:
        ctx = container.get("securityContext") or {}
        if ctx.get("allowPrivilegeEscalation") is not False:
            problems.append("allowPrivilegeEscalation")
        if (ctx.get("capabilities") or {}).get("drop") != ["ALL"]:
            problems.append("capabilities.drop")
        if set((ctx.get("capabilities") or {}).get("add") or []) - {"NET_BIND_SERVICE"}:
            problems.append("capabilities.add")
        if not ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")):
            problems.append("runAsNonRoot")
        if ctx.get("runAsUser", pod_ctx.get("runAsUser")) == 0:
            problems.append("runAsUser")
        seccomp = ctx.get("seccompProfile") or pod_ctx.get("seccompProfile") or {}
        if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
            problems.append("seccompProfile")
        if ctx.get("privileged"):
            problems.append("privileged")
    allowed_volumes = {"configMap", "secret", "emptyDir", "persistentVolumeClaim", "projected",
                       "downwardAPI", "csi", "ephemeral"}  # fmt: skip
    for volume in pod.get("volumes") or []:
        if not set(volume) - {"name"} <= allowed_volumes:
            problems.append(f"volume {volume['name']}")
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            problems.append(field)
    return problems


def test_every_pod_passes_restricted_with_a_read_only_root(pd_cluster: Any) -> None:
    pods = _pod_specs(render(pd_cluster))
    assert set(pods) == {"llama-8b-router", "llama-8b-prefill", "llama-8b-decode"}
    for name, pod in pods.items():
        assert restricted_violations(pod) == [], name
        assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
        mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert "/tmp" in mounts, name
    engine = pods["llama-8b-decode"]["containers"][0]
    env = {e["name"]: e for e in engine["env"]}
    assert env["HOME"]["value"] in {m["mountPath"] for m in engine["volumeMounts"]}


def test_pool_security_context_overrides_merge_over_the_default() -> None:
    sc = cluster(
        decode={"securityContext": {"capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}},
                "podSecurityContext": {"runAsUser": 0, "runAsNonRoot": False}},
    )  # fmt: skip
    pods = _pod_specs(render(sc))
    decode = pods["m-decode"]
    assert decode["containers"][0]["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert decode["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    assert decode["securityContext"]["runAsUser"] == 0
    assert restricted_violations(decode)  # the user's choice, visible to admission
    assert restricted_violations(pods["m-prefill"]) == []


# --- auth ------------------------------------------------------------------------------------


def test_engines_take_the_key_from_the_generated_secret_and_the_router_mounts_it() -> None:
    sc = cluster(router={"auth": {"clientKeysSecret": {"name": "clients"}}})
    pods = _pod_specs(render(sc))
    engine = pods["m-prefill"]["containers"][0]
    # vLLM reads VLLM_API_KEY when --api-key is absent: the key never reaches the command line.
    assert "--api-key" not in engine["args"]
    env = {e["name"]: e for e in engine["env"]}
    assert env[ENGINE_KEY_ENV]["valueFrom"]["secretKeyRef"] == {
        "name": "m-engine-key",
        "key": "api-key",
    }
    assert "value" not in env[ENGINE_KEY_ENV]
    router = pods["m-router"]
    secrets = {v["secret"]["secretName"] for v in router["volumes"] if "secret" in v}
    assert secrets == {"clients", "m-engine-key"}
    config = router_config(sc)
    assert config.auth.client_keys_file == "/var/run/tandem/client-keys/api-keys"
    assert config.auth.engine_key_file == "/var/run/tandem/engine-key/api-key"
    assert not any(o["kind"] == "Secret" for o in render(sc))  # the key is never rendered


def test_engine_key_can_be_turned_off() -> None:
    sc = cluster(router={"auth": {"engineKey": False}})
    engine = _pod_specs(render(sc))["m-decode"]["containers"][0]
    assert ENGINE_KEY_ENV not in {e["name"] for e in engine.get("env", [])}
    assert router_config(sc).auth.engine_key_file is None


# --- ownership and dependencies ------------------------------------------------------------------


def test_foreign_owner_rules() -> None:
    mine = {"metadata": {"ownerReferences": [{"uid": "u1", "controller": True}]}}
    assert foreign_owner(mine, "u1", "m") is None
    theirs = {
        "metadata": {
            "ownerReferences": [{"uid": "u2", "controller": True, "kind": "X", "name": "y"}]
        }
    }
    assert foreign_owner(theirs, "u1", "m") == "controlled by X/y"
    orphan = {
        "metadata": {
            "labels": {"tandem.dev/cluster": "m", "app.kubernetes.io/managed-by": "tandem-operator"}
        }
    }
    assert foreign_owner(orphan, "u1", "m") is None
    hand_made = {"metadata": {"labels": {"app": "x"}}}
    assert foreign_owner(hand_made, "u1", "m") == "not created by Tandem"


def test_dependencies_name_every_referenced_secret_and_pvc(pd_cluster: Any) -> None:
    assert dependencies(pd_cluster) == [Dependency("Secret", "hf-token", "model.hfTokenSecret")]
    sc = cluster(
        model={"name": "m", "cache": {"pvc": "weights"}, "hfTokenSecret": {"name": "hf"}},
        router={"auth": {"clientKeysSecret": {"name": "clients"}}},
        engine={"env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "x"}}}]},
        imagePullSecrets=["regcred"],
    )
    assert [(d.kind, d.name) for d in dependencies(sc)] == [
        ("Secret", "hf"), ("PersistentVolumeClaim", "weights"), ("Secret", "clients"), ("Secret", "regcred"),
    ]  # fmt: skip


def _conditions(kube: FakeKube) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in kube.cluster()["status"]["conditions"]}


def test_engine_key_secret_is_created_once_owned_and_recorded() -> None:
    kube, events = FakeKube(), Events()
    kube.add_cluster(minimal())
    run(kube, events)
    secret = kube.get("v1", "Secret", "ns", "m-engine-key")
    assert secret is not None
    assert secret["metadata"]["ownerReferences"][0]["kind"] == "ServingCluster"
    recorded = kube.cluster()["status"]["engineKeySecret"]
    assert recorded == {"name": "m-engine-key", "uid": secret["metadata"]["uid"]}
    key = secret["stringData"]["api-key"]
    first = kube.get("apps/v1", "Deployment", "ns", "m-decode")
    annotations = first["spec"]["template"]["metadata"]["annotations"]  # type: ignore[index]
    assert annotations["tandem.dev/engine-key-uid"] == recorded["uid"]  # no roll later for it
    run(kube, events)
    assert kube.get("v1", "Secret", "ns", "m-engine-key")["stringData"]["api-key"] == key  # type: ignore[index]
    decode = kube.get("apps/v1", "Deployment", "ns", "m-decode")
    annotations = decode["spec"]["template"]["metadata"]["annotations"]  # type: ignore[index]
    assert annotations["tandem.dev/engine-key-uid"] == recorded["uid"]
    assert _conditions(kube)["Degraded"]["status"] == "False"


def test_a_foreign_object_is_a_conflict_and_is_not_taken_over() -> None:
    kube, events = FakeKube(), Events()
    kube.add_cluster(minimal())
    foreign = {"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": "m-router", "namespace": "ns", "labels": {"team": "x"}},
               "data": {"mine": "yes"}}  # fmt: skip
    kube.objects[ObjectKey("v1", "ConfigMap", "ns", "m-router")] = foreign
    assert run(kube, events) == "Degraded"
    assert kube.get("v1", "ConfigMap", "ns", "m-router") == foreign
    degraded = _conditions(kube)["Degraded"]
    assert degraded["reason"] == "Conflict"
    assert "ConfigMap/m-router" in degraded["message"]
    assert "Conflict" in events.reasons()
    assert ("Deployment", "m-decode") in kube.kinds()  # everything else is still applied


def test_a_foreign_engine_key_secret_is_a_conflict() -> None:
    kube, events = FakeKube(), Events()
    kube.add_cluster(minimal())
    squatter = {"apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": "m-engine-key", "namespace": "ns"}, "stringData": {"api-key": "known"}}  # fmt: skip
    kube.objects[ObjectKey("v1", "Secret", "ns", "m-engine-key")] = squatter
    assert run(kube, events) == "Degraded"
    assert "Secret/m-engine-key" in _conditions(kube)["Degraded"]["message"]


def test_missing_secret_and_pvc_degrade_naming_them_until_they_exist() -> None:
    kube, events = FakeKube(), Events()
    kube.add_cluster(minimal(model={"name": "m", "hfTokenSecret": {"name": "hf"},
                                    "cache": {"pvc": "weights"}}))  # fmt: skip
    assert run(kube, events) == "Degraded"
    degraded = _conditions(kube)["Degraded"]
    assert degraded["reason"] == "DependencyMissing"
    assert "Secret ns/hf (model.hfTokenSecret) not found" in degraded["message"]
    assert "PersistentVolumeClaim ns/weights (model.cache) not found" in degraded["message"]
    assert events.reasons().count("DependencyMissing") == 2  # one Event per missing object
    run(kube, events)
    assert events.reasons().count("DependencyMissing") == 2  # announced once, not every resync
    for kind, name in (("Secret", "hf"), ("PersistentVolumeClaim", "weights")):
        kube.objects[ObjectKey("v1", kind, "ns", name)] = {"metadata": {"name": name}}
    assert resync_once(kube, ["ns"], events) == 1  # type: ignore[arg-type]
    assert _conditions(kube)["Degraded"]["status"] == "False"


def test_an_unexpected_exception_becomes_a_condition_an_event_and_the_resync_goes_on() -> None:
    kube, events = FakeKube(), Events()
    kube.add_cluster(minimal())
    other = minimal()
    other["metadata"]["name"] = "n"
    body = kube.add_cluster(other)
    body["metadata"]["uid"] = "other-uid"
    broken = kube.get

    def get(api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        if kind == "Service" and name == "m-router":
            raise RuntimeError("boom")
        return broken(api_version, kind, namespace, name)

    kube.get = get  # type: ignore[method-assign]
    assert resync_once(kube, ["ns"], events) == 1  # type: ignore[arg-type]  # n still reconciled
    degraded = _conditions(kube)["Degraded"]
    assert degraded["reason"] == "ReconcileFailed"
    assert "RuntimeError: boom" in degraded["message"]
    assert "ReconcileFailed" in events.reasons()
    with pytest.raises(kopf.TemporaryError):
        reconcile_reporting(kube, kube.cluster(), events)  # type: ignore[arg-type]


def test_the_example_renders_no_secret_value(pd_cluster: Any) -> None:
    text = repr(render(pd_cluster))
    assert "stringData" not in text
    assert "'data'" not in text.replace("'data': {'router.yaml'", "")
    assert load_manifest(ROOT / "examples" / "llama-8b-pd.yaml").spec.network_policy.enabled


async def test_autoscaler_loops_start_stop_and_survive_failures() -> None:
    """The autoscaler's per-object tasks (real asyncio, the API client replaced by FakeKube): an
    evaluation that raises is reported as ScalingActive=False and the loop keeps going."""
    import asyncio
    import logging

    from tandem.operator.autoscaling import handlers as autoscaling

    kube = FakeKube()
    body = kube.add_cluster(minimal(autoscaling={"enabled": True, "intervalSeconds": 1}))
    calls: list[str] = []
    posted: list[str] = []
    evaluated_after_a_failure = asyncio.Event()

    async def failing(*args: Any, **kwargs: Any) -> Any:
        calls.append("evaluate")
        if len(calls) >= 2:
            evaluated_after_a_failure.set()
        raise RuntimeError("prometheus client exploded")

    original_evaluate, original_post = autoscaling.evaluate, autoscaling._post
    autoscaling.evaluate = failing  # type: ignore[assignment]
    autoscaling._post = lambda body, type_, reason, message: posted.append(reason)  # type: ignore[assignment]
    try:
        loops = autoscaling.AutoscalerLoops(lambda: kube, logging.getLogger("test"))  # type: ignore[arg-type,return-value]
        loops.observe("ADDED", body)
        # one interval (1 s) after the first failure; the bound is for a loaded machine
        await asyncio.wait_for(evaluated_after_a_failure.wait(), timeout=30)
        conditions = {c["type"]: c for c in kube.cluster()["status"]["conditions"]}
        assert conditions["ScalingActive"]["status"] == "False"
        assert "prometheus client exploded" in conditions["ScalingActive"]["message"]
        assert "AutoscalerFailed" in posted
        disabled = {**body, "spec": {**body["spec"], "autoscaling": {"enabled": False}}}
        loops.observe("MODIFIED", disabled)
        assert not loops.tasks
        loops.observe("ADDED", body)
        loops.observe("DELETED", body)
        assert not loops.tasks
        await loops.stop_all()
    finally:
        autoscaling.evaluate, autoscaling._post = original_evaluate, original_post  # type: ignore[assignment]
