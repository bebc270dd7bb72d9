"""ServingCluster API models: defaults, validation messages with field paths, manifest loading."""

from __future__ import annotations

from pathlib import Path

import pytest
from sc_manifests import cluster, minimal

from tandem.operator.api import ServingCluster, pool_replicas
from tandem.operator.manifest import ManifestError, load_manifest, parse_manifest


def problems_of(document: object) -> list[str]:
    with pytest.raises(ManifestError) as caught:
        parse_manifest(document)
    return caught.value.problems


def test_defaults_fit_an_8b_model_on_one_gpu_per_pod() -> None:
    sc = cluster()
    spec = sc.spec
    assert spec.model.served_model_name == "meta-llama/Llama-3.1-8B-Instruct"
    assert (spec.prefill.replicas, spec.decode.replicas, spec.router.replicas) == (1, 1, 1)
    assert spec.prefill.tensor_parallel_size == spec.decode.tensor_parallel_size == 1
    assert spec.engine.kv_connector == "NixlConnector"
    assert spec.engine.block_size == 16
    assert spec.engine.hash_algo == "sha256_cbor"
    assert spec.engine.hash_seed == "0"
    assert spec.router.disaggregation.mode == "auto"
    assert spec.autoscaling.enabled is False
    assert sc.namespace == "ns"


def test_examples_load(pd_cluster: ServingCluster, colocated_cluster: ServingCluster) -> None:
    assert pd_cluster.name == "llama-8b"
    assert (pd_cluster.spec.prefill.replicas, pd_cluster.spec.decode.replicas) == (2, 2)
    assert pd_cluster.spec.router.replicas == 1
    assert pd_cluster.spec.router.disaggregation.mode == "auto"
    assert colocated_cluster.spec.prefill.replicas == 0
    assert colocated_cluster.spec.router.disaggregation.mode == "never"


def test_camel_case_round_trip() -> None:
    sc = cluster(prefill={"replicas": 3, "maxNumBatchedTokens": 4096})
    dumped = sc.model_dump(by_alias=True, exclude_none=True)
    assert dumped["spec"]["prefill"]["maxNumBatchedTokens"] == 4096
    assert parse_manifest(dumped) == sc


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"prefill": {"replicas": -1}}, "spec.prefill.replicas: must be >= 0 (got -1)"),
        ({"decode": {"replicas": -3}}, "spec.decode.replicas: must be >= 0 (got -3)"),
        (
            {"autoscaling": {"prefill": {"min": 4, "max": 2}}},
            "spec.autoscaling.prefill.min: min must be <= max",
        ),
        (
            {"autoscaling": {"decode": {"min": 9, "max": 3}}},
            "spec.autoscaling.decode.min: min must be <= max",
        ),
        (
            {"engine": {"kvConnector": "LMCacheConnectorV1"}},
            "spec.engine.kvConnector: unsupported value",
        ),
        ({"engine": {"blockSize": 17}}, "spec.engine.blockSize: unsupported value 17"),
        (
            {"decode": {"speculative": {"method": "eagle"}}},
            "spec.decode.speculative.model: a draft model is required",
        ),
        (
            {"decode": {"rollout": {"maxSurge": 0, "maxUnavailable": "0%"}}},
            "spec.decode.rollout.maxUnavailable:",
        ),
        (
            {"prefill": {"replicas": 0}, "router": {"disaggregation": {"mode": "always"}}},
            "spec.prefill.replicas: disaggregation mode always needs at least one prefill replica",
        ),
        ({"prefill": {"gpus": 1}}, "spec.prefill.gpus: unknown field"),
    ],
)
def test_invalid_specs_name_the_field(spec: dict[str, object], expected: str) -> None:
    problems = problems_of(minimal(**spec))
    assert any(p.startswith(expected) for p in problems), problems


def test_missing_model_is_refused() -> None:
    document = minimal()
    del document["spec"]["model"]
    assert problems_of(document) == ["spec.model: required field is missing"]
    document["spec"]["model"] = {"servedName": "x"}
    assert problems_of(document) == ["spec.model.name: required field is missing"]


def test_every_problem_is_reported_at_once() -> None:
    problems = problems_of(minimal(prefill={"replicas": -1}, engine={"kvConnector": "X"}))
    assert len(problems) == 2


def test_bad_names_are_refused() -> None:
    document = minimal()
    document["metadata"]["name"] = "Llama_8B"
    assert problems_of(document)[0].startswith("metadata.name:")
    document["metadata"]["name"] = "a" * 53
    assert problems_of(document)[0].startswith("metadata.name:")


def test_not_an_object() -> None:
    assert problems_of(["a"])[0].startswith("(root): expected a ServingCluster object")


def test_load_manifest_errors(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="cannot read"):
        load_manifest(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("spec: [\n")
    with pytest.raises(ManifestError, match="not valid YAML"):
        load_manifest(tmp_path / "bad.yaml")
    (tmp_path / "empty.yaml").write_text("---\n")
    with pytest.raises(ManifestError, match="no object"):
        load_manifest(tmp_path / "empty.yaml")


def test_load_manifest_picks_the_serving_cluster_of_a_multi_document_file(tmp_path: Path) -> None:
    import yaml

    docs = [{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-token"}}, minimal()]
    (tmp_path / "multi.yaml").write_text(yaml.safe_dump_all(docs))
    assert load_manifest(tmp_path / "multi.yaml").name == "m"


def test_pool_replicas_follow_autoscaling() -> None:
    off = cluster(prefill={"replicas": 20})
    assert pool_replicas(off, "prefill") == 20
    on = cluster(prefill={"replicas": 20}, decode={"replicas": 0}, autoscaling={"enabled": True})
    assert pool_replicas(on, "prefill") == 8  # clamped to max
    assert pool_replicas(on, "decode") == 1  # clamped to min
    decided = parse_manifest(
        {
            **minimal(autoscaling={"enabled": True}),
            "status": {"autoscaling": {"prefill": {"replicas": 5}}},
        }
    )
    assert pool_replicas(decided, "prefill") == 5
    assert pool_replicas(decided, "decode") == 1


def test_an_unreadable_status_does_not_block_the_object() -> None:
    document = {**minimal(), "status": {"phase": "Exploded", "conditions": "nope"}}
    assert parse_manifest(document).status.phase is None
