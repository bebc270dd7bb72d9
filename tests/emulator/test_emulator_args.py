"""The command line takes `vllm serve` arguments unchanged; endpoint binding follows vLLM."""

from __future__ import annotations

import json

import pytest

from tandem.emulator.args import parse_args
from tandem.emulator.kv_events import resolve_endpoint

pytestmark = pytest.mark.timeout(30)


def test_rendered_vllm_arguments_parse() -> None:
    argv = [
        "serve",
        "meta-llama/Llama-3.1-8B-Instruct",
        "--served-model-name",
        "llama-8b",
        "--port",
        "8000",
        "--block-size",
        "16",
        "--enable-prefix-caching",
        "--prefix-caching-hash-algo",
        "sha256_cbor",
        "--kv-transfer-config",
        json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_producer"}),
        "--kv-events-config",
        json.dumps(
            {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": "tcp://*:5557",
                "topic": "kv-events",
            }
        ),
        "--tensor-parallel-size",
        "2",
        "--max-num-batched-tokens",
        "4096",
        "--long-prefill-token-threshold",
        "1024",
        "--dtype",
        "bfloat16",
        "--enforce-eager",
        "--gpu-memory-utilization",
        "0.9",
        "--max_model_len",
        "32k",
    ]
    config, ignored, _ = parse_args(argv)
    assert config.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert config.served_model_name == "llama-8b"
    assert config.prefix_caching_hash_algo == "sha256_cbor"
    assert config.kv_role == "kv_producer"
    assert config.kv_events_config is not None
    assert config.kv_events_config.topic == "kv-events"
    assert config.tensor_parallel_size == 2
    assert config.max_num_batched_tokens == 4096
    assert config.long_prefill_token_threshold == 1024
    assert config.max_model_len == 32 * 1000
    assert config.gpu_memory_utilization == 0.9
    assert ignored == ["--dtype", "bfloat16", "--enforce-eager"]


def test_model_flag_and_disabling_prefix_caching() -> None:
    config, _, _ = parse_args(["--model", "m", "--no-enable-prefix-caching", "--speedup", "4"])
    assert config.model == "m"
    assert not config.enable_prefix_caching
    assert config.speedup == 4


@pytest.mark.parametrize(
    ("endpoint", "bind_host", "expected"),
    [
        ("tcp://*:5557", None, ("tcp://*:5557", True)),
        ("tcp://127.0.0.1:5557", None, ("tcp://127.0.0.1:5557", False)),  # vLLM connects
        ("tcp://*:5557", "127.0.1.5", ("tcp://127.0.1.5:5557", True)),
        ("tcp://127.0.1.5:5557", "127.0.1.5", ("tcp://127.0.1.5:5557", True)),
        ("ipc:///tmp/x", None, ("ipc:///tmp/x", True)),
    ],
)
def test_kv_event_endpoint_binding(
    endpoint: str, bind_host: str | None, expected: tuple[str, bool]
) -> None:
    assert resolve_endpoint(endpoint, bind_host) == expected


def test_api_key_from_the_environment_as_vllm_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM takes VLLM_API_KEY when --api-key is absent (how Tandem hands engines their key,
    keeping it off the command line); an explicit --api-key wins."""
    base = ["--model", "tiny"]
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert parse_args(base)[0].api_key is None
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert parse_args(base)[0].api_key == "from-env"
    assert parse_args([*base, "--api-key", "explicit"])[0].api_key == "explicit"
