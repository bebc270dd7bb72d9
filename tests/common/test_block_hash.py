"""vLLM 0.32's block hashes recomputed from the golden KV-event captures (golden/kv_events): the
worked examples, every live event's hash, and the router's `BlockHasher` over the same tokens."""

from __future__ import annotations

import base64
import json

import msgspec
import pytest
from tandem_process import GOLDEN

from tandem.common.block_hash import (
    DEFAULT_NONE_HASH_SEED,
    BlockHasher,
    block_digest,
    chain_digests,
    event_hash,
    hash_function,
    none_hash,
    serializer,
)

KV = GOLDEN / "kv_events"
pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_none_hash_and_worked_examples(algo: str) -> None:
    examples = json.loads((KV / "worked_examples.json").read_text())[algo]
    assert none_hash(algo, {}).hex() == examples["none_hash_hex"]
    assert serializer(algo)(DEFAULT_NONE_HASH_SEED).hex() == examples["none_hash_preimage_hex"]
    hash_fn = hash_function(algo)
    for example in examples["examples"]:
        tokens = example["prompt_token_ids"] + example["output_token_ids"]
        extra = example["extra_keys_in_hash"]
        index = example["block_index"]
        parent = bytes.fromhex(example["parent_digest_hex"])
        block = tuple(example["block_token_ids"])
        keys = tuple(tuple(pair) for pair in extra) if extra else None
        assert serializer(algo)((parent, block, keys)).hex() == example["preimage_hex"]
        digest = block_digest(hash_fn, parent, block, keys)
        assert digest.hex() == example["sha256_digest_hex"]
        assert event_hash(digest) == example["event_block_hash_uint64"]
        # the same digest from the whole chain of the request's tokens
        salt = "salt-1" if "cache_salt" in example["source_request"] else None
        chain = chain_digests(hash_fn, none_hash(algo, {}), tokens, 32, salt)
        assert chain[index] == digest


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_every_live_event_hash_recomputed(algo: str) -> None:
    requests = {}
    for line in (KV / algo / "requests.jsonl").read_text().splitlines():
        record = json.loads(line)
        response = record.get("response")
        if isinstance(response, dict) and response.get("choices"):
            requests[record["name"]] = (record["request"], response["choices"][0])
    live = set()
    for line in (KV / algo / "frames_live.jsonl").read_text().splitlines():
        for event in json.loads(line)["decoded_payload"][1]:
            if event["type"] == "BlockStored":
                live.update(event["block_hashes"])
    checks = json.loads((KV / algo / "hash_verification.json").read_text())
    assert checks
    hash_fn = hash_function(algo)
    root = none_hash(algo, {})
    for check in checks:
        request, choice = requests[check["request"]]
        tokens = choice["prompt_token_ids"] + choice["token_ids"]
        digests = chain_digests(hash_fn, root, tokens, 32, request.get("cache_salt"))
        assert event_hash(digests[check["block"]]) == check["computed_int"]
        assert check["computed_int"] in live


def test_pythonhashseed_changes_none_hash() -> None:
    assert none_hash("sha256_cbor", {"PYTHONHASHSEED": "0"}) != none_hash("sha256_cbor", {})
    assert none_hash("sha256_cbor", {"PYTHONHASHSEED": "0"}) == hash_function("sha256_cbor")("0")
    assert none_hash("sha256", {}) == hash_function("sha256")(DEFAULT_NONE_HASH_SEED)


