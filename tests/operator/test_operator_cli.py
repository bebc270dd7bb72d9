"""`tandem render` and `tandem crd` as a user runs them: output, exit codes, messages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from sc_manifests import minimal

from tandem.operator.cli import render_main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def tandem(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.timeout(60)
def test_render_example_prints_objects() -> None:
    result = tandem("render", str(EXAMPLES / "llama-8b-pd.yaml"))
    assert result.returncode == 0, result.stderr
    objects = list(yaml.safe_load_all(result.stdout))
    deployments = {o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"}
    assert deployments == {"llama-8b-prefill", "llama-8b-decode", "llama-8b-router"}


@pytest.mark.timeout(60)
def test_bad_input_exits_non_zero_naming_fields(tmp_path: Path) -> None:
    document = minimal(prefill={"replicas": -1}, autoscaling={"decode": {"min": 5, "max": 2}})
    document["spec"]["engine"] = {"kvConnector": "MooncakeConnector"}
    del document["spec"]["model"]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(document))
    result = tandem("render", str(path))
    assert result.returncode == 1
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    for field in (
        "spec.model",
        "spec.prefill.replicas",
        "spec.autoscaling.decode.min",
        "spec.engine.kvConnector",
    ):
        assert field in result.stderr


def test_render_json_and_namespace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    document = minimal()
    del document["metadata"]["namespace"]
    path = tmp_path / "sc.yaml"
    path.write_text(yaml.safe_dump(document))
    assert render_main([str(path), "-o", "json", "-n", "serving"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["kind"] == "List"
    assert {o["metadata"]["namespace"] for o in listing["items"]} == {"serving"}


def test_missing_file_is_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert render_main(["/nonexistent/sc.yaml"]) == 1
    assert "cannot read" in capsys.readouterr().err
