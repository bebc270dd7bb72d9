"""The CRD's defaults, filled in by the real kube-apiserver.

`tandem crd` is applied to the `api_server` fixture (etcd and kube-apiserver alone), and each
ServingCluster goes through `kubectl create --dry-run=server -o json`: the answer is the object as
the server would store it, with the defaults it read from the CRD's schema. It must hold every
default the models have, with the same value (empty lists and maps aside), and parse to the
ServingCluster the models make of the manifest as written, at every level a manifest leaves fields
out. (Refusals by the schema and the CEL rules: e2e/test_admission.py.)
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from e2e.harness.tools import Clients
from tandem.operator.api import ServingCluster

pytestmark = pytest.mark.e2e


def defaulted_by_the_server(clients: Clients, spec: dict[str, Any]) -> dict[str, Any]:
    manifest = {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "ServingCluster",
        "metadata": {"name": "defaults", "namespace": "default"},
        "spec": spec,
    }
    created = clients.kubectl(
        "create", "--dry-run=server", "-o", "json", "-f", "-", stdin=json.dumps(manifest)
    )
    obj: dict[str, Any] = json.loads(created.stdout)
    return obj


def as_the_models_parse_it(spec: dict[str, Any]) -> ServingCluster:
    return ServingCluster.model_validate({"metadata": {"name": "defaults"}, "spec": spec})


def without_empty_collections(value: Any) -> Any:
    """`value` less every empty list and map in it: the models default to those where the schema
    gives no default (an absent list and an empty one parse the same)."""
    if isinstance(value, dict):
        kept = {key: without_empty_collections(child) for key, child in value.items()}
        return {key: child for key, child in kept.items() if child not in ({}, [])}
    if isinstance(value, list):
        return [without_empty_collections(item) for item in value]
    return value


BARE = {"model": {"name": "m"}}
# Fields given inside objects that have defaults of their own, at several depths.
PARTIAL = {
    "model": {"name": "m", "cache": {"pvc": "weights"}},
    "prefill": {"replicas": 3, "speculative": {}},
    "router": {"scoring": {"prefixWeight": 5.0}, "timeouts": {"connectSeconds": 1.0}},
    "autoscaling": {"enabled": True, "decode": {"max": 4}},
    "engine": {"probes": {"startupBudgetSeconds": 600}},
    "monitoring": {"enabled": False},
}


@pytest.mark.parametrize("spec", [BARE, PARTIAL], ids=["bare", "partial"])
def test_the_server_fills_in_the_models_defaults(
    crd_clients: Clients, spec: dict[str, Any]
) -> None:
    """Every default the models have, the server writes in, with the same value, and no other."""
    served = defaulted_by_the_server(crd_clients, spec)["spec"]
    models = as_the_models_parse_it(spec).spec.model_dump(
        mode="json", by_alias=True, exclude_none=True
    )
    assert without_empty_collections(served) == without_empty_collections(models)
    assert as_the_models_parse_it(served) == as_the_models_parse_it(spec)


def test_a_bare_manifest_gets_the_documented_defaults(crd_clients: Clients) -> None:
    spec = defaulted_by_the_server(crd_clients, BARE)["spec"]
    assert spec["engine"]["blockSize"] == 16
    assert spec["prefill"]["replicas"] == spec["decode"]["replicas"] == 1
    assert spec["router"]["processes"] == 1
    assert "resources" not in spec["router"]  # rendered from `processes` when unset
    assert spec["autoscaling"]["enabled"] is False


def test_given_fields_stay_and_their_siblings_get_defaults(crd_clients: Clients) -> None:
    spec = defaulted_by_the_server(crd_clients, PARTIAL)["spec"]
    assert spec["model"]["cache"] == {"pvc": "weights", "mountPath": "/models", "readOnly": False}
    assert spec["prefill"]["replicas"] == 3
    assert spec["prefill"]["tensorParallelSize"] == 1
    assert spec["prefill"]["speculative"] == {"method": "ngram", "numSpeculativeTokens": 4}
    assert spec["router"]["scoring"]["prefixWeight"] == 5.0
    assert spec["router"]["scoring"]["queueWeight"] == 2.0
    assert spec["router"]["timeouts"]["prefillSeconds"] == 120.0
    assert spec["autoscaling"]["decode"] == {
        "min": 1, "max": 4, "targetITLSeconds": 0.05, "maxKVUsage": 0.85,
    }  # fmt: skip
    assert spec["autoscaling"]["prefill"] == {"min": 1, "max": 8, "targetTTFTSeconds": 0.8}
    assert spec["engine"]["probes"]["startupBudgetSeconds"] == 600
    assert spec["engine"]["blockSize"] == 16
    assert spec["monitoring"] == {"enabled": False, "interval": "15s"}


def test_lora_settings_get_their_defaults_and_the_cel_rules_hold(crd_clients: Clients) -> None:
    """The lora fields' defaults come from the server, and its CEL rules (which the server
    compiled and costed when the CRD was applied) refuse duplicate adapter names and an adapter
    named like the served model."""
    adapters = [{"name": "sql", "source": "org/sql-lora"}]
    spec = defaulted_by_the_server(
        crd_clients, {**BARE, "lora": {"adapters": adapters}, "decode": {"lora": {"maxLoras": 2}}}
    )["spec"]
    assert spec["lora"] == {
        "adapters": adapters,
        "runtimeUpdates": False,
        "maxLoras": 1,
        "maxLoraRank": 16,
    }
    assert spec["decode"]["lora"] == {"maxLoras": 2}
    for lora, message in (
        ({"adapters": adapters * 2}, "adapter names must be unique"),
        ({"adapters": [{"name": "m", "source": "org/x"}]}, "served model's name"),
        ({"maxLoras": 4, "maxCpuLoras": 2}, "maxCpuLoras must be >= maxLoras"),
    ):
        manifest = {
            "apiVersion": "tandem.dev/v1alpha1",
            "kind": "ServingCluster",
            "metadata": {"name": "lora", "namespace": "default"},
            "spec": {**BARE, "lora": lora},
        }
        refused = crd_clients.kubectl(
            "create", "--dry-run=server", "-f", "-", stdin=json.dumps(manifest), check=False
        )
        assert refused.returncode != 0, refused.stdout
        assert message in refused.stderr, refused.stderr