def _requests(algo: str) -> dict[str, dict]:
    lines = (KV / algo / "requests.jsonl").read_text().splitlines()
    return {r["name"]: r for r in map(json.loads, lines) if "request" in r}


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_verification_table_is_reproduced(algo: str) -> None:
    hasher = BlockHasher(algo, block_size=32, seed=None)  # PYTHONHASHSEED was unset
    requests = _requests(algo)
    for row in json.loads((KV / algo / "hash_verification.json").read_text()):
        record = requests[row["request"]]
        choice = record["response"]["choices"][0]
        tokens = (choice.get("prompt_token_ids") or record["request"]["prompt"]) + (
            choice.get("token_ids") or []
        )
        digests = hasher.digests(tokens, record["request"].get("cache_salt"))
        assert digests[row["block"]].hex() == row["digest_hex"]
        assert (
            hasher.block_hashes(tokens, record["request"].get("cache_salt"))[row["block"]]
            == row["computed_int"]
        )


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_live_frames_hashes_match_their_token_ids(algo: str) -> None:
    """Every BlockStored in the raw frames: recompute its hashes from its own token ids and parent."""
    hasher = BlockHasher(algo, block_size=32, seed=None)
    digest_of: dict[int, bytes] = {}
    checked = 0
    for line in (KV / algo / "frames_live.jsonl").read_text().splitlines():
        frame = json.loads(line)
        payload = base64.b64decode(frame["frames_b64"][2])
        _, events, _ = msgspec.msgpack.decode(payload)
        for event in events:
            if event["type"] != "BlockStored":
                continue
            parent = (
                hasher.none_hash
                if event.get("parent_block_hash") is None
                else digest_of[event["parent_block_hash"]]
            )
            extra = event.get("extra_keys") or [None]
            salt = extra[0][0] if isinstance(extra[0], list) else None
            tokens = event["token_ids"]
            for i, block_hash in enumerate(event["block_hashes"]):
                extra_key = (("cache_salt", salt),) if (salt and i == 0) else None
                parent = hasher.digest((parent, tuple(tokens[32 * i : 32 * i + 32]), extra_key))
                assert int.from_bytes(parent, "big") & (2**64 - 1) == block_hash
                digest_of[block_hash] = parent
                checked += 1
    assert checked >= 5


def test_worked_example_none_hashes() -> None:
    assert BlockHasher("sha256", 32, None).none_hash.hex().startswith("066b1e8987e02713")
    assert BlockHasher("sha256_cbor", 32, None).none_hash.hex().startswith("9bd96a485ad84efd")
    # PYTHONHASHSEED pinned to "0" (Tandem's default) seeds NONE_HASH with that string
    assert BlockHasher("sha256_cbor", 16, "0").none_hash == BlockHasher(
        "sha256_cbor", 16, "0"
    ).digest("0")


# Real vLLM 0.32 (CPU build, --prefix-caching-hash-algo sha256_cbor, PYTHONHASHSEED=0, block size
# 32) published these hashes for token ids 10..73 served by the adapter `ad1` loaded from
# --lora-modules ad1=/tmp/lora-probe/ad1, without and with cache_salt "s1", and for the base model
# (docs/protocols.md, "LoRA adapters"; tests/realvllm/test_lora.py checks it live).
LORA_TOKENS = list(range(10, 74))
LORA_EVENTS = {
    None: [18214826099119294338, 2739536498348528488],
    ("ad1", None): [3560095595450583704, 2653347503815829869],
    ("ad1", "s1"): [9024500218152536570, 410951834483119913],
}


def test_adapter_requests_hash_with_the_adapters_name_and_path() -> None:
    hasher = BlockHasher("sha256_cbor", 32, "0")
    lora = ("ad1", "/tmp/lora-probe/ad1")
    assert hasher.block_hashes(LORA_TOKENS) == LORA_EVENTS[None]
    assert hasher.block_hashes(LORA_TOKENS, lora=lora) == LORA_EVENTS[("ad1", None)]
    assert hasher.block_hashes(LORA_TOKENS, "s1", lora) == LORA_EVENTS[("ad1", "s1")]
    # the path is part of the key: the same name loaded from elsewhere is another adapter
    assert (
        hasher.block_hashes(LORA_TOKENS, lora=("ad1", "/elsewhere")) != LORA_EVENTS[("ad1", None)]
    )
