"""Prefix index: which engine holds which KV block, bounded in memory, queried by longest prefix.

The same structure serves the exact index (fed by engines' KV events) and the approximate one
(fed by the router's own routing decisions when events are off). Keys are block keys from
`blocks.py`; each engine owns one bit of a per-key mask so a lookup walks the request's chain once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class PrefixIndex:
    """Block key -> engines holding it; each engine keeps at most `max_blocks_per_engine` keys."""

    def __init__(self, max_blocks_per_engine: int = 262144):
        self.max_blocks_per_engine = max_blocks_per_engine
        self._owners: dict[int, int] = {}  # key -> bitmask of engines
        self._blocks: dict[str, OrderedDict[int, int]] = {}  # engine -> key -> store count (LRU)
        self._bit: dict[str, int] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0

    def _engine(self, engine: str) -> OrderedDict[int, int]:
        blocks = self._blocks.get(engine)
        if blocks is None:
            blocks = self._blocks[engine] = OrderedDict()
            if self._free_bits:
                self._bit[engine] = self._free_bits.pop()
            else:
                self._bit[engine] = self._next_bit
                self._next_bit += 1
        return blocks

    def store(self, engine: str, keys: Iterable[int]) -> None:
        """Record that `engine` holds `keys` (a key stored twice must be removed twice)."""
        blocks = self._engine(engine)
        bit = 1 << self._bit[engine]
        owners = self._owners
        for key in keys:
            count = blocks.get(key)
            if count is None:
                blocks[key] = 1
                owners[key] = owners.get(key, 0) | bit
            else:
                blocks[key] = count + 1
                blocks.move_to_end(key)
        while len(blocks) > self.max_blocks_per_engine:
            old, _ = blocks.popitem(last=False)
            self._drop_owner(old, bit)

    def touch(self, engine: str, keys: Iterable[int]) -> None:
        """Record a routing decision: `engine` now holds `keys` once (approximate index)."""
        blocks = self._engine(engine)
        bit = 1 << self._bit[engine]
        owners = self._owners
        for key in keys:
            if key in blocks:
                blocks.move_to_end(key)
            else:
                blocks[key] = 1
                owners[key] = owners.get(key, 0) | bit
        while len(blocks) > self.max_blocks_per_engine:
            old, _ = blocks.popitem(last=False)
            self._drop_owner(old, bit)

    def remove(self, engine: str, keys: Iterable[int]) -> None:
        blocks = self._blocks.get(engine)
        if blocks is None:
            return
        bit = 1 << self._bit[engine]
        for key in keys:
            count = blocks.get(key)
            if count is None:
                continue
            if count > 1:
                blocks[key] = count - 1
            else:
                del blocks[key]
                self._drop_owner(key, bit)

    def clear(self, engine: str) -> None:
        """Forget every block of `engine` (AllBlocksCleared, or a replay from scratch)."""
        blocks = self._blocks.get(engine)
        if blocks is None:
            return
        bit = 1 << self._bit[engine]
        for key in blocks:
            self._drop_owner(key, bit)
        blocks.clear()

    def drop_engine(self, engine: str) -> None:
        """Forget an engine that left the pool, and free its bit."""
        self.clear(engine)
        if engine in self._blocks:
            del self._blocks[engine]
            self._free_bits.append(self._bit.pop(engine))

    def _drop_owner(self, key: int, bit: int) -> None:
        mask = self._owners.get(key, 0) & ~bit
        if mask:
            self._owners[key] = mask
        else:
            self._owners.pop(key, None)

    def match(self, keys: Sequence[int], engines: Iterable[str]) -> dict[str, int]:
        """Number of leading blocks of `keys` that each of `engines` holds."""
        bits = {e: 1 << self._bit[e] for e in engines if e in self._bit}
        result = dict.fromkeys(engines, 0)
        if not bits or not keys:
            return result
        alive = 0
        for bit in bits.values():
            alive |= bit
        owners = self._owners
        depth = 0
        for key in keys:
            mask = owners.get(key, 0) & alive
            if mask != alive:
                for engine, bit in bits.items():
                    if alive & bit and not mask & bit:
                        result[engine] = depth
                alive = mask
                if not alive:
                    return result
            depth += 1
        for engine, bit in bits.items():
            if alive & bit:
                result[engine] = depth
        return result

    def size(self, engine: str) -> int:
        blocks = self._blocks.get(engine)
        return 0 if blocks is None else len(blocks)

    def __len__(self) -> int:
        return len(self._owners)
