"""The routing plan of one request: decode ranking, route and its reason, prefill ranking.

Everything here is a pure function of the request's features and a snapshot of the pool (and,
for the `predictive` policy, of the predictor's ledgers); the proxy gathers the inputs, calls
`plan_route` and carries the plan out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from tandem.common.routing import DisaggregationConfig
from tandem.router.config import RouterConfig
from tandem.router.engines import Engine
from tandem.router.predict.candidate import Placement, PlacementInputs
from tandem.router.predict.output_length import LengthKeys
from tandem.router.predict.placement import decided_alone, place
from tandem.router.predict.predictor import Predictor
from tandem.router.predict.slo import SloTarget
from tandem.router.rendezvous import hrw_order
from tandem.router.scoring import Choice, adapter_score, score_engines


class Route(StrEnum):
    DISAGGREGATED = "disaggregated"
    LOCAL = "local"  # the decode (or colocated) engine prefills itself


class Reason(StrEnum):
    """Why a request took its route; the label of `tandem_router_decisions_total`."""

    DISAGGREGATED = "disaggregated"
    LOCAL = "local"
    FALLBACK = "fallback"  # P/D was wanted but no prefill engine could serve it


def decide_route(
    uncached_tokens: int,
    prefill_engines: Sequence[Engine],
    decode_engine: Engine,
    config: DisaggregationConfig,
    n: int = 1,
) -> Route:
    """P/D when the prompt is worth moving, else local.

    never                                  -> local
    n > 1                                  -> local (a prefill answer hands off one sequence's KV)
    no healthy prefill engine              -> local (fallback)
    decode engine is colocated             -> local (nothing to hand off)
    always                                 -> disaggregated
    auto: uncached < min_uncached_tokens   -> local (short or mostly cached prompt: a hop costs more)
          min prefill load >= max_prefill_queue -> local (prefill pool saturated)
          otherwise                        -> disaggregated
    `uncached` counts prompt tokens the decode engine does not hold in its prefix cache.
    """
    rules = config
    if rules.mode == "never" or n != 1 or not prefill_engines or decode_engine.colocated:
        return Route.LOCAL
    if rules.mode == "always":
        return Route.DISAGGREGATED
    if uncached_tokens < rules.min_uncached_tokens:
        return Route.LOCAL
    if min(e.load() for e in prefill_engines) >= rules.max_prefill_queue:
        return Route.LOCAL
    return Route.DISAGGREGATED


@dataclass(slots=True)  # per request: a frozen one's __init__ takes ~5x as long
class RouteInputs:
    """What `plan_route` reads: the request's features and the pool as the proxy saw it."""

    prompt_tokens: int
    total_blocks: int
    n: int
    decoders: Sequence[Engine]  # healthy decode (and colocated) engines
    prefillers: Sequence[Engine]  # healthy prefill-only engines
    any_prefill_configured: bool  # a prefill-only engine exists, healthy or not
    hits: Mapping[str, int]  # engine id -> prompt blocks cached there
    cached_blocks: Mapping[str, int]  # engine id -> blocks the index holds for it
    first_block_key: int | None = None  # the first block, keyed alike by every replica (affinity)
    session: str | None = None  # the client's session id (session header)
    adapter: str | None = None  # the LoRA adapter the request names (None: the base model)
    predictive: PredictiveInputs | None = None  # set under the `predictive` policy


@dataclass(slots=True)  # per request: a frozen one's __init__ takes ~5x as long
class PredictiveInputs:
    """What the `predictive` policy adds: the predictor's ledgers, what its output length is
    predicted from and its SLO targets."""

    predictor: Predictor
    target: SloTarget
    keys: LengthKeys  # the request's output-length keys, learned from once it is answered
    max_tokens: int | None  # the client's bound on the output
    now: float  # monotonic seconds when the request was planned


@dataclass(slots=True)  # per request: a frozen one's __init__ takes ~5x as long
class RoutePlan:
    decode_ranking: list[Choice]  # best first (see `decode_ranking`); never empty
    route: Route
    reason: Reason
    prefill_ranking: list[Choice]  # best first; empty unless disaggregated
    placement: Placement | None = None  # the predictions behind it (`predictive` policy)
    # or, for a plan decided without them (`placement.decided_alone`), what makes them later
    place_later: Callable[[], Placement] | None = None

    @property
    def decode(self) -> Choice:
        return self.decode_ranking[0]


def rendezvous_order(ranked: list[Choice], key: str | int | None) -> list[Choice]:
    """The candidates in rendezvous order for `key`: the highest weight(key, engine id) first.
    `ranked` holds only engines within the load bound, so a key whose engine is over it (or
    unhealthy, or gone) goes to its next engine in HRW order, and comes back when its engine is a
    candidate again. Every replica with the same view of the pool picks alike, with no table."""
    if key is None:
        return ranked
    return hrw_order(key, ranked, lambda choice: choice.engine.id)


def decode_ranking(inputs: RouteInputs, config: RouterConfig) -> list[Choice]:
    """The scored ranking, reordered by rendezvous hashing where replicas must agree on their own:

    a session                                -> rendezvous order of the session id, among
                                                engines within the session load bound (all
                                                healthy ones when it is unset);
    no candidate holds a block of the prompt -> rendezvous order of the first block key,
                                                among engines within the load bound.
    A prefix new to one replica may be new to all, or already sent elsewhere by another replica
    whose KV events (exact index) have not arrived yet, or which this replica never learns of
    (approximate index, built from its own routing history): the engine every replica picks for a
    new prefix is where an earlier replica most likely put it (docs/router.md, "Several router
    replicas"). Load, KV usage and spread differ between replicas (each counts its own
    requests), so they must not decide where a new prefix goes; the load bound keeps them honest.
    For a request to a LoRA adapter the rendezvous order of a new prefix runs within each adapter
    tier (`scorers/lora_affinity.py`: running there, then a free slot, then a wait), best first,
    unless its weight is 0.
    """
    if inputs.session is not None:
        scoring = config.scoring
        bound = scoring.session_load_bound_factor
        factor = math.inf if bound is None else max(bound, scoring.load_bound_factor)
        return rendezvous_order(rank(inputs.decoders, inputs, config, factor), inputs.session)
    ranked = rank(inputs.decoders, inputs, config)
    if not any(choice.hit_blocks for choice in ranked):
        adapter = inputs.adapter
        if adapter is None or not config.scoring.lora_affinity_weight:
            return rendezvous_order(ranked, inputs.first_block_key)
        tiers = sorted({adapter_score(adapter, c.engine) for c in ranked}, reverse=True)
        return [
            choice
            for tier in tiers
            for choice in rendezvous_order(
                [c for c in ranked if adapter_score(adapter, c.engine) == tier],
                inputs.first_block_key,
            )
        ]
    return ranked


def rank(
    engines: Sequence[Engine],
    inputs: RouteInputs,
    config: RouterConfig,
    load_bound_factor: float | None = None,
) -> list[Choice]:
    """`score_engines` over `engines` with the request's hits (spread only between several)."""
    sizes = inputs.cached_blocks if len(engines) > 1 else None
    return score_engines(
        engines,
        inputs.hits,
        inputs.total_blocks,
        config.scoring,
        sizes,
        inputs.first_block_key,
        load_bound_factor,
        inputs.adapter,
    )


def plan_route(inputs: RouteInputs, config: RouterConfig) -> RoutePlan | None:
    """The plan for one request, or None when no decode engine is healthy.

    decode ranking = score_engines(decoders), reordered by `decode_ranking`'s rendezvous rules;
    route = decide_route(prompt_tokens - hit_blocks(best) * block_size, ...);
    reason = the route, or `fallback` when it is local only because every prefill engine is down;
    prefill ranking = score_engines(prefillers) when disaggregated;
    under the `predictive` policy (`inputs.predictive` set) all of it is `predictive_plan`'s.
    """
    if not inputs.decoders:
        return None
    if inputs.predictive is not None:
        return predictive_plan(inputs, inputs.predictive, config)
    ranked = decode_ranking(inputs, config)
    best = ranked[0]
    uncached = max(inputs.prompt_tokens - best.hit_blocks * config.block_size, 0)
    route = decide_route(uncached, inputs.prefillers, best.engine, config.disaggregation, inputs.n)
    if route is Route.DISAGGREGATED:
        return RoutePlan(
            ranked, route, Reason.DISAGGREGATED, rank(inputs.prefillers, inputs, config)
        )
    return RoutePlan(ranked, route, _local_reason(inputs, config), [])


def _local_reason(inputs: RouteInputs, config: RouterConfig) -> Reason:
    """`fallback` when a local route is only for want of a healthy prefill engine."""
    prefill_down = (
        not inputs.prefillers
        and inputs.any_prefill_configured
        and config.disaggregation.mode != "never"
    )
    return Reason.FALLBACK if prefill_down else Reason.LOCAL


def predictive_plan(
    inputs: RouteInputs, predictive: PredictiveInputs, config: RouterConfig
) -> RoutePlan:
    """The `predictive` policy's plan: `placement.place` over the healthy engines.

    A session keeps its engine (the first of `decode_ranking`'s rendezvous order, the same on
    every replica; the rest of that order follows for retries); the prediction then decides only
    P/D or local. `n > 1` never disaggregates (a prefill answer hands off one sequence's KV).
    A plan that no prediction could change (`placement.decided_alone`) leaves them to
    `place_later`: the output length and the placement, as of now, once the request is sent.
    """
    decoders: Sequence[Engine] = inputs.decoders
    session_order: list[Engine] = []
    if inputs.session is not None:
        session_order = [choice.engine for choice in decode_ranking(inputs, config)]
        decoders = session_order[:1]
    predictor = predictive.predictor
    predictor.settle()  # the requests placed before it, in the ledgers and the size means
    settings = config.scoring.predictive
    prefillers = inputs.prefillers if inputs.n == 1 else ()
    mode = config.disaggregation.mode
    hits = inputs.hits

    def placement_now() -> Placement:
        # now, or for a plan decided alone at the `Predictor.settle` that takes its ticket's
        # share: nothing placed after it is in the ledgers and means before then
        return place(
            decoders,
            prefillers,
            predictor.ledger,
            PlacementInputs(
                inputs.prompt_tokens,
                config.block_size,
                hits,
                predictor.lengths.predict(predictive.keys, predictive.max_tokens),
                predictive.target,
                settings.meet_probability,
                settings.interference_budget,
                predictor.mean_uncached_tokens,
                predictor.mean_uncached_pairs,
                predictor.mean_stream_tokens,
                predictive.now,
                inputs.first_block_key,
                settings.reprobe_seconds,
            ),
            mode,
        )

    if decided_alone(decoders, prefillers, predictor.ledger, predictive.target, mode):
        ranked = [*decoders, *session_order[1:]]
        decode = [Choice(engine, 0.0, hits.get(engine.id, 0)) for engine in ranked]
        reason = _local_reason(inputs, config)
        return RoutePlan(decode, Route.LOCAL, reason, [], place_later=placement_now)
    placement = placement_now()
    ranking = [*placement.ranking, *session_order[1:]]
    decode = [Choice(engine, 0.0, hits.get(engine.id, 0)) for engine in ranking]
    if placement.prefill is not None:
        prefill = [Choice(e, 0.0, hits.get(e.id, 0)) for e in placement.prefill_ranking]
        return RoutePlan(decode, Route.DISAGGREGATED, Reason.DISAGGREGATED, prefill, placement)
    return RoutePlan(decode, Route.LOCAL, _local_reason(inputs, config), [], placement)
