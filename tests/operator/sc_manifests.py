"""Helpers building ServingCluster manifests for the operator tests."""

from __future__ import annotations

from typing import Any

from tandem.operator.api import ServingCluster
from tandem.operator.manifest import parse_manifest


def minimal(**spec: Any) -> dict[str, Any]:
    """A minimal manifest dict with `spec` fields merged in."""
    return {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "ServingCluster",
        "metadata": {"name": "m", "namespace": "ns"},
        "spec": {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}, **spec},
    }


def cluster(**spec: Any) -> ServingCluster:
    return parse_manifest(minimal(**spec))
