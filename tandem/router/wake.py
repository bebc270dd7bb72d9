"""Scale from zero on the request path: hold a request until a decode engine is ready, and count
the demand the autoscalers wake the pools on."""

from __future__ import annotations

import asyncio
import math
import time

from tandem.common.routing import DisaggregationConfig
from tandem.router.engines import EnginePool


class EngineWait:
    """Requests waiting for a decode engine to become ready; `held` is how many wait now.

    `held` is exported as `tandem_router_engine_wait_requests`: the signal on which the operator's
    autoscaler, KEDA or `tandem up` start the decode pool of a cluster scaled to zero.
    """

    def __init__(self, pool: EnginePool, poll_s: float = 0.05) -> None:
        self.pool = pool
        self.poll_s = poll_s
        self.held = 0

    async def until_ready(self, limit_s: float) -> bool:
        """Wait up to `limit_s` for a healthy decode engine; True when one is ready.

        It polls the pool every `poll_s`: health flips come from the engine monitor, discovery
        and the proxy's own failures, and a poll of a few tens of milliseconds is negligible
        beside an engine's start."""
        deadline = time.monotonic() + limit_s
        self.held += 1
        try:
            while not self.pool.candidates("decode"):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                await asyncio.sleep(min(self.poll_s, left))
            return True
        finally:
            self.held -= 1


def wait_retry_after_s(limit_s: float) -> int:
    """Retry-After of a request that waited `limit_s` without a decode engine getting ready:

        retry_after = ceil(limit_s / 2), at least 1 s, at most 60 s

    The pool has been starting for at least `limit_s`; half of it again is a fair guess at what
    is left, and a client that retries sooner only waits in the router's queue again."""
    return int(min(60, max(1, math.ceil(limit_s / 2))))


def wants_prefill(
    local: bool, prefill_ready: bool, uncached_tokens: int, n: int, config: DisaggregationConfig
) -> bool:
    """Whether a request went to a decode engine only because no prefill engine was ready, i.e.
    P/D would pay for it (`tandem_router_prefill_wanted_total`, which wakes a prefill pool that
    is at zero):

        local route, no prefill engine ready, n == 1, and
          mode always                          -> yes
          mode auto: uncached >= minUncachedTokens -> yes
          mode never                           -> no
    """
    if not local or prefill_ready or n != 1 or config.mode == "never":
        return False
    return config.mode == "always" or uncached_tokens >= config.min_uncached_tokens
