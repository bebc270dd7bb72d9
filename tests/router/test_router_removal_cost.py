"""Engine removal cost: the formula (`removal_cost.py`), the index order it reads, and the figures
a running router serves in /engines and /metrics on the exact and the approximate index."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from router_harness import Engine, Router, completion, metrics, running

from tandem.router.config import RouterConfig
from tandem.router.engines import Engine as RouterEngine
from tandem.router.fallback_tokenizer import FALLBACK_TOKENIZER
from tandem.router.index import PrefixIndex
from tandem.router.processes import merge_engine_views
from tandem.router.removal_cost import (
    RemovalCostCache,
    index_snapshot,
    pool_of,
    removal_costs,
    snapshot_costs,
)
from tandem.router.service import RouterService


def test_only_blocks_no_other_engine_holds_count() -> None:
    costs = removal_costs({"a": [1, 2, 3], "b": [3, 4, 5]})
    # N = 3: ranks 0, 1, 2 weigh 1, 2/3, 1/3; block 3 is on both engines.
    assert costs["a"] == pytest.approx(1 + 2 / 3)
    assert costs["b"] == pytest.approx(2 / 3 + 1 / 3)


def test_an_engine_whose_blocks_are_all_held_elsewhere_costs_nothing() -> None:
    costs = removal_costs({"a": [1, 2], "b": [2, 1, 7], "c": [7, 8]})
    assert costs["a"] == 0.0
    assert costs["b"] == 0.0  # 1, 2 on a and 7 on c
    assert costs["c"] == pytest.approx(2 / 3)  # block 8 at rank 1 of N = 3


def test_cold_unique_blocks_cost_less_than_fresh_ones() -> None:
    shared = list(range(100, 110))
    fresh = removal_costs({"hot": [1, 2, *shared], "cold": [*shared, 1_000, 1_001], "x": shared})
    # Same number of unique blocks; "hot" used them last, "cold" is about to evict them.
    assert fresh["hot"] > fresh["cold"] > 0.0
    assert fresh["x"] == 0.0


def test_weights_are_against_the_largest_cache_of_the_pool() -> None:
    costs = removal_costs({"big": list(range(10)), "small": [100]})
    assert costs["big"] == pytest.approx(sum(1 - i / 10 for i in range(10)))
    assert costs["small"] == 1.0  # its one block is fresh


def test_empty_pool_and_empty_engines() -> None:
    assert removal_costs({}) == {}
    assert removal_costs({"a": [], "b": []}) == {"a": 0.0, "b": 0.0}
    assert removal_costs({"only": [5, 6]}) == {"only": pytest.approx(1 + 1 / 2)}


def test_pools_are_costed_apart() -> None:
    index = PrefixIndex()
    index.store("p", [1, 2])
    index.store("d1", [1, 2])
    index.store("d2", [3])
    costs = snapshot_costs(index_snapshot(index, {"p": "prefill", "d1": "decode", "d2": "decode"}))
    # The prefill pod's blocks are on a decode pod too, but no other prefill pod holds them.
    assert costs["p"] == pytest.approx(1 + 1 / 2)
    assert costs["d1"] == pytest.approx(1 + 1 / 2)
    assert costs["d2"] == 1.0
    assert pool_of(["prefill", "decode"]) == "worker"
    assert pool_of(["decode"]) == "decode"


def test_index_order_is_most_recently_stored_or_routed_to_first() -> None:
    index = PrefixIndex()
    index.store("e", [1, 2, 3])
    assert list(index.newest_first("e")) == [3, 2, 1]
    index.add_pending("e", [1, 9])  # a request routed to e uses block 1 again
    assert list(index.newest_first("e")) == [1, 3, 2]
    index.touch("e", [2])
    assert list(index.newest_first("e")) == [2, 1, 3]
    assert list(index.newest_first("unknown")) == []


def test_costs_are_served_at_once_and_recomputed_off_the_loop_when_old() -> None:
    index = PrefixIndex()
    index.store("e", [1])
    now = [0.0]
    cache = RemovalCostCache(lambda: index_snapshot(index, {"e": "decode"}), 5.0, lambda: now[0])

    async def scenario() -> None:
        assert cache.read() == {"e": 1.0}  # the first reading is computed in place
        index.store("e", [2])
        now[0] = 4.0
        assert cache.read() == {"e": 1.0}  # fresh enough
        now[0] = 6.0
        assert cache.read() == {"e": 1.0}  # old: served, and a recomputation starts
        for _ in range(200):
            await asyncio.sleep(0.01)
            if cache.read() != {"e": 1.0}:
                break
        assert cache.read() == {"e": pytest.approx(1.0 + 0.5)}

    asyncio.run(scenario())


def test_processes_report_the_mean_cost() -> None:
    view = {"url": "http://e", "healthy": True, "in_flight": 0}
    merged = merge_engine_views(
        [("0", [{**view, "removal_cost": 4.0}]), ("1", [{**view, "removal_cost": 2.0}])]
    )
    assert merged[0]["removal_cost"] == 3.0
    assert merged[0]["processes"]["1"]["removal_cost"] == 2.0


PROMPTS = [
    f"tenant {n} sends the same long instructions every time, tenant {n} again and again. " * 6
    for n in range(4)
]


def _gauge(text: str) -> dict[str, float]:
    for family in text_string_to_metric_families(text):
        if family.name == "tandem_router_engine_removal_cost":
            return {s.labels["endpoint"]: s.value for s in family.samples}
    raise AssertionError("no tandem_router_engine_removal_cost in /metrics")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("index", ["exact", "approximate"])
def test_router_serves_each_engines_removal_cost(index: str) -> None:
    extra = ["--model", "llama-without-local-tokenizer"]  # emulators tokenize by the fallback
    a = Engine(None, extra=extra, kv_events=True)
    b = Engine(None, extra=extra, kv_events=True)
    args = [*("--worker", a.url, "--worker", b.url), "--tokenizer", FALLBACK_TOKENIZER]
    if index == "exact":
        args += [
            *("--kv-events", f"{a.url}={a.events},{a.replay}"),
            *("--kv-events", f"{b.url}={b.events},{b.replay}"),
        ]
    else:
        args += ["--no-kv-events"]
    with running(a, b):
        router = Router(args)
        with running(router):
            served: dict[str, int] = {a.url: 0, b.url: 0}
            for prompt in PROMPTS:
                response = completion(router, prompt)
                assert response.status_code == 200
                served[response.headers["x-tandem-decode-engine"]] += 1
            # The exact index fills as the engines' KV events arrive, and the costs are
            # recomputed every few seconds: wait until both readings show every engine's blocks.
            deadline = time.monotonic() + 30
            while True:
                engines = {e["url"]: e for e in httpx.get(router.url + "/engines").json()}
                gauge = _gauge(metrics(router.url))
                costs = {url: engines[url]["removal_cost"] for url in served}
                # Distinct prompts: every block an engine holds is its own.
                if all((costs[url] > 0) == (n > 0) for url, n in served.items()) and all(
                    gauge[url] == pytest.approx(cost) for url, cost in costs.items()
                ):
                    break
                assert time.monotonic() < deadline, (engines, gauge)
                time.sleep(0.2)


def test_the_gauge_names_each_engines_pod_as_discovery_found_it() -> None:
    # Kubernetes discovery labels an engine with its pod (discovery/kubernetes.py); no engine
    # process is needed to render the gauge of an engine the approximate index has seen.
    config = RouterConfig.model_validate(
        {"servedModelName": "tiny", "kvEvents": False, "static": {"decode": []}}
    )
    service = RouterService(config)
    labels = {"pod": "llama-decode-5d9c-abcde", "namespace": "serving"}
    service.add_engine(RouterEngine("http://10.0.0.7:8000", frozenset({"decode"}), labels=labels))
    service.add_engine(RouterEngine("http://10.0.0.8:8000", frozenset({"decode"})))
    service.state.approx_index.touch("http://10.0.0.7:8000", [1, 2, 3])

    async def render() -> str:
        return service.metrics.render().decode()

    [family] = [
        f
        for f in text_string_to_metric_families(asyncio.run(render()))
        if f.name == "tandem_router_engine_removal_cost"
    ]
    by_pod = {s.labels["engine_pod"]: s for s in family.samples}
    assert by_pod["llama-decode-5d9c-abcde"].labels["pool"] == "decode"
    assert by_pod["llama-decode-5d9c-abcde"].value == pytest.approx(1 + 2 / 3 + 1 / 3)
    assert by_pod[""].value == 0.0  # a static engine has no pod
