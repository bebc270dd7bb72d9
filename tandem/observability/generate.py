"""The generated files the Helm chart ships: one JSON per dashboard and the rule file."""

from __future__ import annotations

from pathlib import Path

from tandem.observability.dashboards import DASHBOARDS, dashboard_json
from tandem.observability.rules import rules_yaml

DASHBOARDS_DIR = Path("dashboards")
RULES_FILE = Path("rules") / "tandem.rules.yaml"


def generated_files() -> dict[Path, str]:
    """{path relative to the chart: content}."""
    files = {DASHBOARDS_DIR / f"{name}.json": dashboard_json(name) for name in DASHBOARDS}
    files[RULES_FILE] = rules_yaml()
    return files


def stale_files(chart: Path) -> list[Path]:
    """Generated files that are missing from `chart` or differ from what the code generates."""
    return [
        path
        for path, content in generated_files().items()
        if not (chart / path).is_file() or (chart / path).read_text() != content
    ]


def write(chart: Path) -> list[Path]:
    written = []
    for path, content in generated_files().items():
        (chart / path).parent.mkdir(parents=True, exist_ok=True)
        (chart / path).write_text(content)
        written.append(chart / path)
    return written
