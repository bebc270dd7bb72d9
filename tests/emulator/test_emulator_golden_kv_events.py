"""Replays golden/kv_events against the emulator: same ZMQ frames, same batches, same hashes.

The emulator's output tokens are not the dummy model's, so blocks that hold generated tokens get
other hashes: they are mapped through the hashes recomputed from each side's token ids, and every
other field (event order, batch boundaries, parents, prompt-only hashes) must match exactly.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from emu_harness import GOLDEN, MODEL_DIR, emulator

from tandem.common.block_hash import chain_digests, event_hash, hash_function, none_hash
from tandem.common.ports import free_port
from tandem.emulator.kv_events import encode_batch

pytestmark = pytest.mark.timeout(60)
KV = GOLDEN / "kv_events"
BLOCK = 32


def golden_lines(algo: str, name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (KV / algo / name).read_text().splitlines()]


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_golden_payload_bytes_reencode_identically(algo: str) -> None:
    for frame in golden_lines(algo, "frames_live.jsonl"):
        topic, seq, payload = (bytes.fromhex(h) for h in frame["frames_hex"])
        assert topic == b"kv-events"
        assert int.from_bytes(seq, "big") == frame["seq"]
        ts, events, rank = msgspec.msgpack.decode(payload)
        assert encode_batch(ts, events, rank) == payload


def hash_map(algo: str, golden: list[int], mine: list[int], salt: str | None) -> dict[int, int]:
    fn, root = hash_function(algo), none_hash(algo, {})
    pairs = zip(
        chain_digests(fn, root, golden, BLOCK, salt),
        chain_digests(fn, root, mine, BLOCK, salt),
        strict=True,
    )
    return {event_hash(g): event_hash(m) for g, m in pairs}


def translate(
    event: dict[str, Any], hashes: dict[int, int], tokens: dict[int, list[int]]
) -> dict[str, Any]:
    out = dict(event)
    if "block_hashes" in out:
        out["block_hashes"] = [hashes[h] for h in out["block_hashes"]]
    if out.get("parent_block_hash") is not None:
        out["parent_block_hash"] = hashes[out["parent_block_hash"]]
    if out["type"] == "BlockStored":
        out["token_ids"] = [t for h in out["block_hashes"] for t in tokens[h]]
    return out


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_replay_golden_requests_gives_the_same_events(algo: str) -> None:
    pub_port, replay_port = free_port(), free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": "kv-events",
    }
    args = [
        "--model",
        str(MODEL_DIR),
        "--load-format",
        "dummy",
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "256",
        "--block-size",
        "32",
        "--enable-prefix-caching",
        "--num-gpu-blocks-override",
        "12",
        "--prefix-caching-hash-algo",
        algo,
        "--kv-events-config",
        json.dumps(config),
        "--speedup",
        "20",
    ]
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    try:
        with emulator(args, env=env) as proc:
            sub.connect(f"tcp://127.0.0.1:{pub_port}")
            time.sleep(0.3)  # let the subscription reach the publisher
            hashes: dict[int, int] = {}
            tokens: dict[int, list[int]] = {}
            for record in golden_lines(algo, "requests.jsonl"):
                if record["name"] == "reset_prefix_cache":
                    r = httpx.post(proc.url + "/reset_prefix_cache")
                    assert r.status_code == 200
                    assert r.json() == {"success": True}
                    continue
                r = httpx.post(proc.url + "/v1/completions", json=record["request"], timeout=20)
                assert r.status_code == 200, r.text
                mine = r.json()["choices"][0]
                theirs = record["response"]["choices"][0]
                assert mine["prompt_token_ids"] == theirs["prompt_token_ids"]
                assert len(mine["token_ids"]) == len(theirs["token_ids"])
                my_tokens = mine["prompt_token_ids"] + mine["token_ids"]
                salt = record["request"].get("cache_salt")
                hashes.update(
                    hash_map(
                        algo, theirs["prompt_token_ids"] + theirs["token_ids"], my_tokens, salt
                    )
                )
                fn, root = hash_function(algo), none_hash(algo, {})
                for index, digest in enumerate(chain_digests(fn, root, my_tokens, BLOCK, salt)):
                    tokens[event_hash(digest)] = my_tokens[index * BLOCK : (index + 1) * BLOCK]
                time.sleep(0.05)
            expected = golden_lines(algo, "frames_live.jsonl")
            received = []
            deadline = time.monotonic() + 10
            while len(received) < len(expected) and time.monotonic() < deadline:
                if sub.poll(200):
                    received.append(sub.recv_multipart())
            assert len(received) == len(expected)
            for frames, golden in zip(received, expected, strict=True):
                assert len(frames) == 3
                assert frames[0] == b"kv-events"
                assert frames[1] == golden["seq"].to_bytes(8, "big")
                ts, events, rank = msgspec.msgpack.decode(frames[2])
                assert isinstance(ts, float)
                assert rank == 0
                want = [translate(e, hashes, tokens) for e in golden["decoded_payload"][1]]
                assert events == want, f"seq {golden['seq']}"
                # byte layout: the same encoder output as vLLM's for this content
                assert frames[2] == encode_batch(ts, want, 0)

            # prompt-only blocks keep vLLM's exact hashes
            live_golden = {
                h
                for g in expected
                for e in g["decoded_payload"][1]
                for h in e.get("block_hashes", [])
            }
            unchanged = {g for g, m in hashes.items() if g == m}
            assert unchanged & live_golden

            # replay: everything from seq 0, then the end marker
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(f"tcp://127.0.0.1:{replay_port}")
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            replies = []
            while True:
                assert dealer.poll(5000)
                reply = dealer.recv_multipart()
                replies.append(reply)
                if reply[1] == b"":
                    break
            dealer.close(0)
            assert replies[-1] == [b"", b"", b"\xff" * 8, b""]
            assert [r[1:] for r in replies[:-1]] == [list(f) for f in received]
            golden_replay = golden_lines(algo, "frames_replay.jsonl")
            assert len(replies) == len(golden_replay) - 1
    finally:
        sub.close(0)
        ctx.term()
