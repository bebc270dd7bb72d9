"""Prefix index: which engine holds which KV block, bounded in memory, queried by longest prefix.

The same structure serves the exact index (fed by engines' KV events) and the approximate one
(fed by the router's own routing decisions when events are off). Keys are block keys from
`blocks.py`; each engine owns one bit of a per-key mask so a lookup walks the request's chain once.

Pending entries bridge the gap between sending a request and its KV events: the blocks of a
request sent to engine e at time t are pending on e until an event stores them (they become real)
or until t + pending_ttl_s (they are dropped). A lookup counts both:

    held(e, now) = stored(e) | {k : k pending on e, sent at t, t + pending_ttl_s > now}
    match(keys, e) = max d such that keys[i] in held(e, now) for every i < d

so a burst of same-prefix requests follows the first one while its events are still in flight.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence

_NO_BLOCKS: OrderedDict[int, int] = OrderedDict()


def _drop_bit(masks: dict[int, int], key: int, bit: int) -> None:
    mask = masks.get(key, 0) & ~bit
    if mask:
        masks[key] = mask
    else:
        masks.pop(key, None)


class PrefixIndex:
    """Block key -> engines holding it; each engine keeps at most `max_blocks_per_engine` keys."""

    def __init__(
        self,
        max_blocks_per_engine: int = 262144,
        pending_ttl_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_blocks_per_engine = max_blocks_per_engine
        self.pending_ttl_s = pending_ttl_s
        self._clock = clock
        self._owners: dict[int, int] = {}  # key -> bitmask of engines
        self._pending_owners: dict[int, int] = {}  # key -> bitmask of engines it is pending on
        # engine -> key -> deadline, oldest first (one TTL, so deadlines are in insertion order)
        self._pending: dict[str, OrderedDict[int, float]] = {}
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
        pending = self._pending.get(engine)
        for key in keys:
            if pending and pending.pop(key, None) is not None:
                self._drop_pending_owner(key, bit)
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

    def add_pending(self, engine: str, keys: Iterable[int]) -> None:
        """Blocks of a request just sent to `engine`, held until its events confirm them."""
        blocks = self._engine(engine)
        bit = 1 << self._bit[engine]
        pending = self._pending.setdefault(engine, OrderedDict())
        owners = self._pending_owners
        deadline = self._clock() + self.pending_ttl_s
        for key in keys:
            if key in blocks:  # already stored: no event will come for it; used again now
                blocks.move_to_end(key)
                continue
            pending[key] = deadline
            pending.move_to_end(key)
            owners[key] = owners.get(key, 0) | bit
        while len(pending) > self.max_blocks_per_engine:
            old, _ = pending.popitem(last=False)
            self._drop_pending_owner(old, bit)

    def expire_pending(self) -> None:
        """Drop pending entries past their deadline."""
        now = self._clock()
        for engine, pending in self._pending.items():
            bit = 1 << self._bit[engine]
            while pending:
                key, deadline = next(iter(pending.items()))
                if deadline > now:
                    break
                del pending[key]
                self._drop_pending_owner(key, bit)

    def pending_size(self, engine: str) -> int:
        pending = self._pending.get(engine)
        return 0 if pending is None else len(pending)

    def _drop_pending_owner(self, key: int, bit: int) -> None:
        _drop_bit(self._pending_owners, key, bit)

    def clear_pending(self, engine: str) -> None:
        """Forget every block pending on `engine` (it refused a connection: it holds none of them)."""
        pending = self._pending.pop(engine, None)
        if pending:
            bit = 1 << self._bit[engine]
            for key in pending:
                self._drop_pending_owner(key, bit)

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
        self.clear_pending(engine)

    def drop_engine(self, engine: str) -> None:
        """Forget an engine that left the pool, and free its bit."""
        self.clear(engine)
        if engine in self._blocks:
            del self._blocks[engine]
            self._free_bits.append(self._bit.pop(engine))

    def _drop_owner(self, key: int, bit: int) -> None:
        _drop_bit(self._owners, key, bit)

    def match(self, keys: Sequence[int], engines: Iterable[str]) -> dict[str, int]:
        """Number of leading blocks of `keys` that each of `engines` holds (stored or pending)."""
        bits = {e: 1 << self._bit[e] for e in engines if e in self._bit}
        result = dict.fromkeys(engines, 0)
        if not bits or not keys:
            return result
        alive = 0
        for bit in bits.values():
            alive |= bit
        owners = self._owners
        if self._pending_owners:
            self.expire_pending()
        pending = self._pending_owners
        depth = 0
        for key in keys:
            mask = (owners.get(key, 0) | pending.get(key, 0)) & alive
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

    def newest_first(self, engine: str) -> Iterator[int]:
        """`engine`'s stored keys, the most recently stored or routed to first (pending ones not)."""
        return reversed(self._blocks.get(engine, _NO_BLOCKS))

    def size(self, engine: str) -> int:
        blocks = self._blocks.get(engine)
        return 0 if blocks is None else len(blocks)

    def __len__(self) -> int:
        return len(self._owners)
