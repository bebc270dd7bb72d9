"""The Helm chart: lint, rendered objects validated against Kubernetes 1.34's schemas, RBAC scope."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from e2e.harness.tools import Clients
from tandem.operator.kinds import CHILD_KINDS
from tandem.operator.manifest import parse_manifest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "tandem"
KUBERNETES_SCHEMA_VERSION = "1.34"
VALUE_SETS: dict[str, list[str]] = {
    "defaults": [],
    "namespaced": ["--set", "operator.watchNamespaces={serving,research}"],
    "everything": [
        "--set", "serviceMonitor.enabled=true",
        "--set", "example.enabled=true",
        "--set", "operator.verbose=true",
        "--set", "serviceAccount.annotations.team=ml",
        "--set", "prometheusRule.enabled=true",
        "--set", "operator.metrics.serviceMonitor.enabled=true",
    ],
    "peers": ["--set", "operator.replicas=3"],
    "namespaced-peers": [
        "--set", "operator.replicas=2", "--set", "operator.watchNamespaces={serving,research}",
    ],
}  # fmt: skip


def template(clients: Clients, *args: str) -> list[dict[str, Any]]:
    out = clients.helm("template", "tandem", str(CHART), "--namespace", "tandem-system", *args)
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_lint_is_clean(offline_clients: Clients, values: list[str]) -> None:
    result = offline_clients.helm("lint", "--strict", str(CHART), *values)
    assert "0 chart(s) failed" in result.stdout
    assert "[WARNING]" not in result.stdout, result.stdout
    assert "[ERROR]" not in result.stdout, result.stdout


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_rendered_objects_are_valid_kubernetes(offline_clients: Clients, values: list[str]) -> None:
    docs = template(offline_clients, "--include-crds", *values)
    for doc in docs:
        if doc["apiVersion"].startswith(("monitoring.coreos.com/", "tandem.dev/")):
            continue  # custom resources: checked by their CRDs at install time
        kubernetes_validate.validate(doc, KUBERNETES_SCHEMA_VERSION, strict=True)


def test_chart_crd_is_the_generated_crd(offline_clients: Clients) -> None:
    [crd] = by_kind(template(offline_clients, "--include-crds"), "CustomResourceDefinition")
    generated = yaml.safe_load((ROOT / "crds" / "tandem.dev_servingclusters.yaml").read_text())
    assert crd == generated
    printed = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "crd"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    assert yaml.safe_load(printed.stdout) == generated, (
        "crds/ is stale: regenerate with `tandem crd`"
    )


def test_operator_deployment_is_hardened(offline_clients: Clients) -> None:
    [deployment] = by_kind(template(offline_clients), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["command"] == ["tandem", "operator"]
    assert "--all-namespaces" in container["args"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["path"] == "/healthz"
    assert container["resources"]["requests"]
    assert container["resources"]["limits"]
    assert pod["serviceAccountName"] == "tandem"
    assert deployment["spec"]["strategy"]["type"] == "Recreate"


def _granted(rules: list[dict[str, Any]]) -> dict[tuple[str, str], set[str]]:
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    return granted


def test_rbac_grants_what_the_operator_does_and_no_wildcards(offline_clients: Clients) -> None:
    roles = {r["metadata"]["name"]: r for r in by_kind(template(offline_clients), "ClusterRole")}
    assert set(roles) == {"tandem", "tandem-crd-reader"}
    assert _granted(roles["tandem-crd-reader"]["rules"]) == {
        ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"}
    }
    granted = _granted(roles["tandem"]["rules"])
    assert not any("*" in verbs or "*" in key for key, verbs in granted.items())
    external = {"HorizontalPodAutoscaler", "ScaledObject"}
    for kind in CHILD_KINDS:
        verbs = granted.get((kind.group, kind.plural), set())
        if kind.kind in external:
            assert not verbs, f"{kind.kind} granted although rbac.externalAutoscalers is off"
        else:
            assert {"create", "patch", "list", "delete"} <= verbs, f"{kind.kind}: {verbs}"
    assert {"list", "watch", "patch"} <= granted[("tandem.dev", "servingclusters")]
    assert granted[("tandem.dev", "servingclusters/status")] == {"patch"}
    # Pods: read, and patched for their pod-deletion-cost annotation (cache-aware scale-down).
    assert granted[("", "pods")] == {"get", "list", "watch", "patch"}
    # Secrets: created (the engine key, dry-run existence probes), never read.
    assert granted[("", "secrets")] == {"create"}
    assert ("", "nodes") not in granted
    assert ("", "pods/exec") not in granted


def test_external_autoscaler_rules_only_when_enabled(offline_clients: Clients) -> None:
    docs = template(offline_clients, "--set", "rbac.externalAutoscalers=true")
    [role] = [r for r in by_kind(docs, "ClusterRole") if r["metadata"]["name"] == "tandem"]
    granted = _granted(role["rules"])
    assert {"create", "patch", "list", "delete"} <= granted[
        ("autoscaling", "horizontalpodautoscalers")
    ]
    assert {"create", "patch", "list", "delete"} <= granted[("keda.sh", "scaledobjects")]


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_rendered_rules_are_the_rules_file(offline_clients: Clients, values: list[str]) -> None:
    """The one source: every Role/ClusterRole of the operator carries exactly the rules of
    files/operator-rules.yaml whose `when` value is on (the docs table is checked against the
    same file by tests/operator/test_operator_permissions.py)."""
    rules = yaml.safe_load((CHART / "files" / "operator-rules.yaml").read_text())["rules"]
    switches = {
        "networkPolicies": True,
        "monitoring": True,
        "externalAutoscalers": False,
        "inferencePools": True,
    }
    expected = [
        {k: rule[k] for k in ("apiGroups", "resources", "verbs")}
        for rule in rules
        if not rule.get("when") or switches[rule["when"]]
    ]
    docs = template(offline_clients, *values)
    operator_roles = [
        r for r in by_kind(docs, "ClusterRole") + by_kind(docs, "Role")
        if not r["metadata"]["name"].endswith("crd-reader")
    ]  # fmt: skip
    assert operator_roles
    for role in operator_roles:
        assert role["rules"] == expected, role["metadata"]


def test_watching_namespaces_uses_roles_only(offline_clients: Clients) -> None:
    docs = template(offline_clients, *VALUE_SETS["namespaced"])
    # Only reading CRDs is cluster-wide; everything else is granted per namespace.
    assert [r["metadata"]["name"] for r in by_kind(docs, "ClusterRole")] == ["tandem-crd-reader"]
    assert sorted(r["metadata"]["namespace"] for r in by_kind(docs, "Role")) == [
        "research",
        "serving",
    ]
    [deployment] = by_kind(docs, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=serving" in args
    assert "--namespace=research" in args
    assert "--all-namespaces" not in args


def test_values_schema_refuses_bad_values(offline_clients: Clients) -> None:
    for bad in (
        "operator.healthPort=0",
        "image.pullPolicy=Sometimes",
        "operator.watchNamespaces={Bad_NS}",
        "unknownKey=1",
    ):
        result = offline_clients.helm("template", "tandem", str(CHART), "--set", bad, check=False)
        assert result.returncode != 0, bad
        assert "values don't meet the specifications of the schema" in result.stderr, result.stderr


def test_example_servingcluster_is_a_valid_object(offline_clients: Clients) -> None:
    [example] = by_kind(template(offline_clients, *VALUE_SETS["everything"]), "ServingCluster")
    cluster = parse_manifest(example)
    assert cluster.namespace == "tandem-system"
    assert cluster.spec.prefill.replicas == 1


def test_operator_replicas_peer(offline_clients: Clients) -> None:
    """replicas > 1: kopf peering under the release's name, its CRDs and RBAC, a PDB, spread."""
    docs = template(offline_clients, "--set", "operator.replicas=2")
    [deployment] = by_kind(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert "--peering=tandem" in container["args"]
    assert "--peering-lifetime=15" in container["args"]
    assert pod["affinity"]["podAntiAffinity"]
    [pdb] = by_kind(docs, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    crds = {c["spec"]["names"]["kind"] for c in by_kind(docs, "CustomResourceDefinition")}
    assert crds == {"ClusterKopfPeering", "KopfPeering"}
    # The peering rule is one of files/operator-rules.yaml's (granted at any replica count).
    rules = [r for role in by_kind(docs, "ClusterRole") for r in role["rules"]]
    assert {"apiGroups": ["kopf.dev"], "resources": ["clusterkopfpeerings", "kopfpeerings"],
            "verbs": ["get", "list", "watch", "create", "patch"]} in rules  # fmt: skip
    single = template(offline_clients)
    assert not by_kind(single, "PodDisruptionBudget")
    [deployment] = by_kind(single, "Deployment")
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    assert not [a for a in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
                if a.startswith("--peering")]  # fmt: skip
