"""vLLM's prefix-cache block hashes: NONE_HASH, chained block digests and the 64-bit event form."""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
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


def none_hash_seed(algo: str, environ: dict[str, str] | None = None) -> str | bytes:
    """The NONE_HASH seed: $PYTHONHASHSEED if set, else vLLM's fixed string (sha256*) or random bytes."""
    env = os.environ if environ is None else environ
    seed = env.get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    if algo.startswith("sha256"):
        return DEFAULT_NONE_HASH_SEED
    return os.urandom(32)


def none_hash(algo: str, environ: dict[str, str] | None = None) -> bytes:
    """NONE_HASH = H(seed): the parent digest of every chain's first block."""
    return hash_function(algo)(none_hash_seed(algo, environ))


def cache_salt_extra_keys(cache_salt: str | None) -> tuple[tuple[str, str], ...] | None:
    """extra_keys of block 0 for a request with `cache_salt` (later blocks use None)."""
    return (("cache_salt", cache_salt),) if cache_salt else None


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
) -> list[bytes]:
    """Digests of every full block of `token_ids`, chained from `root` (NONE_HASH)."""
    digests: list[bytes] = []
    parent = root
    salt_keys = cache_salt_extra_keys(cache_salt)
    for index in range(len(token_ids) // block_size):
        start = index * block_size
        extra = salt_keys if index == 0 else None
        parent = block_digest(hash_fn, parent, token_ids[start : start + block_size], extra)
        digests.append(parent)
    return digests
