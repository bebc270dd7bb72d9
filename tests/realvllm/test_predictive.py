"""The predictive policy in front of a real vLLM prefill/decode pair whose pace nobody told it: every
request answered in full, each one routed local or disaggregated by prediction (the handoff over
real NIXL), and each first token it predicted set beside the one observed
(`tandem_router_prediction_error_ratio`), the P/D prefill's too."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from harness import PDCluster, Router, metrics_of, stream_completion, until

from tandem.router.engine_metrics import parse_engine_load

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PASSAGE = (
    "A predicted first token is the work queued ahead of it and its own, at the engine's pace. "
)
TOKENS = 8


@pytest.fixture(scope="module")
def router(pd_cluster: PDCluster) -> Iterator[Router]:
    pd_cluster.ensure_engines()
    # the manifest's scoring as the operator renders it (the engines' step budgets included)
    planned = pd_cluster.plan.router_config.scoring
    scoring = planned.model_copy(update={"policy": "predictive"})
    router = pd_cluster.router("router-predictive", tokenizer=None, scoring=scoring)
    router.wait_engines_healthy(set())  # engines restarted by the file before are seen up first
    yield router
    router.stop()


def answer(url: str, prompt: str) -> str:
    """Streams one completion of TOKENS tokens; returns the route the router took."""
    raw = stream_completion(url, prompt, TOKENS)
    chunks = list(raw.parse())
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.completion_tokens == TOKENS
    return raw.headers["x-tandem-route"]


def changed(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def settled_metrics(
    url: str, before: dict[str, float], timeout_s: float = 60.0
) -> dict[str, float]:
    """The router's metrics once all 12 requests have been scored: a request's prediction is
    scored as it ends, just after its last bytes reached the client."""
    name = "tandem_router_prediction_error_ratio_count{quantity=ttft}"
    seen: dict[str, float] = {}

    def scored() -> bool:
        seen.update(metrics_of(url))
        return changed(before, seen, name) >= 12

    until(scored, timeout_s, 0.1)
    return seen


def test_predictive_places_hands_off_and_scores_its_predictions(
    pd: PDCluster, router: Router
) -> None:
    before = metrics_of(router.url)
    prompts = [PASSAGE * (1 + i % 4) + f"Request {i}." for i in range(12)]
    routes = [answer(router.url, prompt) for prompt in prompts[:6]]  # one at a time
    with ThreadPoolExecutor(max_workers=6) as pool:  # then six at once
        routes += list(pool.map(lambda p: answer(router.url, p), prompts[6:]))
    after = settled_metrics(router.url, before)

    assert set(routes) <= {"local", "disaggregated"}, routes
    handed_off = routes.count("disaggregated")
    decided = {
        decision: changed(before, after, f"tandem_router_decisions_total{{decision={decision}}}")
        for decision in ("local", "disaggregated", "fallback")
    }
    assert decided == {"local": 12 - handed_off, "disaggregated": handed_off, "fallback": 0}
    error = "tandem_router_prediction_error_ratio"
    # every streamed answer's first token was predicted and observed; every handoff's prefill too
    assert changed(before, after, f"{error}_count{{quantity=ttft}}") == 12
    assert changed(before, after, f"{error}_count{{quantity=prefill}}") == handed_off
    ttft_error = changed(before, after, f"{error}_sum{{quantity=ttft}}") / 12
    print(f"routes {routes}; TTFT prediction error, mean of 12: {ttft_error:.0%}")


def test_the_kv_cache_size_is_read_from_each_engines_cache_config(router: Router) -> None:
    """The KV wait's K: num_gpu_blocks · block_size of vLLM's own `vllm:cache_config_info`."""
    engines = router.engines()
    assert len(engines) == 2
    for engine in engines:
        text = httpx.get(f"{engine['url']}/metrics", timeout=10).content
        capacity = parse_engine_load(text)["kv_capacity"]
        assert capacity > 0, engine["url"]
        assert engine["kv_capacity"] == capacity
