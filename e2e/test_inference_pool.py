"""The InferencePool the operator renders, as a real kube-apiserver takes it.

The InferencePool CRD is tests/fixtures/gie/inferencepool-crd.yaml: a minimal CRD written from
the Gateway API Inference Extension's v1 API types (the project's own CRD is not vendored here).
Each rendered InferencePool goes through `kubectl create --dry-run=server`: the server validates
it against that schema and answers with the object as it would store it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.harness.kube import crd_established, eventually
from e2e.harness.tools import Clients
from tandem.operator.manifest import parse_manifest
from tandem.operator.render import render

pytestmark = pytest.mark.e2e

CRD = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "gie" / "inferencepool-crd.yaml"


@pytest.fixture(scope="module")
def pool_clients(crd_clients: Clients, api_server: Any) -> Clients:
    crd_clients.kubectl("apply", "-f", str(CRD))
    name = yaml.safe_load(CRD.read_text())["metadata"]["name"]
    api = api_server.api_client()
    eventually(lambda: crd_established(api, name), timeout_s=30, what=f"CRD {name} established")
    return crd_clients


def server_dry_run(clients: Clients, obj: dict[str, Any]) -> dict[str, Any]:
    created = clients.kubectl(
        "create", "--dry-run=server", "-o", "json", "-f", "-", stdin=json.dumps(obj)
    )
    answer: dict[str, Any] = json.loads(created.stdout)
    return answer


@pytest.mark.parametrize("mode", ["auto", "never"])
def test_rendered_pool_is_accepted_as_written(pool_clients: Clients, mode: str) -> None:
    manifest = {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "ServingCluster",
        "metadata": {"name": "gie", "namespace": "default"},
        "spec": {
            "model": {"name": "m"},
            "router": {"disaggregation": {"mode": mode}},
            "inferencePool": {"enabled": True, "failureMode": "FailOpen"},
        },
    }
    # the ServingCluster's own CRD takes the new section, defaults filled in
    stored = server_dry_run(pool_clients, manifest)
    assert stored["spec"]["inferencePool"]["eppPort"] == 9002
    (pool,) = [o for o in render(parse_manifest(manifest)) if o["kind"] == "InferencePool"]
    answer = server_dry_run(pool_clients, pool)
    assert answer["spec"] == pool["spec"]


def test_schema_refuses_what_the_api_types_refuse(pool_clients: Clients) -> None:
    pool = {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "bad", "namespace": "default"},
        "spec": {
            "selector": {"matchLabels": {"app": "x"}},
            "targetPorts": [{"number": 8000}],
            "endpointPickerRef": {"name": "epp", "port": {"number": 9002}, "failureMode": "Maybe"},
        },
    }
    refused = pool_clients.kubectl(
        "create", "--dry-run=server", "-f", "-", stdin=json.dumps(pool), check=False
    )
    assert refused.returncode != 0
    assert "failureMode" in refused.stderr
