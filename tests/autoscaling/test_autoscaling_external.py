"""KEDA ScaledObject and autoscaling/v2 HPA renderings of a pool's policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tandem.operator.autoscaling.external import external_autoscalers, quantity
from tandem.operator.manifest import parse_manifest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llama-8b-pd.yaml"


def cluster(**autoscaling: Any) -> Any:
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["spec"]["autoscaling"].update({"enabled": True, **autoscaling})
    return parse_manifest(manifest)


def test_quantities() -> None:
    assert [quantity(v) for v in (0.8, 0.05, 4, 2.0, 0.85)] == ["800m", "50m", "4", "2", "850m"]


def test_hpas_are_valid_autoscaling_v2_with_the_policy_behavior() -> None:
    sc = cluster(
        decode={
            "min": 2,
            "max": 16,
            "targetITLSeconds": 0.05,
            "maxKVUsage": 0.85,
            "targetWaitingPerReplica": 4,
        }
    )
    hpas = external_autoscalers(sc, "hpa")
    assert [h["metadata"]["name"] for h in hpas] == [f"{sc.name}-prefill", f"{sc.name}-decode"]
    for hpa in hpas:
        kubernetes_validate.validate(hpa, "1.34", strict=True)
    prefill, decode = hpas
    assert prefill["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": f"{sc.name}-prefill",
    }
    assert prefill["spec"]["metrics"] == [
        {
            "type": "External",
            "external": {
                "metric": {
                    "name": "tandem_ttft_seconds",
                    "selector": {
                        "matchLabels": {"tandem_dev_cluster": sc.name, "tandem_dev_role": "prefill"}
                    },
                },
                "target": {"type": "Value", "value": "800m"},
            },
        }
    ]
    assert [m["type"] for m in decode["spec"]["metrics"]] == ["External", "Pods", "Pods"]
    assert (decode["spec"]["minReplicas"], decode["spec"]["maxReplicas"]) == (2, 16)
    behavior = decode["spec"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 300
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0
    assert {p["type"]: p["value"] for p in behavior["scaleUp"]["policies"]} == {
        "Percent": 100,
        "Pods": 4,
    }


def test_scaled_objects_carry_the_autoscaler_promql() -> None:
    sc = cluster(prometheusURL="http://prometheus.monitoring:9090", intervalSeconds=10)
    prefill, decode = external_autoscalers(sc, "keda")
    assert prefill["kind"] == "ScaledObject"
    assert prefill["spec"]["pollingInterval"] == 10
    [latency] = prefill["spec"]["triggers"]
    assert latency["metricType"] == "Value"
    assert latency["metadata"]["serverAddress"] == "http://prometheus.monitoring:9090"
    assert latency["metadata"]["threshold"] == "0.8"
    assert "histogram_quantile(0.9" in latency["metadata"]["query"]
    assert f'tandem_dev_cluster="{sc.name}"' in latency["metadata"]["query"]
    assert [t["metricType"] for t in decode["spec"]["triggers"]] == ["Value", "Value"]
    assert "kv_cache_usage_perc" in decode["spec"]["triggers"][1]["metadata"]["query"]


@pytest.mark.parametrize("provider", ["tandem", "none", ""])
def test_other_providers_render_nothing(provider: str) -> None:
    assert external_autoscalers(cluster(), provider) == []
    assert external_autoscalers(cluster(enabled=False), "keda") == []
