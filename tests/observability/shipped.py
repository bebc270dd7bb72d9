"""What the chart ships, read back from its files: every dashboard query and every rule."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "tandem"
RULES = CHART / "rules" / "tandem.rules.yaml"
DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    ref: str
    expr: str
    repeat: str | None  # the variable the panel's row repeats over

    def __str__(self) -> str:
        return f"{self.dashboard} / {self.panel} / {self.ref}"


def panel_queries() -> Iterator[PanelQuery]:
    for path in DASHBOARDS:
        model = json.loads(path.read_text())
        repeat = None
        for panel in model["panels"]:
            if panel["type"] == "row":
                repeat = panel.get("repeat")
                continue
            for target in panel["targets"]:
                yield PanelQuery(
                    model["title"], panel["title"], target["refId"], target["expr"], repeat
                )


def rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]
