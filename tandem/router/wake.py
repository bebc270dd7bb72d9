"""Scale from zero on the request path: hold a request until a decode engine is ready, and count
the demand the autoscalers wake the pools on."""

from __future__ import annotations

import asyncio
import math
import time

from tandem.common.routing import DisaggregationConfig
from tandem.router.call import ClientError
from tandem.router.config import RouterConfig
from tandem.router.decision import RoutePlan
from tandem.router.engines import EnginePool
from tandem.router.errors import error_body
from tandem.router.features import Features
from tandem.router.metrics import RouterMetrics


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


class ScaleFromZero:
    """The request path's part in scale from zero: holding a request that found no decode
    engine (`EngineWait`), its 503 when none came, and the count of prefills P/D would have
    taken (the prefill pool's wake signal)."""

    def __init__(self, config: RouterConfig, pool: EnginePool, metrics: RouterMetrics) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self.engine_wait = EngineWait(pool)

    async def wait_for_engine(self) -> bool:
        """Holds the request while no decode engine is ready, up to `admission.engineWaitSeconds`
        (scale from zero); True when one became ready."""
        limit = self.config.admission.engine_wait_s
        if not limit:
            return False
        start = time.perf_counter()
        ready = await self.engine_wait.until_ready(limit)
        outcome = "ready" if ready else "timeout"
        self.metrics.child(self.metrics.engine_wait, outcome).observe(time.perf_counter() - start)
        return ready

    def no_engine(self) -> ClientError:
        """The 503 of a request that found no decode engine, after waiting `engineWaitSeconds`
        when that is set (Retry-After `wake.wait_retry_after_s`), at once otherwise (2 s)."""
        self.metrics.child(self.metrics.requests, "none", "503").inc()
        limit = self.config.admission.engine_wait_s
        retry_after = wait_retry_after_s(limit) if limit else 2
        message = "no healthy decode engine" + (f" after waiting {limit:g}s" if limit else "")
        return ClientError(503, error_body(503, message), [("retry-after", str(retry_after))])

    def count_prefill_wanted(
        self, plan: RoutePlan, features: Features, n: int, handed_off: bool
    ) -> None:
        """Counts a request prefilled on its decode engine that P/D would have taken
        (`wake.wants_prefill`): planned local for want of a ready prefill engine, or planned P/D
        and every prefill engine failed (or, at the endpoint picker, no relay could hand off)."""
        prefill_ready = any(not e.colocated for e in self.pool.candidates("prefill"))
        uncached = features.prompt_tokens - plan.decode.hit_blocks * self.config.block_size
        disaggregation = self.config.disaggregation
        local = not handed_off and not plan.decode.engine.colocated
        if wants_prefill(local, prefill_ready, uncached, n, disaggregation):
            self.metrics.prefill_wanted.inc()
