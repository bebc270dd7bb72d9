"""The chart's generated dashboards and rules: no drift from the code, valid for promtool, alerts
unit-tested with promtool, a runbook for every alert, and dashboards that Grafana can load."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from shipped import CHART, DASHBOARDS, ROOT, RULES, panel_queries, rules

from tandem.observability.generate import generated_files, stale_files
from tandem.observability.rules import AlertRule, LatencySLO, SLOs, rule_groups

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
DOCS = ROOT / "docs" / "observability.md"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    if not Path(PROMTOOL).is_file():
        pytest.fail("promtool not found: run scripts/ensure-prometheus.sh (Debian's prometheus)")
    return subprocess.run(
        [PROMTOOL, *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_chart_files_match_the_code() -> None:
    assert stale_files(CHART) == [], "run `python -m tandem.observability` and commit the result"
    assert {path.name for path in DASHBOARDS} == {
        path.name for path in generated_files() if path.suffix == ".json"
    }


def test_generator_check_mode_reports_drift(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "tandem.observability"]
    assert (
        subprocess.run(
            [*run, "--check", str(tmp_path)], capture_output=True, check=False
        ).returncode
        == 1
    )
    assert subprocess.run([*run, str(tmp_path)], capture_output=True, check=False).returncode == 0
    assert (
        subprocess.run(
            [*run, "--check", str(tmp_path)], capture_output=True, check=False
        ).returncode
        == 0
    )


def test_promtool_checks_the_rules() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout


def test_promtool_unit_tests_of_every_alert() -> None:
    tests = Path(__file__).with_name("alerts_test.yaml")
    result = promtool("test", "rules", str(tests))
    assert result.returncode == 0, result.stdout + result.stderr
    tested = {
        line.split(":", 1)[1].strip()
        for line in tests.read_text().splitlines()
        if line.strip().startswith("alertname:")
    }
    assert tested == {rule["alert"] for rule in rules() if "alert" in rule}


def test_every_alert_has_a_runbook_and_severity() -> None:
    docs = DOCS.read_text()
    for rule in rules():
        if "alert" in rule:
            assert f"### {rule['alert']}" in docs, f"docs/observability.md lacks {rule['alert']}"
            assert rule["labels"]["severity"] in {"critical", "warning"}
            assert rule["annotations"]["runbook_url"].endswith("#" + rule["alert"].lower())


def test_every_alert_names_its_probes() -> None:
    alerts = [r for g in rule_groups() for r in g.rules if isinstance(r, AlertRule)]
    assert all(alert.probes for alert in alerts)


def test_slo_thresholds_must_be_bucket_bounds() -> None:
    with pytest.raises(ValueError, match="bucket bound"):
        SLOs(ttft=LatencySLO(name="ttft", metric="m", threshold="0.8", objective=0.99))


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboards_are_grafana_models(path: Path) -> None:
    model = json.loads(path.read_text())
    assert model["uid"].startswith("tandem-")
    assert [v["name"] for v in model["templating"]["list"]][:3] == [
        "datasource",
        "namespace",
        "cluster",
    ]
    ids = [panel["id"] for panel in model["panels"]]
    assert len(ids) == len(set(ids))
    for panel in model["panels"]:
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["description"]
            assert [t["refId"] for t in panel["targets"]] == list(
                "ABCDEFGH"[: len(panel["targets"])]
            )


def test_every_panel_selects_one_cluster() -> None:
    for query in panel_queries():
        assert '$namespace"' in query.expr, query
        assert 'tandem_dev_cluster="$cluster"' in query.expr, query
        if query.repeat == "pod":
            assert 'pod="$pod"' in query.expr, query


def test_the_package_imports_no_other_component() -> None:
    """tandem.observability knows metric names only: it imports nothing else of Tandem."""
    package = ROOT / "tandem" / "observability"
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = (
                [alias.name for alias in node.names] if isinstance(node, ast.Import)
                else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            )  # fmt: skip
            for module in modules:
                assert not module.startswith("tandem.") or module.startswith(
                    "tandem.observability"
                ), f"{path.name} imports {module}"
