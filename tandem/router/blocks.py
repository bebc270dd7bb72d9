"""Router-side block keys: a fast chained hash of full token blocks, used as prefix-index keys.

    key[0] = hash((SEED, bytes(block_0)))        key[i] = hash((key[i-1], bytes(block_i)))

bytes(block) is the block's token ids as 32-bit little-endian integers. The keys only live inside
this process, so Python's own hash (SipHash) is enough and costs a fraction of vLLM's SHA-256
chain on the hot path; engines' KV events are mapped onto these keys as they arrive
(see `kv_events.py`), which also keeps the index right if engines hash with another algorithm.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from tandem.router.rendezvous import hash64

_SEED = 0x7A6D


def block_keys(token_ids: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """Chained keys of every full block of `token_ids` (a chain may continue from `parent`)."""
    buf = array("I", token_ids).tobytes()
    step = 4 * block_size
    key = _SEED if parent is None else parent
    out: list[int] = []
    for start in range(0, len(buf) - step + 1, step):
        key = hash((key, buf[start : start + step]))
        out.append(key)
    return out


def text_block_keys(text: str, chars_per_block: int) -> list[int]:
    """Keys of a text cut into fixed-size character chunks (the approximation without a tokenizer)."""
    key = _SEED
    out: list[int] = []
    for start in range(0, len(text) - chars_per_block + 1, chars_per_block):
        key = hash((key, text[start : start + chars_per_block]))
        out.append(key)
    return out


def stable_first_block_key(
    token_ids: Sequence[int], block_size: int, salt: str | None = None, adapter: str | None = None
) -> int | None:
    """A key of the first full block that every process computes alike (the chained keys above
    are per process): blake2b-64 of the adapter, the salt and the block's token ids. None without
    a full block. Router replicas meet on it where they cannot share their index (rendezvous
    affinity)."""
    if len(token_ids) < block_size:
        return None
    return stable_key(array("I", token_ids[:block_size]).tobytes(), salt, adapter)


def stable_text_key(
    text: str, chars_per_block: int, salt: str | None = None, adapter: str | None = None
) -> int | None:
    """`stable_first_block_key` of the approximation: the first `chars_per_block` characters."""
    if len(text) < chars_per_block:
        return None
    return stable_key(text[:chars_per_block].encode(), salt, adapter)


def stable_key(data: bytes, salt: str | None, adapter: str | None = None) -> int:
    prefix = b"" if salt is None else salt.encode() + b"\0"
    if adapter is not None:
        prefix = b"\x01" + adapter.encode() + b"\0" + prefix
    return hash64(prefix + data)


def chain_seed(salt: str | None, adapter: str | None = None) -> int | None:
    """The chain seed of a request with `cache_salt` or to a LoRA adapter, None for neither.

    vLLM mixes the salt into block 0 and the adapter into every block; both reach every later
    block through the chain, so seeding the chain with them keys exactly the blocks vLLM tells
    apart. The adapter is keyed by name: vLLM also hashes its path, which one name has at a time
    on an engine (a name re-pointed at another path is a new adapter to vLLM, not to this key)."""
    if salt is None and adapter is None:
        return None
    return hash((_SEED, "lora", adapter, "cache_salt", salt))
