"""Admission: a cap on requests in flight, and a bounded waiting queue per priority level.

Lower priority values are served first (as vLLM's `priority`); within a level, the earliest
deadline first (the least slack: the `predictive` policy passes arrival + TTFT target; the
`weighted` policy passes none, which is first come first served). A full level rejects at once
with a Retry-After estimate.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from dataclasses import dataclass, field


class QueueFull(Exception):
    def __init__(self, retry_after_s: int):
        super().__init__(f"admission queue full; retry after {retry_after_s}s")
        self.retry_after_s = retry_after_s


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
    priority: int
    deadline: float
    seq: int
    future: asyncio.Future[None] = field(compare=False)


class Admission:
    """`async with admission.slot(priority):` holds one of `max_in_flight` slots."""

    def __init__(
        self, max_in_flight: int, max_queue: int, max_queue_per_priority: int | None = None
    ):
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self.max_queue_per_priority = max_queue_per_priority or max_queue
        self.in_flight = 0
        self._heap: list[_Waiter] = []
        self._waiting_by_priority: dict[int, int] = {}
        self._seq = itertools.count()
        self.mean_service_s = 1.0  # exponentially weighted, updated by the proxy

    @property
    def waiting(self) -> int:
        return len(self._heap)

    def observe_service_time(self, seconds: float) -> None:
        self.mean_service_s += 0.05 * (seconds - self.mean_service_s)

    def try_acquire(self) -> bool:
        """Take a slot without waiting, if one is free and nobody is queued."""
        if self.in_flight < self.max_in_flight and not self._heap:
            self.in_flight += 1
            return True
        return False

    async def acquire(self, priority: int = 0, deadline: float = 0.0) -> None:
        if self.try_acquire():
            return
        level = self._waiting_by_priority.get(priority, 0)
        if len(self._heap) >= self.max_queue or level >= self.max_queue_per_priority:
            raise QueueFull(
                retry_after_seconds(len(self._heap), self.max_in_flight, self.mean_service_s)
            )
        future = asyncio.get_running_loop().create_future()
        waiter = _Waiter(priority, deadline, next(self._seq), future)
        heapq.heappush(self._heap, waiter)
        self._waiting_by_priority[priority] = level + 1
        try:
            await waiter.future
        except BaseException:
            if waiter.future.done() and not waiter.future.cancelled():
                self.release()  # the slot was handed over just as we were cancelled
            else:
                self._forget(waiter)
            raise

    def _forget(self, waiter: _Waiter) -> None:
        try:
            self._heap.remove(waiter)
        except ValueError:
            return
        heapq.heapify(self._heap)
        self._dec_level(waiter.priority)

    def _dec_level(self, priority: int) -> None:
        left = self._waiting_by_priority[priority] - 1
        if left:
            self._waiting_by_priority[priority] = left
        else:
            del self._waiting_by_priority[priority]

    def release(self) -> None:
        while self._heap:
            waiter = heapq.heappop(self._heap)
            self._dec_level(waiter.priority)
            if not waiter.future.done():
                waiter.future.set_result(None)  # the slot passes to the waiter
                return
        self.in_flight -= 1
