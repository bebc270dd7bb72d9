"""Admission: a cap on requests in flight, and a bounded waiting queue by priority and tenant.

Lower priority values are served first (as vLLM's `priority`), strictly. Within a priority level
the waiting requests of different tenants get weighted fair shares by start-time fair queueing:
with the level's virtual time V and each tenant t's finish tag F_t, a freed slot goes to

    t* = argmin_t max(V, F_t)      over the tenants waiting at the level (ties: earliest head)
    then  S = max(V, F_t*),  F_t* = S + 1 / w_t*,  V = S

so a tenant of weight w gets w / Σ w of the level's slots while it is backlogged, and one that
was idle starts at V (no credit saved up). Within a tenant, the earliest deadline first (the
`predictive` policy passes arrival + TTFT target; otherwise none: first come first served).

A tenant also has a guaranteed share of the slots, over the tenants A holding or awaiting one
(itself included):

    share_t = floor(max_in_flight · w_t / Σ_{a ∈ A} w_a)

and a request of a tenant holding fewer than share_t, with none of its own waiting, takes a slot
at once even when all `max_in_flight` are held: a quiet tenant never waits behind a loud one's
backlog, at the price of up to 2 · max_in_flight requests in flight. A released slot passes to a
waiter only while fewer than `max_in_flight` are held. With one tenant this is exactly the plain
priority queue.

A full queue (`max_queue` waiting, or `max_queue_per_priority` at the arrival's level) makes room
before it refuses (QueueFull: 429 with a Retry-After estimate), dropping in this order:
  1. the newest waiter of a sheddable level served after the arrival's (the worst level first);
  2. at the arrival's level, the newest waiter of the tenant most over its share, i.e. of largest
     waiting_t / w_t, if that exceeds the arrival tenant's (waiting + 1) / w;
and otherwise refuses the arrival.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field


class QueueFull(Exception):
    def __init__(self, retry_after_s: int, dropped: bool = False):
        super().__init__(f"admission queue full; retry after {retry_after_s}s")
        self.retry_after_s = retry_after_s
        self.dropped = dropped  # waited, then gave its place to a request ranked above it


def parse_priority(value: str | None) -> int:
    """The priority header as an int clamped to [-100, 100]; missing or malformed -> 0."""
    if not value:
        return 0
    try:
        return max(-100, min(100, int(value.strip())))
    except ValueError:
        return 0


def retry_after_seconds(waiting: int, max_in_flight: int, mean_service_s: float) -> int:
    """retry_after = ceil((waiting + 1) / max_in_flight * mean_service_s), at least 1 s, at most 60 s.

    The time for the queue ahead to drain at the current service rate.
    """
    estimate = (waiting + 1) / max(max_in_flight, 1) * max(mean_service_s, 0.0)
    return int(min(60, max(1, math.ceil(estimate))))


@dataclass(order=True)
class _Waiter:
    deadline: float
    seq: int
    future: asyncio.Future[None] = field(compare=False)
    tenant: str = field(compare=False)


@dataclass
class _Tenant:
    name: str
    weight: float
    finish: float = 0.0  # F_t
    waiters: list[_Waiter] = field(default_factory=list)  # a heap by (deadline, seq)


@dataclass
class _Level:
    virtual: float = 0.0  # V
    waiting: int = 0
    tenants: dict[str, _Tenant] = field(default_factory=dict)

    def next_tenant(self) -> _Tenant:
        """t* of the module docstring."""
        return min(
            (t for t in self.tenants.values() if t.waiters),
            key=lambda t: (max(self.virtual, t.finish), t.waiters[0]),
        )

    def heaviest(self) -> tuple[str, _Tenant] | None:
        """The tenant of largest waiting_t / w_t."""
        backlogged = [(n, t) for n, t in self.tenants.items() if t.waiters]
        return max(backlogged, key=lambda nt: len(nt[1].waiters) / nt[1].weight, default=None)


def _pop_newest(tenant: _Tenant) -> _Waiter:
    newest = max(tenant.waiters, key=lambda w: w.seq)
    tenant.waiters.remove(newest)
    heapq.heapify(tenant.waiters)
    return newest


def _never(priority: int) -> bool:
    return False


def _equal(tenant: str) -> float:
    return 1.0


class Admission:
    """`await admission.acquire(priority, deadline, tenant)` holds one of `max_in_flight` slots
    until `release()`.

    `sheddable(priority)` says whether a level may be dropped for requests ranked above it,
    `weight(tenant)` gives a tenant's weight (both fixed per value for the queue's lifetime).
    """

    def __init__(
        self,
        max_in_flight: int,
        max_queue: int,
        max_queue_per_priority: int | None = None,
        sheddable: Callable[[int], bool] = _never,
        weight: Callable[[str], float] = _equal,
    ):
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self.max_queue_per_priority = max_queue_per_priority or max_queue
        self.in_flight = 0
        self.dropped = 0  # waiters that gave their place to a request ranked above them
        self._running: dict[str, int] = {}  # slots held per tenant
        self._levels: dict[int, _Level] = {}
        self._waiting = 0
        self._seq = itertools.count()
        self._sheddable = sheddable
        self._weight = weight
        self.mean_service_s = 1.0  # exponentially weighted, updated by the proxy

    @property
    def waiting(self) -> int:
        return self._waiting

    def waiting_of(self, tenant: str) -> int:
        return sum(
            len(t.waiters) for level in self._levels.values() if (t := level.tenants.get(tenant))
        )

    def observe_service_time(self, seconds: float) -> None:
        self.mean_service_s += 0.05 * (seconds - self.mean_service_s)

    def try_acquire(self, tenant: str = "") -> bool:
        """Take a slot without waiting: one is free and nobody is queued, or the tenant holds
        fewer than its guaranteed share and has nobody queued."""
        if (self.in_flight < self.max_in_flight and not self._waiting) or self._under_share(tenant):
            self._take(tenant)
            return True
        return False

    def _take(self, tenant: str) -> None:
        self.in_flight += 1
        self._running[tenant] = self._running.get(tenant, 0) + 1

    def guaranteed_share(self, tenant: str) -> int:
        """share_t of the module docstring."""
        active = set(self._running)
        active.update(
            name
            for level in self._levels.values()
            for name, t in level.tenants.items()
            if t.waiters
        )
        active.add(tenant)
        total = sum(self._weight(name) for name in active)
        return int(self.max_in_flight * self._weight(tenant) / total)

    def _under_share(self, tenant: str) -> bool:
        running = self._running.get(tenant, 0)
        if running >= self.max_in_flight or self.waiting_of(tenant):
            return False
        return running < self.guaranteed_share(tenant)

    def _retry_after(self) -> int:
        return retry_after_seconds(self._waiting, self.max_in_flight, self.mean_service_s)

    async def acquire(self, priority: int = 0, deadline: float = 0.0, tenant: str = "") -> None:
        if self.try_acquire(tenant):
            return
        self._make_room(priority, tenant)
        level = self._levels.get(priority)
        if level is None:
            level = self._levels[priority] = _Level()
        queue = level.tenants.get(tenant)
        if queue is None:
            queue = level.tenants[tenant] = _Tenant(tenant, self._weight(tenant))
        future = asyncio.get_running_loop().create_future()
        waiter = _Waiter(deadline, next(self._seq), future, tenant)
        heapq.heappush(queue.waiters, waiter)
        level.waiting += 1
        self._waiting += 1
        try:
            await waiter.future
        except BaseException:
            future = waiter.future
            if not future.done() or future.cancelled():
                self._forget(priority, tenant, waiter)
            elif future.exception() is None:
                self.release(tenant)  # the slot was handed over just as we were cancelled
            raise

    def _make_room(self, priority: int, tenant: str) -> None:
        """Drops one waiter ranked below the arrival when the queue is full (module docstring),
        or raises QueueFull for the arrival."""
        level = self._levels.get(priority)
        level_full = level is not None and level.waiting >= self.max_queue_per_priority
        if self._waiting < self.max_queue and not level_full:
            return
        if not level_full:
            for worse in sorted((p for p in self._levels if p > priority), reverse=True):
                if self._sheddable(worse) and self._drop_heaviest(worse):
                    return
        if level is not None:
            heaviest = level.heaviest()
            own = level.tenants.get(tenant)
            share = (len(own.waiters) if own else 0) + 1
            if heaviest is not None and heaviest[0] != tenant:
                victim = heaviest[1]
                if len(victim.waiters) / victim.weight > share / self._weight(tenant):
                    self._drop(priority, _pop_newest(victim))
                    return
        raise QueueFull(self._retry_after())

    def _drop_heaviest(self, priority: int) -> bool:
        heaviest = self._levels[priority].heaviest()
        if heaviest is None:
            return False
        self._drop(priority, _pop_newest(heaviest[1]))
        return True

    def _drop(self, priority: int, waiter: _Waiter) -> None:
        self._unlink(priority)
        self.dropped += 1
        waiter.future.set_exception(QueueFull(self._retry_after(), dropped=True))

    def _forget(self, priority: int, tenant: str, waiter: _Waiter) -> None:
        """Takes a cancelled waiter out, unless `release` already skipped past it."""
        level = self._levels.get(priority)
        queue = level.tenants.get(tenant) if level is not None else None
        if queue is None or waiter not in queue.waiters:
            return
        queue.waiters.remove(waiter)
        heapq.heapify(queue.waiters)
        self._unlink(priority)

    def _unlink(self, priority: int) -> None:
        """Counts one waiter of the level gone; an empty level is forgotten with its
        virtual time (a new busy period starts from zero)."""
        level = self._levels[priority]
        level.waiting -= 1
        self._waiting -= 1
        if not level.waiting:
            del self._levels[priority]

    def release(self, tenant: str = "") -> None:
        """Gives back a slot of `tenant`; the next waiter takes it while fewer than
        `max_in_flight` are held (a tenant within its share may have taken one beyond)."""
        left = self._running[tenant] - 1
        if left:
            self._running[tenant] = left
        else:
            del self._running[tenant]
        self.in_flight -= 1
        while self._waiting and self.in_flight < self.max_in_flight:
            priority = min(self._levels)
            level = self._levels[priority]
            chosen = level.next_tenant()
            start = max(level.virtual, chosen.finish)
            chosen.finish = start + 1.0 / chosen.weight
            level.virtual = start
            waiter = heapq.heappop(chosen.waiters)
            level.waiting -= 1
            self._waiting -= 1
            if not level.waiting:
                del self._levels[priority]
            if not waiter.future.done():
                self._take(waiter.tenant)
                waiter.future.set_result(None)  # the slot passes to the waiter
