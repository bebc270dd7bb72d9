"""vLLM's prefix-cache block hashes, reproduced bit for bit (docs/protocols.md §2).

    SER(x)    = pickle.dumps(x, protocol=5)            (sha256, xxhash)
              | canonical CBOR of x                    (sha256_cbor, xxhash_cbor)
    H(x)      = SHA-256(SER(x))  |  xxh3_128(SER(x))   (xxhash*)
    NONE_HASH = H(seed)     seed = the engines' PYTHONHASHSEED, else "vllm-none-hash" (sha256*)
    D[0]      = H((NONE_HASH, tuple(block_0), extra_0))
    D[i]      = H((D[i-1],    tuple(block_i), extra_i))
    event id  = int.from_bytes(D[i], "big") & (2**64 - 1)

Only full blocks are hashed. For a request to a LoRA adapter every block's extra keys start with
`("lora", adapter name, adapter path)` (the path as the engine was given it: `--lora-modules` or
`/v1/load_lora_adapter`, the `root` of the adapter in `/v1/models`); block 0 then carries
`("cache_salt", salt)` when the request has a `cache_salt`. `extra_i` is the tuple of those keys,
or None when there are none. The event ids are what engines publish in KV events. The emulator hashes
its blocks with these functions; the router recomputes them to check the events it receives.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import cbor2

# vLLM's seed for NONE_HASH when PYTHONHASHSEED is unset (sha256 algorithms).
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")

Serializer = Callable[[Any], bytes]
HashFunction = Callable[[Any], bytes]


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(obj: Any) -> bytes:
    return bytes(cbor2.dumps(obj, canonical=True))


def serializer(algo: str) -> Serializer:
    """SER(x): pickle protocol 5 for sha256/xxhash, canonical CBOR for the *_cbor algorithms."""
    if algo in ("sha256", "xxhash"):
        return _pickle
    if algo in ("sha256_cbor", "xxhash_cbor"):
        return _cbor
    raise ValueError(f"unknown prefix caching hash algorithm {algo!r}; choose from {HASH_ALGOS}")


def hash_function(algo: str) -> HashFunction:
    """The digest function H(obj) of `--prefix-caching-hash-algo`.

    sha256: SHA-256(pickle protocol 5); sha256_cbor: SHA-256(canonical CBOR);
    xxhash / xxhash_cbor: xxh3_128 of the same serializations (needs the `xxhash` module).
    """
    serialize = serializer(algo)
    if algo.startswith("sha256"):
        return lambda obj: hashlib.sha256(serialize(obj)).digest()
    try:
        import xxhash  # type: ignore[import-not-found,unused-ignore]
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ValueError(f"--prefix-caching-hash-algo {algo} needs the 'xxhash' package") from error
    xxh3 = xxhash.xxh3_128_digest
    return lambda obj: bytes(xxh3(serialize(obj)))


def none_hash_seed(algo: str, environ: Mapping[str, str] | None = None) -> str | bytes:
    """The NONE_HASH seed: $PYTHONHASHSEED if set, else vLLM's fixed string (sha256*) or random bytes."""
    env = os.environ if environ is None else environ
    seed = env.get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    if algo.startswith("sha256"):
        return DEFAULT_NONE_HASH_SEED
    return os.urandom(32)


def none_hash(algo: str, environ: Mapping[str, str] | None = None) -> bytes:
    """NONE_HASH = H(seed): the parent digest of every chain's first block."""
    return hash_function(algo)(none_hash_seed(algo, environ))


LoraKey = tuple[str, str]  # (adapter name, adapter path)


def block_extra_keys(
    index: int, cache_salt: str | None = None, lora: LoraKey | None = None
) -> tuple[tuple[str, ...], ...] | None:
    """extra_keys of block `index`: the adapter's ("lora", name, path) on every block, then
    ("cache_salt", salt) on block 0 only; None when there are none."""
    keys: list[tuple[str, ...]] = []
    if lora is not None:
        keys.append(("lora", *lora))
    if cache_salt and index == 0:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def block_digest(
    hash_fn: HashFunction, parent: bytes, block_tokens: Sequence[int], extra_keys: Any
) -> bytes:
    """D = H((parent_digest, tuple(block_token_ids), extra_keys))."""
    return hash_fn((parent, tuple(block_tokens), extra_keys))


def event_hash(digest: bytes) -> int:
    """The 64-bit form sent in KV events: int.from_bytes(digest, "big") & (2**64 - 1)."""
    return int.from_bytes(digest[-8:], "big")


def chain_digests(
    hash_fn: HashFunction,
    root: bytes,
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    lora: LoraKey | None = None,
) -> list[bytes]:
    """Digests of every full block of `token_ids`, chained from `root` (NONE_HASH)."""
    digests: list[bytes] = []
    parent = root
    for index in range(len(token_ids) // block_size):
        start = index * block_size
        extra = block_extra_keys(index, cache_salt, lora)
        parent = block_digest(hash_fn, parent, token_ids[start : start + block_size], extra)
        digests.append(parent)
    return digests


class BlockHasher:
    """The chain of block hashes of a token sequence, for engines with a known seed and algorithm.

    `seed` is the engines' PYTHONHASHSEED (None: it was unset, so vLLM's fixed string).
    """

    def __init__(self, algo: str = "sha256_cbor", block_size: int = 16, seed: str | None = "0"):
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.algo = algo
        self.block_size = block_size
        self.digest = hash_function(algo)
        self.none_hash = self.digest(seed if seed is not None else DEFAULT_NONE_HASH_SEED)

    def digests(
        self, token_ids: Sequence[int], cache_salt: str | None = None, lora: LoraKey | None = None
    ) -> list[bytes]:
        """Full 32-byte digests of every full block of `token_ids`, in order."""
        return chain_digests(
            self.digest, self.none_hash, token_ids, self.block_size, cache_salt, lora
        )

    def block_hashes(
        self, token_ids: Sequence[int], cache_salt: str | None = None, lora: LoraKey | None = None
    ) -> list[int]:
        """The 64-bit block ids engines publish in KV events, one per full block."""
        return [event_hash(d) for d in self.digests(token_ids, cache_salt, lora)]
