"""Invalid ServingClusters are refused by the real apiserver (CRD schema and CEL rules), with
messages that name the field."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.harness.podrunner import RunningPod
from e2e.harness.tools import Clients

pytestmark = pytest.mark.e2e

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "llama-8b-pd.yaml"
NAMESPACE = "admission"


def manifest(**spec_changes: Any) -> dict[str, Any]:
    body = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))
    body["metadata"] = {"name": "checked", "namespace": NAMESPACE}
    for dotted, value in spec_changes.items():
        node = body["spec"]
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return body


CASES = {
    "negative replicas": (
        manifest(prefill__replicas=-1),
        ["spec.prefill.replicas", "greater than or equal to 0"],
    ),
    "block size outside vLLM's choices": (
        manifest(engine__blockSize=12),
        ["spec.engine.blockSize", "Unsupported value: 12"],
    ),
    "unknown field": (
        manifest(decode__replcas=3),
        ['unknown field "spec.decode.replcas"'],
    ),
    "autoscaling bounds reversed": (
        manifest(autoscaling={"enabled": True, "decode": {"min": 4, "max": 2}}),
        ["spec.autoscaling.decode", "min must be <= max"],
    ),
    "missing model": (
        {**manifest(), "spec": {"prefill": {"replicas": 1}}},
        ["spec.model", "Required value"],
    ),
}


@pytest.fixture(scope="module")
def namespace(clients: Clients, tandem_release: RunningPod) -> str:
    clients.kubectl("create", "namespace", NAMESPACE)
    return NAMESPACE


@pytest.mark.parametrize(("body", "expected"), CASES.values(), ids=CASES.keys())
def test_invalid_manifest_is_refused_with_a_field_message(
    clients: Clients, namespace: str, body: dict[str, Any], expected: list[str]
) -> None:
    result = clients.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(body), check=False)
    assert result.returncode != 0, result.stdout
    for fragment in expected:
        assert fragment in result.stderr, result.stderr


def test_the_valid_example_passes_server_side_dry_run(clients: Clients, namespace: str) -> None:
    result = clients.kubectl(
        "apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(manifest())
    )
    assert "servingcluster.tandem.dev/checked created (server dry run)" in result.stdout
