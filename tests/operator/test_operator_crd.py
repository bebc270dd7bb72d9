"""The CRD in crds/ is generated from the models, structural, with CEL rules and columns.

The real kube-apiserver fills in its defaults in e2e/test_crd_defaults.py and applies its schema
and rules to invalid objects in e2e/test_admission.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tandem.operator.crd import CRD_FILE, crd_yaml, custom_resource_definition, openapi_schema

ROOT = Path(__file__).resolve().parents[2]


def walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found = [(path, node)]
    for key, child in node.get("properties", {}).items():
        found += walk(child, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        found += walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        found += walk(node["additionalProperties"], f"{path}{{}}")
    return found


@pytest.mark.parametrize("folder", ["crds", "charts/tandem/crds"])
def test_crds_folder_matches_the_models(folder: str) -> None:
    on_disk = (ROOT / folder / CRD_FILE).read_text()
    assert on_disk == crd_yaml(), (
        f"{folder}/ drifted from the models: run `tandem crd > {folder}/{CRD_FILE}`"
    )
    assert [p.name for p in (ROOT / folder).iterdir()] == [CRD_FILE]


def test_schema_is_structural() -> None:
    for path, node in walk(openapi_schema()):
        assert not {"$ref", "anyOf", "allOf", "oneOf", "const", "title"} & node.keys(), path
        typed = (
            "type" in node
            or node.get("x-kubernetes-int-or-string")
            or node.get("x-kubernetes-preserve-unknown-fields")
        )
        assert typed, f"{path} has no type"
        if "properties" in node:
            assert "additionalProperties" not in node, path
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            assert node.get(bound, True) is True, path


def test_every_spec_field_is_described() -> None:
    spec = openapi_schema()["properties"]["spec"]
    missing = [
        path
        for path, node in walk(spec)
        if path and "description" not in node and not path.endswith(("[]", "{}"))
    ]
    assert missing == []


def test_cel_rules_are_present() -> None:
    rules = {
        (path, rule["rule"]): rule
        for path, node in walk(openapi_schema())
        for rule in node.get("x-kubernetes-validations", [])
    }
    paths = {path for path, _ in rules}
    assert ".spec.autoscaling.prefill" in paths
    assert ".spec.autoscaling.decode" in paths
    assert ".spec" in paths
    assert "" in paths  # metadata.name length and format
    min_max = rules[(".spec.autoscaling.prefill", "self.min <= self.max")]
    assert min_max["fieldPath"] == ".min"
    assert "min must be <= max" in min_max["message"]


def test_replica_and_connector_constraints_are_in_the_schema() -> None:
    spec = openapi_schema()["properties"]["spec"]["properties"]
    assert spec["prefill"]["properties"]["replicas"]["minimum"] == 0
    assert spec["decode"]["properties"]["replicas"]["minimum"] == 0
    assert spec["engine"]["properties"]["kvConnector"]["enum"] == ["NixlConnector"]
    assert "model" in openapi_schema()["properties"]["spec"]["required"]
    assert "name" in spec["model"]["required"]


def test_crd_shape() -> None:
    crd = custom_resource_definition()
    assert crd["metadata"]["name"] == "servingclusters.tandem.dev"
    names = crd["spec"]["names"]
    assert names["shortNames"] == ["sc", "tsc"]
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1"
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert columns["Prefill"]["jsonPath"] == ".status.prefill.summary"
    assert columns["Decode"]["jsonPath"] == ".status.decode.summary"
    assert columns["Phase"]["jsonPath"] == ".status.phase"
    assert columns["Age"]["type"] == "date"


@pytest.mark.timeout(60)
def test_tandem_crd_prints_it() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "crd"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert yaml.safe_load(result.stdout) == custom_resource_definition()


def test_api_reference_matches_the_models() -> None:
    from tandem.operator.apidoc import api_reference_markdown

    assert (ROOT / "docs" / "api.md").read_text() == api_reference_markdown(), (
        "docs/api.md drifted from the models: run `tandem crd --docs > docs/api.md`"
    )
