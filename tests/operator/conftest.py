"""Shared fixtures of the operator tests: example manifests as ServingCluster objects."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.operator.api import ServingCluster
from tandem.operator.manifest import load_manifest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def pd_cluster() -> ServingCluster:
    return load_manifest(EXAMPLES / "llama-8b-pd.yaml")


@pytest.fixture
def colocated_cluster() -> ServingCluster:
    return load_manifest(EXAMPLES / "llama-8b-colocated.yaml")
