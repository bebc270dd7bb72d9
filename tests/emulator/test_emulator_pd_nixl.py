"""P/D with two emulator processes: decode pulls the prompt's KV bytes from prefill through NIXL.

Replays golden/pd: the prefill response's kv_transfer_params, the decode stream, and what vLLM
does with wrong or stale params (error event + [DONE] when streaming, 500 otherwise).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest
from emu_harness import (
    TINY_ARGS,
    Emulator,
    emulator,
    golden_json,
    metric_value,
    shape,
)

from tandem.common.ports import free_port

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(90)]

LEASE_S = 2
PROMPT = (
    "Request 1: the quick brown fox jumps over the lazy dog. hello world this is a tiny tokenizer "
    "for testing vllm 1. The lazy dog sleeps while the quick brown fox jumps over it again."
)
ENGINE_ARGS = TINY_ARGS  # launched like golden/pd's engines (tiny model, block size 32)


def kv_config(role: str, **fields: Any) -> str:
    return json.dumps(
        {
            "kv_connector": "NixlConnector",
            "kv_role": role,
            "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"kv_lease_duration": LEASE_S},
            **fields,
        }
    )


@contextlib.contextmanager
def pd_engines(
    extra: Sequence[str], decode_extra: Sequence[str] = (), decode_kv: dict[str, Any] | None = None
) -> Iterator[tuple[Emulator, Emulator]]:
    """A prefill and a decode emulator, each with its own NIXL side-channel port."""
    envs = [
        {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
        }
        for _ in range(2)
    ]
    with (
        emulator(
            [*ENGINE_ARGS, *extra, "--kv-transfer-config", kv_config("kv_producer")], envs[0]
        ) as prefill,
        emulator(
            [
                *ENGINE_ARGS,
                *extra,
                *decode_extra,
                "--kv-transfer-config",
                kv_config("kv_consumer", **(decode_kv or {})),
            ],
            envs[1],
        ) as decode,
    ):
        yield prefill, decode


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Emulator, Emulator]]:
    with pd_engines([], ["--kv-handshake-timeout", "1"]) as engines:
        yield engines


def do_prefill(prefill: Emulator, prompt: str = PROMPT) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 1,
        "stream": False,
        "temperature": 0,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }
    r = httpx.post(prefill.url + "/v1/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json())


def do_decode(
    decode: Emulator, params: dict[str, Any], stream: bool = True, prompt: str = PROMPT
) -> httpx.Response:
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "stream": stream,
        "kv_transfer_params": params,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return httpx.post(decode.url + "/v1/completions", json=body, timeout=30)


def metrics(engine: Emulator) -> str:
    return httpx.get(engine.url + "/metrics").text


def test_prefill_returns_vllm_kv_transfer_params(pair: tuple[Emulator, Emulator]) -> None:
    prefill, _ = pair
    body = do_prefill(prefill)
    golden = golden_json("pd", "main", "01_prefill.json")["response"]["body"]  # type: ignore[index]
    assert shape(body) == shape(golden)
    params = body["kv_transfer_params"]
    assert list(params) == list(golden["kv_transfer_params"])  # type: ignore[index]
    assert params["remote_host"] == "127.0.0.1"
    assert params["remote_num_tokens"] == body["usage"]["prompt_tokens"]
    assert len(params["remote_block_ids"][0]) == -(-params["remote_num_tokens"] // 32)
    assert params["remote_request_id"].startswith(body["id"] + "-0-")


def test_decode_pulls_real_bytes_through_nixl(pair: tuple[Emulator, Emulator]) -> None:
    prefill, decode = pair
    before = metrics(decode)
    params = do_prefill(prefill)["kv_transfer_params"]
    assert (
        metric_value(metrics(prefill), "vllm:kv_cache_usage_perc") > 0
    )  # blocks held by the lease
    r = do_decode(decode, params)
    assert r.status_code == 200
    events = [e[len("data: ") :] for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == 8
    golden = [e[len("data: ") :] for e in golden_sse("02_decode_stream.sse").split("\n\n") if e]
    chunks, golden_chunks = (
        [json.loads(e) for e in events[:-1]],
        [json.loads(e) for e in golden[:-1]],
    )
    assert shape(chunks[0]) == shape(golden_chunks[0])
    assert shape(chunks[-2]) == shape(golden_chunks[-2])  # the finish chunk
    assert shape(chunks[-1]) == shape(golden_chunks[-1])  # the usage chunk
    after = metrics(decode)
    pulled = metric_value(after, "vllm:nixl_bytes_transferred_sum") - metric_value(
        before, "vllm:nixl_bytes_transferred_sum"
    )
    assert pulled > 0
    external = 'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="external_kv_transfer"}'
    assert (
        metric_value(after, external) - metric_value(before, external)
        == params["remote_num_tokens"]
    )
    # the decode's read notification releases the prefill's blocks
    deadline = time.monotonic() + 5
    while metric_value(metrics(prefill), "vllm:kv_cache_usage_perc") > 0:
        assert time.monotonic() < deadline, "prefill kept the blocks after the read"
        time.sleep(0.05)


def test_decode_pulls_only_blocks_it_does_not_have(pair: tuple[Emulator, Emulator]) -> None:
    prefill, decode = pair
    prompt = PROMPT + " A second request shares the first blocks of this prompt."
    params = do_prefill(prefill, prompt)["kv_transfer_params"]
    before = metrics(decode)
    assert do_decode(decode, params, prompt=prompt).status_code == 200
    after = metrics(decode)
    pulled = metric_value(after, "vllm:nixl_bytes_transferred_sum") - metric_value(
        before, "vllm:nixl_bytes_transferred_sum"
    )
    descriptors = metric_value(after, "vllm:nixl_num_descriptors_sum") - metric_value(
        before, "vllm:nixl_num_descriptors_sum"
    )
    total_blocks = len(params["remote_block_ids"][0])
    assert 0 < descriptors / 2 < total_blocks  # the shared prefix came from the decode's own cache
    assert pulled > 0
    hits = (
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_cache_hit"}'
    )
    assert metric_value(after, hits) > metric_value(before, hits)


def golden_sse(name: str) -> str:
    from emu_harness import GOLDEN

    return (GOLDEN / "pd" / "main" / name).read_text()


def test_wrong_engine_id_streams_vllm_error_event(pair: tuple[Emulator, Emulator]) -> None:
    prefill, decode = pair
    params = do_prefill(prefill)["kv_transfer_params"]
    params["remote_engine_id"] = "00000000-0000-0000-0000-000000000000"
    started = time.monotonic()
    r = do_decode(decode, params)
    assert time.monotonic() - started < 3
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert r.text == golden_sse("11_decode_wrong_engine_id.sse")


def test_wrong_port_of_a_known_engine_is_ignored(pair: tuple[Emulator, Emulator]) -> None:
    prefill, decode = pair
    assert (
        do_decode(decode, do_prefill(prefill)["kv_transfer_params"]).status_code == 200
    )  # handshake
    params = do_prefill(prefill)["kv_transfer_params"]
    params["remote_port"] = free_port()
    r = do_decode(decode, params)
    assert r.status_code == 200
    assert '"finish_reason":"length"' in r.text


def test_unknown_engine_on_a_wrong_port_fails_after_the_handshake_timeout(
    pair: tuple[Emulator, Emulator],
) -> None:
    prefill, decode = pair
    failed_before = metric_value(metrics(decode), "vllm:nixl_num_failed_transfers_total")
    params = do_prefill(prefill)["kv_transfer_params"]
    params.update(remote_port=free_port(), remote_engine_id="11111111-1111-1111-1111-111111111111")
    started = time.monotonic()
    r = do_decode(decode, params, stream=False)
    elapsed = time.monotonic() - started
    assert 0.9 < elapsed < 5
    golden = golden_json("pd", "main", "17_decode_wrong_port_unknown_engine_nonstream.json")[
        "response"
    ]
    assert r.status_code == golden["status"] == 500  # type: ignore[index]
    assert r.json() == golden["body"]  # type: ignore[index]
    params["remote_engine_id"] = "22222222-2222-2222-2222-222222222222"
    r = do_decode(decode, params, stream=True)
    assert r.text == golden_sse("15_decode_wrong_port_unknown_engine_stream.sse")
    after = metrics(decode)
    assert metric_value(after, "vllm:nixl_num_failed_transfers_total") == failed_before + 2
    assert metric_value(after, 'vllm:request_success_total{engine="0",finished_reason="error"') >= 2


def test_expired_lease_gives_a_clear_error(pair: tuple[Emulator, Emulator]) -> None:
    prefill, decode = pair
    time.sleep(LEASE_S + 0.2)  # leases left by the failure cases above expire first
    expired_before = metric_value(metrics(prefill), "vllm:nixl_num_kv_expired_reqs_total")
    params = do_prefill(prefill, PROMPT + " expiring")["kv_transfer_params"]
    time.sleep(LEASE_S + 0.5)
    expired = metric_value(metrics(prefill), "vllm:nixl_num_kv_expired_reqs_total")
    assert expired == expired_before + 1
    assert metric_value(metrics(prefill), "vllm:kv_cache_usage_perc") == 0
    r = do_decode(decode, params, stream=False, prompt=PROMPT + " expiring")
    assert r.status_code == 500
    assert "lease expired" in r.json()["error"]["message"]


def test_recompute_policy_prefills_locally_after_a_failed_pull() -> None:
    """vLLM's `kv_load_failure_policy: recompute` (what the operator renders for decode pools):
    the pull of an expired lease fails, is counted, and the decode engine prefills the prompt
    itself; the client gets its whole answer, the same tokens a good handoff gives."""
    prompt = PROMPT + " recomputed"
    with pd_engines([], decode_kv={"kv_load_failure_policy": "recompute"}) as (prefill, decode):
        good = do_decode(decode, do_prefill(prefill, prompt)["kv_transfer_params"], False, prompt)
        assert good.status_code == 200, good.text
        params = do_prefill(prefill, prompt)["kv_transfer_params"]
        time.sleep(LEASE_S + 0.5)  # the prefill engine drops the blocks: the pull must fail
        failed_before = metric_value(metrics(decode), "vllm:nixl_num_failed_transfers_total")
        r = do_decode(decode, params, stream=False, prompt=prompt)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == good.json()["choices"][0]["text"]
        assert r.json()["usage"]["completion_tokens"] == 8
        after = metrics(decode)
        assert metric_value(after, "vllm:nixl_num_failed_transfers_total") == failed_before + 1
        assert metric_value(after, "vllm:kv_cache_usage_perc") == 0
