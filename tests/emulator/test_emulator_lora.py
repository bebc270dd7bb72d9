"""LoRA adapters in the emulator, checked against what real vLLM 0.32 (CPU build) answered and
published for the same requests (docs/protocols.md, "LoRA adapters"; the real engine is asked
again by tests/realvllm/test_lora.py): /v1/models, the block hashes and KV events of adapter
requests, runtime load/unload with vLLM's messages, the adapter-slot metric and the wait for a
slot under --max-loras."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from emu_harness import TINY_ARGS, Emulator, emulator
from lora_adapter import make_adapter

from tandem.common.ports import free_port
from tandem.router.lora import parse_lora_slots

pytestmark = pytest.mark.timeout(120)

# The adapter path real vLLM was given; block hashes carry the path string, not the files.
REAL_PATH = "/tmp/lora-probe/ad1"
PROMPT = list(range(10, 74))
REAL_HASHES = {
    None: [3560095595450583704, 2653347503815829869],
    "s1": [9024500218152536570, 410951834483119913],
}


@dataclass
class LoraEmulator:
    proc: Emulator
    adapter: str  # a real adapter directory, for runtime loads
    events: str  # the KV-event publisher's endpoint


@pytest.fixture(scope="module")
def lora_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoraEmulator]:
    adapter = make_adapter(tmp_path_factory.mktemp("adapters") / "ad2", seed=2)
    port = free_port()
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "topic": "kv-events",
    }
    args = [
        *TINY_ARGS,
        "--prefix-caching-hash-algo", "sha256_cbor",
        "--kv-events-config", json.dumps(events),
        "--enable-lora", "--max-loras", "1", "--max-cpu-loras", "2", "--max-lora-rank", "8",
        "--lora-modules", f"ad1={REAL_PATH}",
        "--speedup", "1",  # real time: long enough requests to watch the slot metric
    ]  # fmt: skip
    env = {"PYTHONHASHSEED": "0", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    with emulator(args, env) as proc:
        yield LoraEmulator(proc, str(adapter), f"tcp://127.0.0.1:{port}")


def post(proc: Emulator, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{proc.url}{path}", json=body, timeout=60)


def test_models_list_the_adapter_as_vllm_does(lora_emulator: LoraEmulator) -> None:
    proc = lora_emulator.proc
    models = httpx.get(f"{proc.url}/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["root"] if m["parent"] else None, m["parent"]) for m in models] == [
        ("tiny", None, None),
        ("ad1", REAL_PATH, "tiny"),
    ]
    assert models[1]["max_model_len"] is None
    assert set(models[1]) == set(models[0])


def test_adapter_requests_publish_vllms_block_hashes(lora_emulator: LoraEmulator) -> None:
    proc = lora_emulator.proc
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(lora_emulator.events)
    time.sleep(0.5)  # the SUB connection is up before the events are published
    try:
        for salt in (None, "s1"):
            body = {"model": "ad1", "prompt": PROMPT, "max_tokens": 1}
            answer = post(
                proc, "/v1/completions", {**body, **({"cache_salt": salt} if salt else {})}
            )
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == "ad1"
        stored: list[dict[str, Any]] = []
        deadline = time.monotonic() + 10
        while len(stored) < 2 and time.monotonic() < deadline:
            if sub.poll(500):
                frames = sub.recv_multipart()
                batch = msgspec.msgpack.decode(frames[2])[1]
                stored += [e for e in batch if e.get("type") == "BlockStored"]
    finally:
        sub.close()
        context.term()
    assert [e["block_hashes"] for e in stored] == [REAL_HASHES[None], REAL_HASHES["s1"]]
    assert [(e["lora_name"], e["lora_id"]) for e in stored] == [("ad1", 1), ("ad1", 1)]
    assert [e["extra_keys"] for e in stored] == [[["ad1"], ["ad1"]], [["ad1", "s1"], ["ad1"]]]


def test_runtime_load_and_unload_answer_as_vllm(lora_emulator: LoraEmulator) -> None:
    proc, path = lora_emulator.proc, lora_emulator.adapter
    load = {"lora_name": "ad2", "lora_path": path}
    answer = post(proc, "/v1/load_lora_adapter", load)
    assert (answer.status_code, answer.text) == (
        200,
        "Success: LoRA adapter 'ad2' added successfully.",
    )
    again = post(proc, "/v1/load_lora_adapter", load)
    assert again.status_code == 400
    assert again.json()["error"] == {
        "message": "The lora adapter 'ad2' has already been loaded. If you want to load the "
        "adapter in place, set 'load_inplace' to True.",
        "type": "InvalidUserInput",
        "param": None,
        "code": 400,
    }
    missing = post(
        proc, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": "/nonexistent/adapter"}
    )
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == (
        "Loading lora bad failed: No adapter found for /nonexistent/adapter"
    )
    served = post(proc, "/v1/completions", {"model": "ad2", "prompt": "hi", "max_tokens": 1})
    assert served.status_code == 200, served.text
    gone = post(proc, "/v1/unload_lora_adapter", {"lora_name": "ad2"})
    assert (gone.status_code, gone.text) == (
        200,
        "Success: LoRA adapter 'ad2' removed successfully.",
    )
    unknown = post(proc, "/v1/unload_lora_adapter", {"lora_name": "ad2"})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["message"] == "The lora adapter 'ad2' cannot be found."
    after = post(proc, "/v1/completions", {"model": "ad2", "prompt": "hi", "max_tokens": 1})
    assert after.status_code == 404
    assert (
        after.json()["error"]["message"] == "The model `ad2` does not exist. Valid aliases: tiny."
    )


def test_a_second_adapter_waits_for_the_only_slot(lora_emulator: LoraEmulator) -> None:
    """--max-loras 1: requests for two adapters at once run one adapter after the other (real
    vLLM: ad1 done in 0.93 s, ad2 in 2.63 s); vllm:lora_requests_info names the running one and,
    meanwhile, the other as waiting."""
    proc, path = lora_emulator.proc, lora_emulator.adapter
    assert (
        post(proc, "/v1/load_lora_adapter", {"lora_name": "ad3", "lora_path": path}).status_code
        == 200
    )
    statuses: dict[str, int] = {}
    start = time.monotonic()

    def run(model: str) -> None:
        body = {"model": model, "prompt": [5] * 40, "max_tokens": 400, "ignore_eos": True}
        statuses[model] = post(proc, "/v1/completions", body).status_code

    threads = [threading.Thread(target=run, args=(m,)) for m in ("ad1", "ad3")]
    for thread in threads:
        thread.start()
        time.sleep(0.05)
    seen: set[str] = set()
    waited = False
    while any(t.is_alive() for t in threads) and time.monotonic() - start < 60:
        slots = parse_lora_slots(httpx.get(f"{proc.url}/metrics", timeout=10).content)
        if slots is not None:
            assert slots.max_loras == 1
            assert len(slots.running) <= 1, slots  # never both adapters in one step
            seen |= slots.running
            # whichever arrived first runs; the other waits for the slot
            waited |= len(slots.running) == 1 and bool(
                {"ad1", "ad3"} - slots.running & slots.waiting
            )
        time.sleep(0.02)
    for thread in threads:
        thread.join(60)
    assert statuses == {"ad1": 200, "ad3": 200}
    assert seen == {"ad1", "ad3"}
    assert waited
