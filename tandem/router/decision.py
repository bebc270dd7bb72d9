"""Whether a request is disaggregated (prefill pod, then decode pod) or prefilled on the decode pod."""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

from tandem.router.config import DisaggregationConfig
from tandem.router.engines import Engine


class Route(StrEnum):
    DISAGGREGATED = "disaggregated"
    LOCAL = "local"  # the decode (or colocated) engine prefills itself


def decide_route(
    uncached_tokens: int,
    prefill_engines: Sequence[Engine],
    decode_engine: Engine,
    config: DisaggregationConfig,
) -> Route:
    """P/D when the prompt is worth moving, else local.

    never                                  -> local
    no healthy prefill engine              -> local (fallback)
    decode engine is colocated             -> local (nothing to hand off)
    always                                 -> disaggregated
    auto: uncached < min_uncached_tokens   -> local (short or mostly cached prompt: a hop costs more)
          min prefill load >= max_prefill_queue -> local (prefill pool saturated)
          otherwise                        -> disaggregated
    `uncached` counts prompt tokens the decode engine does not hold in its prefix cache.
    """
    if config.mode == "never" or not prefill_engines or decode_engine.colocated:
        return Route.LOCAL
    if config.mode == "always":
        return Route.DISAGGREGATED
    if uncached_tokens < config.min_uncached_tokens:
        return Route.LOCAL
    if min(e.load() for e in prefill_engines) >= config.max_prefill_queue:
        return Route.LOCAL
    return Route.DISAGGREGATED
