"""Configuration and discovery: CLI flags, static engine lists, Pod → engine, engine /metrics parsing."""

from __future__ import annotations

import pytest
from tandem_process import GOLDEN

from tandem.router.config import KubernetesDiscovery, RouterConfig
from tandem.router.discovery.kubernetes import engine_from_pod, label_selector, pool_owner_uids
from tandem.router.discovery.static import static_engines
from tandem.router.engine_metrics import parse_engine_load
from tandem.router.main import build_parser, config_from_args


def _config(*argv: str) -> RouterConfig:
    return config_from_args(build_parser().parse_args(list(argv)))


def test_flags_build_static_engines_with_kv_events() -> None:
    config = _config(
        "--model",
        "m",
        "--prefill",
        "http://p:8000",
        "--decode",
        "http://d:8000/",
        "--decode",
        "http://p:8000",
        "--worker",
        "http://w:8000",
        "--kv-events",
        "http://d:8000=tcp://d:5557,tcp://d:5558",
        "--prefix-weight",
        "5",
        "--disaggregation",
        "always",
        "--max-queue",
        "3",
        "--block-size",
        "32",
        "--connect-seconds",
        "4",
    )
    assert config.scoring.prefix_weight == 5
    assert config.timeouts.connect_s == 4
    assert config.disaggregation.mode == "always"
    assert config.admission.max_queue == 3
    engines = {e.url: e for e in static_engines(config.static)}  # type: ignore[arg-type]
    assert engines["http://p:8000"].colocated  # given as prefill and as decode
    assert engines["http://w:8000"].colocated
    assert engines["http://d:8000"].roles == {"decode"}
    assert engines["http://d:8000"].kv_events == "tcp://d:5557"
    assert engines["http://d:8000"].kv_events_replay == "tcp://d:5558"


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8000=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558",  # --kv-events' value
        "127.0.0.1:8000",
        "tcp://127.0.0.1:5557",
        "http://:8000",
    ],
)
def test_an_engine_url_that_is_not_http_is_refused_at_start(url: str) -> None:
    """Taken, it failed every request with a 500 (the port could not be parsed per request)."""
    with pytest.raises(ValueError, match="is not http\\(s\\)://HOST"):
        _config("--model", "m", "--worker", url)
    assert _config("--model", "m", "--worker", "http://[::1]:8000").static is not None


def test_bad_kv_events_flag_is_refused() -> None:
    with pytest.raises(SystemExit):
        _config("--model", "m", "--decode", "http://d:8000", "--kv-events", "http://d:8000")


def test_yaml_round_trip_keeps_aliases(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = _config("--model", "m", "--decode", "http://d:8000", "--load-bound-factor", "2")
    path = tmp_path / "router.yaml"
    path.write_text(config.to_yaml())
    assert "loadBoundFactor: 2.0" in path.read_text()
    again = _config("--config", str(path), "--port", "9000")
    assert again.port == 9000
    assert again.scoring.load_bound_factor == 2.0


def _pod(
    role: str = "decode",
    ip: str | None = "10.0.0.7",
    ready: str = "True",
    deleting: bool = False,
    owner: str = "rs-1",
) -> dict:
    metadata = {
        "name": "llama-decode-0",
        "namespace": "serving",
        "labels": {"tandem.dev/cluster": "llama", "tandem.dev/role": role},
        "ownerReferences": [{"kind": "ReplicaSet", "uid": owner, "controller": True}],
    }
    if deleting:
        metadata["deletionTimestamp"] = "2026-11-30T00:00:00Z"
    return {
        "metadata": metadata,
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": ready}]},
    }


def test_pod_to_engine() -> None:
    spec = KubernetesDiscovery(namespace="serving", clusterName="llama")
    assert label_selector("llama") == "tandem.dev/cluster=llama,tandem.dev/role in (prefill,decode)"
    owners = {"rs-1"}
    engine = engine_from_pod(_pod(), spec, owners)
    assert engine is not None
    assert engine.side_channel_port == 5600
    assert engine.url == "http://10.0.0.7:8000"
    assert engine.kv_events == "tcp://10.0.0.7:5557"
    assert engine.kv_events_replay == "tcp://10.0.0.7:5558"
    assert engine.roles == {"decode"}
    assert engine_from_pod(_pod(ready="False"), spec, owners) is None
    assert engine_from_pod(_pod(ip=None), spec, owners) is None
    assert engine_from_pod(_pod(deleting=True), spec, owners) is None
    assert engine_from_pod(_pod(role="router"), spec, owners) is None
    assert engine_from_pod(_pod(ip="fd00::7"), spec, owners).url == "http://[fd00::7]:8000"  # type: ignore[union-attr]
    assert engine_from_pod(_pod(owner="rs-stranger"), spec, owners) is None  # labels alone


def _owned(kind: str, name: str, uid: str, owner: dict[str, object] | None) -> dict:
    refs = [{**owner, "controller": True}] if owner else []
    return {"kind": kind, "metadata": {"name": name, "uid": uid, "ownerReferences": refs}}


def test_pool_owners_follow_the_servingcluster_chain() -> None:
    cluster = {"kind": "ServingCluster", "name": "llama", "uid": "sc-1"}
    deployments = [
        _owned("Deployment", "llama-decode", "d-1", cluster),
        _owned("Deployment", "llama-prefill", "p-1", cluster),
        _owned("Deployment", "llama-decode-copy", "x-1", cluster),  # not a pool's name
        _owned("Deployment", "llama-decode", "x-2", None),  # no ServingCluster controls it
    ]
    replica_sets = [
        _owned("ReplicaSet", "llama-decode-abc", "rs-1", {"kind": "Deployment", "uid": "d-1"}),
        _owned("ReplicaSet", "llama-prefill-def", "rs-2", {"kind": "Deployment", "uid": "p-1"}),
        _owned("ReplicaSet", "llama-decode-xyz", "rs-3", {"kind": "Deployment", "uid": "x-1"}),
        _owned("ReplicaSet", "llama-decode-uvw", "rs-4", {"kind": "Deployment", "uid": "x-2"}),
    ]
    assert pool_owner_uids("llama", deployments, replica_sets) == {"rs-1", "rs-2"}


def test_engine_load_from_vllm_metrics() -> None:
    text = b"""# HELP vllm:num_requests_waiting x
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 9.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
"""
    assert parse_engine_load(text) == {
        "waiting": 3.0, "running": 3.0, "kv_usage": 0.375, "kv_capacity": 0.0
    }  # fmt: skip


def test_kv_capacity_from_a_real_vllm_engines_cache_config() -> None:
    """vLLM 0.32's own /metrics (tests/fixtures): num_gpu_blocks · block_size, and no other
    label that ends in block_size (user_specified_block_size, mamba_block_size, ...) or starts
    with num_gpu_blocks (num_gpu_blocks_override) is read for them."""
    text = (GOLDEN / "pd" / "main" / "04_decode_metrics.txt").read_bytes()
    assert b'num_gpu_blocks="32768"' in text
    assert b'block_size="32"' in text
    assert parse_engine_load(text)["kv_capacity"] == 32768 * 32
    ranks = b"""vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="100"} 1.0
vllm:cache_config_info{block_size="None",engine="2",num_gpu_blocks="None"} 1.0
"""
    assert parse_engine_load(ranks)["kv_capacity"] == 3200
