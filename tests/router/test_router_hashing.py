"""vLLM block hashes recomputed from the golden KV-event captures (real vLLM 0.32)."""

from __future__ import annotations

import base64
import json

import msgspec
import pytest
from tandem_process import GOLDEN as SHARED_GOLDEN

from tandem.common.block_hash import BlockHasher

GOLDEN = SHARED_GOLDEN / "kv_events"
pytestmark = pytest.mark.skipif(not GOLDEN.exists(), reason="golden captures not present")


def _requests(algo: str) -> dict[str, dict]:
    lines = (GOLDEN / algo / "requests.jsonl").read_text().splitlines()
    return {r["name"]: r for r in map(json.loads, lines) if "request" in r}


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_verification_table_is_reproduced(algo: str) -> None:
    hasher = BlockHasher(algo, block_size=32, seed=None)  # PYTHONHASHSEED was unset
    requests = _requests(algo)
    for row in json.loads((GOLDEN / algo / "hash_verification.json").read_text()):
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
    for line in (GOLDEN / algo / "frames_live.jsonl").read_text().splitlines():
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
