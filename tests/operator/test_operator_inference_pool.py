"""spec.inferencePool: the InferencePool (Gateway API Inference Extension v1), the endpoint
picker's Service and port, the relay container of decode pods and the network rules between a
gateway, the picker, the relays and the prefill engines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from netpol_eval import Endpoint, reachable
from sc_manifests import cluster, minimal
from test_operator_handlers import Events, FakeKube, run

from tandem.operator.api import ServingCluster
from tandem.operator.network_render import network_policies
from tandem.operator.render import render
from tandem.operator.router_render import router_config

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "tests" / "fixtures" / "gie" / "inferencepool-crd.yaml"
K8S_VERSION = "1.34.0"


def pool_cluster(**pool: Any) -> ServingCluster:
    return cluster(inferencePool={"enabled": True, **pool})


def named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def containers(objects: list[dict[str, Any]], deployment: str) -> dict[str, dict[str, Any]]:
    spec = named(objects, "Deployment", deployment)["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec["containers"]}


def test_off_by_default_renders_nothing_of_it() -> None:
    sc = cluster()
    objects = render(sc)
    assert not [o for o in objects if o["kind"] == "InferencePool"]
    assert "m-epp" not in {o["metadata"]["name"] for o in objects}
    assert set(containers(objects, "m-decode")) == {"vllm"}
    assert router_config(sc).epp is None


def test_pd_pool_targets_the_relays_and_names_the_picker() -> None:
    objects = render(pool_cluster(failureMode="FailOpen"))
    pool = named(objects, "InferencePool", "m")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"] == {
        "selector": {"matchLabels": {"tandem.dev/cluster": "m", "tandem.dev/role": "decode"}},
        "targetPorts": [{"number": 8001}],
        "appProtocol": "http",
        "endpointPickerRef": {
            "group": "",
            "kind": "Service",
            "name": "m-epp",
            "port": {"number": 9002},
            "failureMode": "FailOpen",
        },
    }
    service = named(objects, "Service", "m-epp")
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["selector"] == {"tandem.dev/cluster": "m", "tandem.dev/role": "router"}
    assert service["spec"]["ports"][0]["appProtocol"] == "kubernetes.io/h2c"
    router = containers(objects, "m-router")["router"]
    assert {"name": "epp", "containerPort": 9002, "protocol": "TCP"} in router["ports"]
    relay = containers(objects, "m-decode")["relay"]
    assert relay["command"] == ["tandem", "relay"]
    assert relay["args"][:4] == [
        "--engine",
        "http://127.0.0.1:8000",
        "--model",
        "meta-llama/Llama-3.1-8B-Instruct",
    ]
    assert relay["ports"] == [{"name": "relay", "containerPort": 8001, "protocol": "TCP"}]
    assert set(containers(objects, "m-prefill")) == {"vllm"}


def test_router_config_carries_the_picker() -> None:
    epp = router_config(pool_cluster(eppPort=9100, relayPort=8100)).epp
    assert epp is not None
    assert (epp.port, epp.relay_port) == (9100, 8100)
    # without P/D there is no relay: the pool targets the engines and the picker names them
    colocated = pool_cluster()
    colocated.spec.router.disaggregation.mode = "never"
    epp = router_config(colocated).epp
    assert epp is not None
    assert epp.relay_port is None
    objects = render(colocated)
    assert named(objects, "InferencePool", "m")["spec"]["targetPorts"] == [{"number": 8000}]
    assert set(containers(objects, "m-decode")) == {"vllm"}


def test_engine_key_reaches_the_relay() -> None:
    objects = render(
        pool_cluster()
        if False
        else cluster(inferencePool={"enabled": True}, router={"auth": {"engineKey": True}})
    )
    pod = named(objects, "Deployment", "m-decode")["spec"]["template"]["spec"]
    relay = {c["name"]: c for c in pod["containers"]}["relay"]
    assert "--engine-key-file" in relay["args"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["relay-engine-key"]["secret"]["secretName"] == "m-engine-key"


@pytest.mark.parametrize("mode", ["auto", "never"])
def test_objects_validate(mode: str) -> None:
    """Core objects against Kubernetes 1.34's schemas; the InferencePool against the schema of
    tests/fixtures/gie/inferencepool-crd.yaml (e2e applies that CRD to a real API server)."""
    objects = render(
        cluster(inferencePool={"enabled": True}, router={"disaggregation": {"mode": mode}})
    )
    schema = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for obj in objects:
        if obj["kind"] == "InferencePool":
            jsonschema.validate(obj, schema)
        elif obj["kind"] not in {"ServiceMonitor", "PodMonitor"}:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_network_rules_let_the_gateway_in_and_the_relay_out() -> None:
    gateway_peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gw"}}}
    sc = pool_cluster(allowFrom=[gateway_peer])
    policies = network_policies(sc)
    spaces = {ns: {"kubernetes.io/metadata.name": ns} for ns in ("ns", "gw", "apps")}

    def pod(name: str, role: str | None, ns: str = "ns") -> Endpoint:
        labels = {"tandem.dev/cluster": "m", "tandem.dev/role": role} if role else {}
        ports = {"http": 8000, "admin": 9901, "epp": 9002, "relay": 8001}
        return Endpoint(name, ns, labels, ports)

    gateway, client = pod("gateway", None, "gw"), pod("client", None, "apps")
    router, prefill, decode = (
        pod("router", "router"),
        pod("prefill", "prefill"),
        pod("decode", "decode"),
    )
    assert reachable(policies, gateway, router, 9002, namespaces=spaces)
    assert reachable(policies, gateway, decode, 8001, namespaces=spaces)
    assert not reachable(policies, client, router, 9002, namespaces=spaces)
    assert not reachable(policies, client, decode, 8001, namespaces=spaces)
    assert not reachable(policies, gateway, prefill, 8000, namespaces=spaces)
    assert reachable(policies, decode, prefill, 8000, namespaces=spaces)  # the relay's prefill


class WithoutInferencePools(FakeKube):
    """An API server where the GIE CRD is not installed."""

    def serves(self, api_version: str, kind: str) -> bool:
        return not api_version.startswith("inference.networking.k8s.io/")


def test_operator_applies_and_prunes_the_pool() -> None:
    kube, events = FakeKube(), Events()
    body = kube.add_cluster(minimal(inferencePool={"enabled": True}))
    run(kube, events)
    assert {("InferencePool", "m"), ("Service", "m-epp")} <= kube.kinds()
    body["spec"] = {**body["spec"], "inferencePool": {"enabled": False}}
    body["metadata"]["generation"] = 2
    run(kube, events)
    assert not {("InferencePool", "m"), ("Service", "m-epp")} & kube.kinds()


def test_pool_skipped_where_its_api_is_not_served() -> None:
    kube, events = WithoutInferencePools(), Events()
    kube.add_cluster(minimal(inferencePool={"enabled": True}))
    run(kube, events)
    kinds = kube.kinds()
    assert ("InferencePool", "m") not in kinds
    assert ("Service", "m-epp") in kinds  # the picker still serves a gateway configured by hand
