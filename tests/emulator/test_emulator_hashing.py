"""Block hashes against vLLM 0.32's live KV events (golden/kv_events worked examples)."""

from __future__ import annotations

import json

import pytest
from emu_harness import GOLDEN, needs_golden

from tandem.common.block_hash import (
    DEFAULT_NONE_HASH_SEED,
    block_digest,
    chain_digests,
    event_hash,
    hash_function,
    none_hash,
    serializer,
)

pytestmark = [needs_golden, pytest.mark.timeout(30)]
KV = GOLDEN / "kv_events"


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
