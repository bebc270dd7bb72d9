"""Decisions of a router that runs several processes on one port (see supervisor.py for the I/O).

Each worker process is a whole router; what is per router is split among them:

    worker limit = ceil(limit / processes)

for admission's `maxInFlight`, `maxQueue` and `maxQueuePerPriority`, so the processes together admit
at least what one router would (at most `processes - 1` more), without a shared counter that would
cost a cross-process round trip per request. `http.maxConnections` stays per process: it bounds one
process's sockets and memory, and the kernel spreads connections over the processes unevenly.

A worker that exits is restarted after

    delay = min(RESTART_BASE_S * 2 ** (exits in the last RESTART_WINDOW_S - 1), RESTART_CAP_S)

so a worker that keeps crashing is restarted at most once per `RESTART_CAP_S`.

The engines as the router sees them (`GET /engines`) are one list over the workers
(`merge_engine_views`): each process probes, counts and indexes on its own, so per engine

    healthy   = healthy in every process        in_flight = sum over processes
    *_blocks  = max over processes              kv_events_replays, _replay_rounds,
                                                _resubscribes, _catch_ups = sums
    kv_events_last_seq = max over processes     the scraped figures: the first process's

    removal_cost = mean over processes

(the block counts are copies of one index fed by the same KV events, so their maximum is its
size; a removal cost is the same in every process on the exact index, and on the approximate one
each process has seen its share of the routes, so the mean keeps the engines' order), and
`processes` keeps each process's own healthy, in_flight, block counts and last
sequence number (a process whose subscription lags shows there).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tandem.router.config import RouterConfig

RESTART_BASE_S = 0.25
RESTART_CAP_S = 30.0
RESTART_WINDOW_S = 120.0


def split_limit(limit: int, processes: int) -> int:
    """One process's share of a per-router limit: ceil(limit / processes), at least 1."""
    return max(1, -(-limit // processes))


def worker_config(config: RouterConfig, port: int) -> RouterConfig:
    """The configuration of one worker of `config`: one process on the shared `port`, its share
    of the admission limits and token rates, its admin endpoint on a private port (the supervisor serves the
    configured one)."""
    n = config.processes
    admission = config.admission
    per_priority = admission.max_queue_per_priority
    return config.model_copy(
        update={
            "processes": 1,
            "port": port,
            "admission": admission.model_copy(
                update={
                    "max_in_flight": split_limit(admission.max_in_flight, n),
                    "max_queue": split_limit(admission.max_queue, n),
                    "max_queue_per_priority": (
                        None if per_priority is None else split_limit(per_priority, n)
                    ),
                }
            ),
            "tenancy": config.tenancy.divided(n),
            "trust": config.trust.model_copy(update={"admin_port": 0}),
        }
    )


def restart_delay(exits: Sequence[float], now: float) -> float:
    """Seconds to wait before restarting a worker whose exits happened at monotonic `exits`."""
    recent = sum(1 for t in exits if now - t <= RESTART_WINDOW_S)
    if recent == 0:
        return 0.0
    return float(min(RESTART_BASE_S * 2 ** (recent - 1), RESTART_CAP_S))


# Per-process figures of an engine that `merge_engine_views` combines, and how.
_SUMMED = (
    "in_flight",
    "kv_events_replays",
    "kv_events_replay_rounds",
    "kv_events_resubscribes",
    "kv_events_catch_ups",
)
_LARGEST = ("indexed_blocks", "history_blocks", "kv_events_last_seq")
_PER_PROCESS = (
    "healthy",
    "in_flight",
    "indexed_blocks",
    "history_blocks",
    "kv_events_last_seq",
    "removal_cost",
)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def merge_engine_views(
    views: Sequence[tuple[str, Sequence[Mapping[str, Any]]]],
) -> list[dict[str, Any]]:
    """One `GET /engines` list from each process's (index, list), by engine url in the order
    first seen; the rules are in the module docstring."""
    by_url: dict[str, list[tuple[str, Mapping[str, Any]]]] = {}
    for process, engines in views:
        for engine in engines:
            by_url.setdefault(engine["url"], []).append((process, engine))
    return [_merge_engine(seen) for seen in by_url.values()]


def _merge_engine(seen: list[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    merged = dict(seen[0][1])
    merged["healthy"] = all(engine["healthy"] for _, engine in seen)
    merged["draining"] = any(engine.get("draining") for _, engine in seen)
    for keys, combine in ((_SUMMED, sum), (_LARGEST, max), (("removal_cost",), _mean)):
        for key in keys:
            values = [engine[key] for _, engine in seen if engine.get(key) is not None]
            merged[key] = combine(values) if values else None
    merged["processes"] = {
        process: {key: engine.get(key) for key in _PER_PROCESS} for process, engine in seen
    }
    return merged
