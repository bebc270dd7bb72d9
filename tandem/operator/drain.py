"""Drain-safe removal of engine pods: the preStop hook and vLLM's --shutdown-timeout of a pool.

A removed pod (scale-down, rollout, eviction, node drain) gets its deletionTimestamp; the router
drops it from its pool at once (its Pod watch), the preStop sleep lets every router replica see
that while the engine keeps serving, then SIGTERM makes vLLM 0.32 drain: it refuses new requests,
finishes the ones it holds and keeps a prefill's KV until the decode engine has pulled it, for up
to --shutdown-timeout seconds (docs/protocols.md §9), and exits. The kubelet's SIGKILL comes at
terminationGracePeriodSeconds.
"""

from __future__ import annotations

from typing import Any

from tandem.operator.api_engine import PoolSpec

# vLLM's teardown after its drain (engine-core and worker exit, memory freed) needs a few seconds
# before the kubelet's SIGKILL; at most this many, at most a third of the drain budget.
TEARDOWN_MARGIN_S = 10


def pre_stop_seconds(pool: PoolSpec) -> int:
    """The preStop sleep: drain.preStopSeconds, within the grace period."""
    return min(pool.drain.pre_stop_seconds, pool.termination_grace_period_seconds)


def shutdown_timeout(pool: PoolSpec) -> int:
    """vLLM's --shutdown-timeout for the pool's pods.

        budget  = terminationGracePeriodSeconds - preStop
        timeout = budget - min(TEARDOWN_MARGIN_S, budget // 3)

    0 (no grace left) is vLLM's abort mode: in-flight requests end at once.
    """
    budget = pool.termination_grace_period_seconds - pre_stop_seconds(pool)
    return budget - min(TEARDOWN_MARGIN_S, budget // 3)


def engine_lifecycle(pool: PoolSpec) -> dict[str, Any]:
    """The engine container's `lifecycle`: a preStop sleep, or nothing when it is 0.

    The sleep action (Kubernetes 1.30+) needs nothing from the vLLM image."""
    seconds = pre_stop_seconds(pool)
    if seconds == 0:
        return {}
    return {"lifecycle": {"preStop": {"sleep": {"seconds": seconds}}}}
