"""The operator's permissions have one source, charts/tandem/files/operator-rules.yaml: the chart's
Roles are rendered from it (e2e/test_chart.py checks the rendered objects) and docs/security.md's
table must be the one printed here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "charts" / "tandem" / "files" / "operator-rules.yaml"
SECURITY_DOC = ROOT / "docs" / "security.md"


def operator_rules() -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = yaml.safe_load(RULES.read_text())["rules"]
    return rules


def permission_table(rules: list[dict[str, Any]]) -> str:
    lines = ["| API group | resources | verbs | granted | why |", "| --- | --- | --- | --- | --- |"]
    for rule in rules:
        groups = ", ".join(g or "core" for g in rule["apiGroups"])
        granted = f"`rbac.{rule['when']}: true`" if rule.get("when") else "always"
        lines.append(
            f"| {groups} | {', '.join(rule['resources'])} | {', '.join(rule['verbs'])} "
            f"| {granted} | {rule['why']} |"
        )
    return "\n".join(lines) + "\n"


def test_security_doc_has_the_permission_table_of_the_chart() -> None:
    table = permission_table(operator_rules())
    assert table in SECURITY_DOC.read_text(), (
        f"docs/security.md's permission table drifted from {RULES.name}; it should contain:\n{table}"
    )


def test_rules_never_read_secrets_or_exec_or_use_wildcards() -> None:
    for rule in operator_rules():
        assert "*" not in rule["verbs"], rule
        assert "*" not in rule["resources"], rule
        assert not {"pods/exec", "pods/attach", "pods/portforward"} & set(rule["resources"])
        if "secrets" in rule["resources"]:
            assert rule["verbs"] == ["create"], rule
        assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), rule
