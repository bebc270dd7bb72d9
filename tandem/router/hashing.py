"""vLLM's prefix-cache block hashes (`sha256` and `sha256_cbor`), reproduced bit for bit.

    SER(x)    = pickle.dumps(x, protocol=5)         (sha256)
              | canonical CBOR of x                 (sha256_cbor)
    H(x)      = SHA-256(SER(x))
    NONE_HASH = H(seed)     seed = the engines' PYTHONHASHSEED, else "vllm-none-hash"
    D[0]      = H((NONE_HASH, tuple(block_0), extra_0))
    D[i]      = H((D[i-1],    tuple(block_i), None))
    event id  = int.from_bytes(D[i], "big") & (2**64 - 1)

Only full blocks are hashed. `extra_0` is `(("cache_salt", salt),)` when the request carries a
`cache_salt`, else None. The ids are what engines publish in KV events (PROTOCOLS.md §2).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Literal

import cbor2

HashAlgo = Literal["sha256", "sha256_cbor"]
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_U64 = (1 << 64) - 1


def _ser_pickle(value: object) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _ser_cbor(value: object) -> bytes:
    return cbor2.dumps(value, canonical=True)


class BlockHasher:
    """Computes the chain of block hashes of a token sequence exactly as a vLLM engine does."""

    def __init__(
        self, algo: HashAlgo = "sha256_cbor", block_size: int = 16, seed: str | None = "0"
    ):
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.algo = algo
        self.block_size = block_size
        self._ser = _ser_cbor if algo == "sha256_cbor" else _ser_pickle
        self.none_hash = self.digest(seed if seed is not None else DEFAULT_NONE_HASH_SEED)

    def digest(self, value: object) -> bytes:
        return hashlib.sha256(self._ser(value)).digest()

    def digests(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """Full 32-byte digests of every full block of `token_ids`, in order."""
        size = self.block_size
        parent = self.none_hash
        extra: object = (("cache_salt", cache_salt),) if cache_salt is not None else None
        out: list[bytes] = []
        for start in range(0, len(token_ids) - size + 1, size):
            parent = self.digest((parent, tuple(token_ids[start : start + size]), extra))
            out.append(parent)
            extra = None
        return out

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[int]:
        """The 64-bit block ids engines publish in KV events, one per full block."""
        return [to_event_id(d) for d in self.digests(token_ids, cache_salt)]


def to_event_id(digest: bytes) -> int:
    """The uint64 a vLLM engine publishes for a digest (its last 8 bytes, big-endian)."""
    return int.from_bytes(digest, "big") & _U64
