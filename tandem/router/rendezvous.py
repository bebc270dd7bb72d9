"""Rendezvous (highest-random-weight) hashing: every router replica derives the same engine order
for a key from nothing but the key and the engine ids, with no table and no coordination.

    weight(key, engine) = int(blake2b(str(key) + "\\0" + engine, 8 bytes), big-endian) / 2**64

A key's engines in HRW order are the engines sorted by that weight, highest first. Removing an
engine moves only the keys it was first for (each to its next engine in HRW order); adding one
takes from every other engine about 1/n of their keys. The hash is blake2b, stable across
processes, machines and Python versions (never Python's salted `hash()`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from hashlib import blake2b
from typing import TypeVar

T = TypeVar("T")

_SCALE = 1.0 / 2**64


def hash64(data: bytes) -> int:
    """blake2b-64 of `data` as an unsigned integer: the same in every process and on every machine."""
    return int.from_bytes(blake2b(data, digest_size=8).digest(), "big")


def weight(key: str | int, engine_id: str) -> float:
    """The key's weight on the engine, uniform in [0, 1). Example: weight("s1", "http://a:8000")."""
    return hash64(f"{key}\0{engine_id}".encode()) * _SCALE


def hrw_order(key: str | int, items: Iterable[T], engine_id: Callable[[T], str]) -> list[T]:
    """`items` by weight(key, engine_id(item)), highest first; equal weights (a 2**-64 chance) by id."""
    return sorted(items, key=lambda item: (-weight(key, engine_id(item)), engine_id(item)))
