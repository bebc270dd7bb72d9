"""PromQL for the planner's inputs (offered load, each pool's operating point) and their reading."""

from __future__ import annotations

import asyncio

from pydantic import ValidationError

from tandem.common.roles import Role
from tandem.observability.names import ENGINE_PROMPT_TOKENS_BY_SOURCE
from tandem.operator.autoscaling.planner_signals import PlannerSignals, PoolLoad
from tandem.operator.autoscaling.prometheus import PrometheusClient, PrometheusUnavailable
from tandem.operator.autoscaling.queries import PoolSelector, _duration, series

# Each pool's mean latency: a prefill request's prefill time, a decode token's inter-token gap.
MEAN_LATENCY: dict[Role, str] = {
    "prefill": "vllm:request_prefill_time_seconds",
    "decode": "vllm:inter_token_latency_seconds",
}
QUEUE_TIME = "vllm:request_queue_time_seconds"


def _rate(metric: str, selector: PoolSelector, window: str) -> str:
    return f"sum(rate({series(metric, selector)}[{window}]))"


def _ratio(numerator: str, denominator: str, selector: PoolSelector, window: str) -> str:
    return f"{_rate(numerator, selector, window)} / {_rate(denominator, selector, window)}"


def per_prompt_hit_rate(selector: PoolSelector, window: str) -> str:
    """The share of the pool's prompt tokens taken from its prefix caches, each prompt counted
    once: `vllm:prompt_tokens_by_source` local_cache_hit over local_cache_hit + local_compute."""
    by_source = series(ENGINE_PROMPT_TOKENS_BY_SOURCE, selector)[:-1].rstrip(",")

    def tokens(sources: str) -> str:
        return f'sum(rate({by_source},source=~"{sources}"}}[{window}]))'

    return f"{tokens('local_cache_hit')} / {tokens('local_cache_hit|local_compute')}"


def _prefix_hit_rate(selector: PoolSelector, window: str) -> str:
    """`per_prompt_hit_rate`, or for engines without its counters vLLM's lookup ratio
    prefix_cache_hits / queries (which counts a waiting request again at every step it is not
    admitted, and so reads high when the pool is full)."""
    lookups = _ratio(
        "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", selector, window
    )
    return f"({per_prompt_hit_rate(selector, window)}) or ({lookups})"


def planner_queries(prefill: PoolSelector, decode: PoolSelector, window_s: float) -> dict[str, str]:
    """One PromQL expression per planner input; `sel` is a pool's selector, w the window:

    - prompt_tokens_per_s:       sum(rate(vllm:prompt_tokens_total{prefill}[w]))
    - prompt_tokens_per_request: rate of vllm:request_prompt_tokens_sum / _count {prefill}
    - prefix_hit_rate:           rate of vllm:prompt_tokens_by_source_total {prefill}, source
                                 local_cache_hit over local_cache_hit + local_compute (each
                                 prompt once; `per_prompt_hit_rate`)
    - output_tokens_per_s:       sum(rate(vllm:generation_tokens_total{decode}[w]))
    - output_tokens_per_request: rate of vllm:request_generation_tokens_sum / _count {decode}
    - <pool>_engines, _waiting, _running: count / sum of vllm:num_requests_running / waiting
    - <pool>_latency: rate of the _sum / _count of vllm:request_prefill_time_seconds (prefill)
      or vllm:inter_token_latency_seconds (decode)
    - <pool>_queue: rate of the _sum / _count of vllm:request_queue_time_seconds
    """
    w = _duration(window_s)
    queries = {
        "prompt_tokens_per_s": _rate("vllm:prompt_tokens_total", prefill, w),
        "prompt_tokens_per_request": _ratio(
            "vllm:request_prompt_tokens_sum", "vllm:request_prompt_tokens_count", prefill, w
        ),
        "prefix_hit_rate": _prefix_hit_rate(prefill, w),
        "output_tokens_per_s": _rate("vllm:generation_tokens_total", decode, w),
        "output_tokens_per_request": _ratio(
            "vllm:request_generation_tokens_sum", "vllm:request_generation_tokens_count", decode, w
        ),
    }
    for selector in (prefill, decode):
        pool = selector.pool
        queries[f"{pool}_engines"] = f"count({series('vllm:num_requests_running', selector)})"
        queries[f"{pool}_waiting"] = f"sum({series('vllm:num_requests_waiting', selector)})"
        queries[f"{pool}_running"] = f"sum({series('vllm:num_requests_running', selector)})"
        queries[f"{pool}_latency"] = _ratio(
            MEAN_LATENCY[pool] + "_sum", MEAN_LATENCY[pool] + "_count", selector, w
        )
        queries[f"{pool}_queue"] = _ratio(QUEUE_TIME + "_sum", QUEUE_TIME + "_count", selector, w)
    return queries


def _load(observed: dict[str, float | None], pool: Role) -> PoolLoad:
    return PoolLoad(
        engines=int(observed[f"{pool}_engines"] or 0),
        waiting=observed[f"{pool}_waiting"] or 0.0,
        running=observed[f"{pool}_running"] or 0.0,
        latency_s=observed[f"{pool}_latency"],
        queue_s=observed[f"{pool}_queue"],
    )


async def read_planner_signals(
    client: PrometheusClient, prefill: PoolSelector, decode: PoolSelector, window_s: float
) -> PlannerSignals:
    """Run the planner's queries concurrently; raises PrometheusUnavailable if one fails or a
    value is outside what it can be (PlannerSignals' bounds)."""
    queries = planner_queries(prefill, decode, window_s)
    values = await asyncio.gather(*(client.value(q) for q in queries.values()))
    observed = dict(zip(queries, values, strict=True))
    try:
        return PlannerSignals(
            prompt_tokens_per_s=observed["prompt_tokens_per_s"] or 0.0,
            output_tokens_per_s=observed["output_tokens_per_s"] or 0.0,
            prompt_tokens_per_request=observed["prompt_tokens_per_request"],
            output_tokens_per_request=observed["output_tokens_per_request"],
            prefix_hit_rate=observed["prefix_hit_rate"],
            prefill=_load(observed, "prefill"),
            decode=_load(observed, "decode"),
        )
    except ValidationError as exc:
        problems = "; ".join(f"{e['loc']}={e.get('input')!r}: {e['msg']}" for e in exc.errors())
        raise PrometheusUnavailable(
            f"{client.base_url} returned implausible planner inputs: {problems}"
        ) from None
