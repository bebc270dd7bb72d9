"""The shared gateway's objects: one `tandem gateway` for the ServingClusters joining it."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

import kubernetes_validate
import yaml
from netpol_eval import Endpoint, reachable
from sc_manifests import minimal

from tandem.operator.api import ServingCluster
from tandem.operator.common_render import HTTP_PORT
from tandem.operator.gateway_render import (
    GATEWAY_CONFIG_KEY,
    members,
    render_gateway,
)
from tandem.operator.manifest import parse_manifest
from tandem.operator.render import render
from tandem.router.config import GatewayConfig

K8S_VERSION = "1.34.0"


def member(
    name: str, served: str, namespace: str = "ns", gateway: str | None = "shared", **spec: Any
) -> ServingCluster:
    manifest = minimal(model={"name": f"org/{served}", "servedName": served}, **spec)
    manifest["metadata"] = {"name": name, "namespace": namespace, "uid": f"uid-{name}"}
    if gateway is not None:
        manifest["spec"]["gateway"] = {"name": gateway}
    return parse_manifest(manifest)


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def test_members_are_the_namespaces_clusters_naming_the_gateway() -> None:
    clusters = [
        member("beta", "b"),
        member("alpha", "a"),
        member("other", "o", gateway="elsewhere"),
        member("alone", "x", gateway=None),
        member("far", "f", namespace="other-ns"),
    ]
    assert [sc.name for sc in members(clusters, "ns", "shared")] == ["alpha", "beta"]
    assert render_gateway("shared", []) == []


def test_gateway_objects_serve_every_member_with_its_own_pools_and_keys() -> None:
    alpha = member(
        "alpha",
        "model-a",
        router={
            "auth": {"clientKeysSecret": {"name": "alpha-keys"}},
            "tenancy": {"tenants": [{"name": "team-a", "weight": 2}]},
        },
    )
    beta = member("beta", "model-b", router={"image": "example/tandem:dev"})
    objects = render_gateway("shared", [alpha, beta])
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        assert obj["metadata"]["namespace"] == "ns"
        owners = obj["metadata"]["ownerReferences"]
        if obj["kind"] == "NetworkPolicy":
            continue  # each engine policy is its member's alone
        assert [o["uid"] for o in owners] == ["uid-alpha", "uid-beta"]
        assert not any(o.get("controller") for o in owners)
        assert "tandem.dev/cluster" not in obj["metadata"]["labels"]  # no member prunes it
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert {
        ("ServiceAccount", "shared-gateway"),
        ("Role", "shared-gateway"),
        ("RoleBinding", "shared-gateway"),
        ("ConfigMap", "shared-gateway"),
        ("Service", "shared-gateway"),
        ("Deployment", "shared-gateway"),
    } <= names

    (config_map,) = by_kind(objects, "ConfigMap")
    config = GatewayConfig.model_validate(yaml.safe_load(config_map["data"][GATEWAY_CONFIG_KEY]))
    assert [m.served_model_name for m in config.models] == ["model-a", "model-b"]
    discovery = [m.kubernetes for m in config.models]
    assert [(d.namespace, d.cluster_name) for d in discovery if d] == [
        ("ns", "alpha"),
        ("ns", "beta"),
    ]
    assert config.models[0].tenancy.tenants[0].name == "team-a"
    assert config.models[1].auth.client_keys_file is None

    (deployment,) = by_kind(objects, "Deployment")
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["tandem", "gateway"]
    assert container["image"] == alpha.spec.router.image  # the first member's
    config_path = PurePosixPath(container["args"][1])
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounted = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}

    def source_of(path: str) -> tuple[str, str]:
        """The (Secret or ConfigMap name, key) a file path in the pod reads."""
        file = PurePosixPath(path)
        volume = mounted[str(file.parent)]
        name = volume["secret"]["secretName"] if "secret" in volume else volume["configMap"]["name"]
        return name, file.name

    assert source_of(str(config_path)) == ("shared-gateway", GATEWAY_CONFIG_KEY)
    a, b = config.models
    assert a.auth.client_keys_file
    assert source_of(a.auth.client_keys_file) == (
        "alpha-keys",
        "api-keys",
    )
    assert a.auth.engine_key_file
    assert source_of(a.auth.engine_key_file) == (
        "alpha-engine-key",
        "api-key",
    )
    assert b.auth.engine_key_file
    assert source_of(b.auth.engine_key_file) == (
        "beta-engine-key",
        "api-key",
    )

    (service,) = by_kind(objects, "Service")
    labels = pod["metadata"]["labels"]
    assert all(labels[k] == v for k, v in service["spec"]["selector"].items())
    assert all(labels[k] == v for k, v in deployment["spec"]["selector"]["matchLabels"].items())


def test_the_gateway_reaches_each_members_engines_and_nobody_elses() -> None:
    alpha, beta = member("alpha", "a"), member("beta", "b")
    outsider = member("outsider", "o", gateway=None)
    policies = [
        o
        for o in [
            *render(alpha),
            *render(beta),
            *render(outsider),
            *render_gateway("shared", [alpha, beta]),
        ]
        if o["kind"] == "NetworkPolicy"
    ]
    (deployment,) = by_kind(render_gateway("shared", [alpha, beta]), "Deployment")
    gateway_pod = Endpoint("gateway", "ns", deployment["spec"]["template"]["metadata"]["labels"])

    def engine(sc_name: str) -> Endpoint:
        labels = {"tandem.dev/cluster": sc_name, "tandem.dev/role": "decode"}
        return Endpoint(sc_name, "ns", labels, {"http": HTTP_PORT})

    assert reachable(policies, gateway_pod, engine("alpha"), HTTP_PORT)
    assert reachable(policies, gateway_pod, engine("beta"), HTTP_PORT)
    assert not reachable(policies, gateway_pod, engine("outsider"), HTTP_PORT)
    stranger = Endpoint("stranger", "ns", {"app": "x"})
    assert not reachable(policies, stranger, engine("alpha"), HTTP_PORT)


def test_a_single_clusters_router_carries_its_tenancy() -> None:
    sc = member(
        "alpha", "a", gateway=None, router={"tenancy": {"defaultRate": {"tokensPerSecond": 5}}}
    )
    (config_map,) = [
        o
        for o in render(sc)
        if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "alpha-router"
    ]
    config = yaml.safe_load(config_map["data"]["router.yaml"])
    assert config["tenancy"]["defaultRate"]["tokensPerSecond"] == 5


def test_each_members_tokenizer_reaches_the_gateway_pod_apart_from_the_others() -> None:
    cache = {"pvc": "weights", "mountPath": "/models"}
    hub_a, hub_b = member("alpha", "a"), member("beta", "b")
    on_volume = member("gamma", "c")
    on_volume = parse_manifest(
        {
            **on_volume.model_dump(by_alias=True, exclude_none=True, mode="json"),
            "spec": {
                **on_volume.spec.model_dump(by_alias=True, exclude_none=True, mode="json"),
                "model": {"name": "/models/gamma", "servedName": "c", "cache": cache},
            },
        }
    )
    objects = render_gateway("shared", [hub_a, hub_b, on_volume])
    (config_map,) = by_kind(objects, "ConfigMap")
    config = GatewayConfig.model_validate(yaml.safe_load(config_map["data"][GATEWAY_CONFIG_KEY]))
    tokenizers = [m.tokenizer for m in config.models]
    assert tokenizers == [
        "/var/lib/tandem/tokenizer/alpha",
        "/var/lib/tandem/tokenizer/beta",
        "/var/lib/tandem/models/gamma/gamma",
    ]
    (deployment,) = by_kind(objects, "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    fetches = spec["initContainers"]
    assert [c["name"] for c in fetches] == ["m0-fetch-tokenizer", "m1-fetch-tokenizer"]
    for fetch, model in zip(fetches, ("alpha", "beta"), strict=True):
        target = f"/var/lib/tandem/tokenizer/{model}"
        assert fetch["args"][0] == f"org/{model[0]}"
        assert fetch["args"][2] == target
        assert [m["mountPath"] for m in fetch["volumeMounts"]] == [target]
    (container,) = spec["containers"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes[mounts["/var/lib/tandem/tokenizer/alpha"]]
    assert volumes[mounts["/var/lib/tandem/models/gamma"]]["persistentVolumeClaim"] == {
        "claimName": "weights",
        "readOnly": True,
    }
    assert len(volumes) == len(spec["volumes"])  # no two members' volumes share a name
    kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
