"""The repository, its Python package, the chart and the image all say they are Apache-2.0."""

from __future__ import annotations

import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_the_repository_chart_and_image_say_their_license() -> None:
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text
    assert "Version 2.0, January 2004" in license_text
    assert (ROOT / "charts" / "tandem" / "LICENSE").read_text() == license_text
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert (project["license"], project["license-files"]) == ("Apache-2.0", ["LICENSE"])
    chart = yaml.safe_load((ROOT / "charts" / "tandem" / "Chart.yaml").read_text())
    assert chart["annotations"]["artifacthub.io/license"] == "Apache-2.0"
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'org.opencontainers.image.licenses="Apache-2.0"' in dockerfile
    assert "COPY --from=build /src/LICENSE /licenses/LICENSE" in dockerfile
