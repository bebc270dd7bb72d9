"""Picks an engine: load-bound filter, then the weighted sum of the scorers, ties to the least busy."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tandem.common.routing import ScoringConfig
from tandem.router.engines import Engine
from tandem.router.scorers.affinity import affinity_score
from tandem.router.scorers.kv_usage import kv_usage_score
from tandem.router.scorers.load_bound import within_load_bound
from tandem.router.scorers.lora_affinity import lora_affinity_score
from tandem.router.scorers.prefix import prefix_score
from tandem.router.scorers.queue import queue_score
from tandem.router.scorers.spread import spread_score


@dataclass(slots=True)  # per request: a frozen one's __init__ takes ~5x as long
class Choice:
    engine: Engine
    score: float
    hit_blocks: int


def score_engines(
    engines: Sequence[Engine],
    hits: Mapping[str, int],
    total_blocks: int,
    weights: ScoringConfig,
    cached_blocks: Mapping[str, int] | None = None,
    affinity_key: int | None = None,
    load_bound_factor: float | None = None,
    adapter: str | None = None,
) -> list[Choice]:
    """Candidates within the load bound (`load_bound_factor`, else the weights'; infinite: every
    engine), best first.

    score = w_prefix * prefix + w_queue * queue + w_kv * kv + w_spread * spread
            + w_affinity * affinity + w_lora * lora_affinity
    (each in [0, 1], see `scorers/`; spread needs `cached_blocks`, the index's block count per
    engine; affinity the request's first block key; lora_affinity only for a request to an
    `adapter`); ties go to the smaller load, then to fewer
    in-flight requests, then to the higher affinity — or at random for a prompt without a full
    block, which has no prefix for replicas to agree on and should not favour the first engine.
    """
    if not engines:
        return []
    if len(engines) == 1:  # nothing to choose: skip the arithmetic
        engine = engines[0]
        return [Choice(engine, 0.0, hits.get(engine.id, 0))]
    loads = [e.load(weights.running_weight) for e in engines]
    factor = weights.load_bound_factor if load_bound_factor is None else load_bound_factor
    keep = within_load_bound(loads, factor, weights.load_bound_slack)
    max_load = max(loads)
    cached = cached_blocks or {}
    max_cached = max(cached.values(), default=0)
    ranked: list[tuple[float, float, int, float, Choice]] = []
    for engine, load, ok in zip(engines, loads, keep, strict=True):
        if not ok:
            continue
        hit = hits.get(engine.id, 0)
        affinity = (
            random.random() if affinity_key is None else affinity_score(affinity_key, engine.id)
        )
        score = (
            weights.prefix_weight * prefix_score(hit, total_blocks)
            + weights.queue_weight * queue_score(load, max_load)
            + weights.kv_usage_weight * kv_usage_score(engine.kv_usage)
            + weights.spread_weight * spread_score(cached.get(engine.id, 0), max_cached)
        )
        if affinity_key is not None:
            score += weights.affinity_weight * affinity
        if adapter is not None:
            score += weights.lora_affinity_weight * adapter_score(adapter, engine)
        ranked.append((-score, load, engine.in_flight, -affinity, Choice(engine, score, hit)))
    ranked.sort(key=lambda r: r[:4])
    return [r[4] for r in ranked]


def adapter_score(adapter: str, engine: Engine) -> float:
    """`lora_affinity_score` of `engine` for a request to `adapter`."""
    slots = engine.lora
    return lora_affinity_score(
        adapter, engine.active_adapters(), slots.max_loras if slots is not None else None
    )
