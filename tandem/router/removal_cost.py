"""Removal cost of each engine of a pool: the cached work its removal would lose, from the prefix index.

For one pool with engines E, each engine e's blocks k_0, k_1, ... ordered most recently stored or
routed to first (`PrefixIndex.newest_first`), n_e of them:

    cost(e) = sum over i < n_e of  (1 - i / N) * [no other engine of E holds k_i]
    N       = max over e' in E of n_e'

The indicator counts only blocks the pool loses with e: a block another engine also holds stays
servable there. The weight is the share of its LRU life a block still has ahead, measured against
the largest cache of the pool (the stand-in for the engines' capacity, which the router does not
know): a block just used weighs 1, the block next in line for eviction in a full cache weighs
about 1/N, so a cold block costs little because the engine would soon evict it anyway. The unit is
the block: a cost of 100 is the loss of 100 fresh unique blocks. An engine with an empty index
costs 0; for a pool of one engine every block is unique.

The cheapest engine is the one to remove first. The operator turns the costs into the
`controller.kubernetes.io/pod-deletion-cost` annotation before a pool shrinks
(`tandem/operator/autoscaling/deletion_cost.py`).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence

from tandem.router.index import PrefixIndex


def removal_costs(blocks: Mapping[str, Sequence[int]]) -> dict[str, float]:
    """cost(e) of the module docstring for each engine of one pool; `blocks` maps each engine to
    its block keys, most recently used first."""
    holders: Counter[int] = Counter()
    for keys in blocks.values():
        holders.update(keys)
    largest = max((len(keys) for keys in blocks.values()), default=0)
    costs: dict[str, float] = {}
    for engine, keys in blocks.items():
        costs[engine] = sum(
            1.0 - rank / largest for rank, key in enumerate(keys) if holders[key] == 1
        )
    return costs


def pool_of(roles: Iterable[str]) -> str:
    """The pool an engine's roles put it in: `worker` for a colocated engine, else its role."""
    roles = frozenset(roles)
    return "worker" if len(roles) > 1 else next(iter(roles))


Snapshot = dict[str, dict[str, list[int]]]  # pool -> engine -> its keys, most recent first


def index_snapshot(index: PrefixIndex, pools: Mapping[str, str]) -> Snapshot:
    """Each engine's keys in `pools` (engine id -> pool), copied, grouped by pool: only engines of
    the same pool can serve a block in the removed one's place."""
    by_pool: Snapshot = {}
    for engine, pool in pools.items():
        by_pool.setdefault(pool, {})[engine] = list(index.newest_first(engine))
    return by_pool


def snapshot_costs(snapshot: Snapshot) -> dict[str, float]:
    """`removal_costs` of every pool of `snapshot`, each pool on its own."""
    costs: dict[str, float] = {}
    for blocks in snapshot.values():
        costs.update(removal_costs(blocks))
    return costs


class RemovalCostCache:
    """The last costs computed, served at once; a read of costs older than `max_age_s` starts a
    new computation off the event loop (the keys are copied on it, the arithmetic runs in a
    thread: a full index is millions of blocks and would stall requests for a second). So a
    reading is at most `max_age_s` plus one computation older than the read before it (reads
    far apart get the costs as of the previous read); the very first is computed in place.
    """

    def __init__(
        self,
        snapshot: Callable[[], Snapshot],
        max_age_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._snapshot = snapshot
        self.max_age_s = max_age_s
        self._clock = clock
        self._costs: dict[str, float] | None = None
        self._at = 0.0
        self._refresh: asyncio.Task[None] | None = None

    def read(self) -> dict[str, float]:
        if self._costs is None:
            self._costs, self._at = snapshot_costs(self._snapshot()), self._clock()
        elif self._clock() - self._at > self.max_age_s and (
            self._refresh is None or self._refresh.done()
        ):
            self._refresh = asyncio.get_running_loop().create_task(self._recompute())
        return self._costs

    async def _recompute(self) -> None:
        at = self._clock()
        self._costs = await asyncio.to_thread(snapshot_costs, self._snapshot())
        self._at = at
