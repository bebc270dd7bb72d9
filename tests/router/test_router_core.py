"""Pure parts of the router: prefix index, block keys, scorers, scoring, P/D decision, admission."""

from __future__ import annotations

import asyncio
import base64
import json

import msgspec
import pytest
from tandem_process import GOLDEN

from tandem.common.block_hash import BlockHasher
from tandem.common.routing import DisaggregationConfig, ScoringConfig
from tandem.router.admission import Admission, QueueFull, parse_priority, retry_after_seconds
from tandem.router.blocks import block_keys, chain_seed
from tandem.router.decision import Route, decide_route
from tandem.router.engines import Engine
from tandem.router.features import Featurizer
from tandem.router.index import PrefixIndex
from tandem.router.kv_events import EngineBlockMap, decode_payload
from tandem.router.scorers.kv_usage import kv_usage_score
from tandem.router.scorers.load_bound import within_load_bound
from tandem.router.scorers.prefix import prefix_score
from tandem.router.scorers.queue import queue_score
from tandem.router.scorers.spread import spread_score
from tandem.router.scoring import score_engines


def test_index_longest_prefix_per_engine() -> None:
    index = PrefixIndex()
    keys = block_keys(list(range(64)), 16)
    index.store("a", keys[:3])
    index.store("b", keys[:1])
    index.store("c", keys[1:])  # holds later blocks but not the first: no prefix hit
    assert index.match(keys, ["a", "b", "c", "d"]) == {"a": 3, "b": 1, "c": 0, "d": 0}


def test_index_counts_duplicates_and_clears() -> None:
    index = PrefixIndex()
    index.store("a", [1, 2])
    index.store("a", [2])  # the same block stored twice must be removed twice
    index.remove("a", [2])
    assert index.match([1, 2], ["a"]) == {"a": 2}
    index.remove("a", [2])
    assert index.match([1, 2], ["a"]) == {"a": 1}
    index.clear("a")
    assert index.match([1, 2], ["a"]) == {"a": 0}
    assert len(index) == 0


def test_index_memory_bound_forgets_least_recent() -> None:
    index = PrefixIndex(max_blocks_per_engine=16)
    index.touch("a", range(100))
    assert index.size("a") == 16
    assert index.match([99], ["a"]) == {"a": 1}
    assert index.match([0], ["a"]) == {"a": 0}
    index.drop_engine("a")
    index.touch("b", [5])
    assert index.match([5], ["b"]) == {"b": 1}


def test_block_keys_are_prefix_stable_and_salted() -> None:
    a = block_keys(list(range(40)), 16)
    b = block_keys(list(range(32)) + [7] * 16, 16)
    assert len(a) == 2
    assert a[:2] == b[:2]
    assert block_keys(list(range(16)), 16, chain_seed("s"))[0] != a[0]
    assert block_keys(list(range(32)), 16)[1] == block_keys(list(range(16, 32)), 16, a[0])[0]


def test_featurizer_exact_with_tokenizer_and_approximate_without() -> None:
    exact = Featurizer(32, str(GOLDEN / "model"))
    record = json.loads(
        (GOLDEN / "kv_events/sha256_cbor/requests.jsonl").read_text().splitlines()[0]
    )
    features = exact.of_body(record["request"], chat=False)
    ids = record["response"]["choices"][0]["prompt_token_ids"]
    assert features.exact
    assert features.prompt_tokens == len(ids)
    assert features.keys == block_keys(ids, 32)
    approx = Featurizer(16)
    f1 = approx.of_body({"prompt": "x" * 200}, chat=False)
    assert not f1.exact
    assert f1.prompt_tokens == 50
    assert len(f1.keys) == 3
    chat = approx.of_body({"messages": [{"role": "user", "content": "hi " * 100}]}, chat=True)
    assert chat.prompt_tokens > 70


def test_golden_events_land_on_request_keys() -> None:
    """Replaying the real engine's frames puts R1's blocks in the index under the request's keys."""
    index = PrefixIndex()
    block_map = EngineBlockMap("e", index, 32, BlockHasher("sha256_cbor", 32, None))
    for line in (GOLDEN / "kv_events/sha256_cbor/frames_live.jsonl").read_text().splitlines():
        block_map.apply(decode_payload(base64.b64decode(json.loads(line)["frames_b64"][2]))[1])
    assert block_map.hash_config_matches is True
    record = json.loads(
        (GOLDEN / "kv_events/sha256_cbor/requests.jsonl").read_text().splitlines()[0]
    )
    choice = record["response"]["choices"][0]
    keys = block_keys(choice["prompt_token_ids"] + choice["token_ids"], 32)
    assert index.match(keys, ["e"]) == {"e": 2}
    salted = json.loads(
        (GOLDEN / "kv_events/sha256_cbor/requests.jsonl").read_text().splitlines()[2]
    )
    salted_keys = block_keys(salted["request"]["prompt"], 32, chain_seed("salt-1"))
    assert index.match(salted_keys, ["e"])["e"] >= 1


def test_golden_eviction_and_clear_sha256() -> None:
    index = PrefixIndex()
    block_map = EngineBlockMap("e", index, 32, BlockHasher("sha256_cbor", 32, None))
    removed = cleared = 0
    for line in (GOLDEN / "kv_events/sha256/frames_live.jsonl").read_text().splitlines():
        _, events = decode_payload(base64.b64decode(json.loads(line)["frames_b64"][2]))
        removed += sum(e["type"] == "BlockRemoved" for e in events)
        cleared += sum(e["type"] == "AllBlocksCleared" for e in events)
        block_map.apply(events)
    assert removed
    assert cleared
    assert block_map.hash_config_matches is False  # sha256 engine vs a sha256_cbor config
    assert 0 < index.size("e") <= 12  # after the clear only R7's blocks remain


def test_scorer_formulas() -> None:
    assert prefix_score(6, 8) == 0.75
    assert prefix_score(3, 0) == 0.0
    assert [queue_score(d, 7) for d in (0, 3, 7)] == [1.0, 0.625, 0.125]
    assert kv_usage_score(0.85) == pytest.approx(0.15)
    assert kv_usage_score(2) == 0.0
    assert within_load_bound([9, 1, 2], 1.5) == [False, True, True]
    assert [round(spread_score(b, 400), 4) for b in (100, 400, 0)] == [0.7506, 0.0025, 1.0]


def _engine(
    url: str, depth: int = 0, kv: float = 0.0, roles: tuple[str, ...] = ("decode",)
) -> Engine:
    return Engine(url, frozenset(roles), in_flight=depth, pending=depth, kv_usage=kv)


def test_scoring_prefers_prefix_then_spills_under_load() -> None:
    weights = ScoringConfig()
    a, b = _engine("a", depth=2), _engine("b", depth=1)
    ranked = score_engines([a, b], {"a": 8}, 8, weights)
    assert ranked[0].engine is a  # prefix 3 beats a queue difference
    hot = _engine("a", depth=30)
    ranked = score_engines([hot, b, _engine("c", 1)], {"a": 8}, 8, weights)
    assert hot not in [c.engine for c in ranked]  # load bound: the hot prefix spills
    fresh, full = _engine("fresh"), _engine("full")
    ranked = score_engines([full, fresh], {}, 8, weights, {"full": 500, "fresh": 0})
    assert ranked[0].engine is fresh  # a new prefix goes where the cache is least claimed


def test_decision_rules() -> None:
    config = DisaggregationConfig()
    p, d = _engine("p", roles=("prefill",)), _engine("d")
    assert decide_route(1000, [p], d, config) is Route.DISAGGREGATED
    assert decide_route(100, [p], d, config) is Route.LOCAL
    assert decide_route(1000, [], d, config) is Route.LOCAL
    busy = _engine("p", depth=32, roles=("prefill",))
    assert decide_route(1000, [busy], d, config) is Route.LOCAL
    assert decide_route(1, [p], d, DisaggregationConfig(mode="always")) is Route.DISAGGREGATED
    assert decide_route(10**6, [p], d, DisaggregationConfig(mode="never")) is Route.LOCAL
    colocated = _engine("w", roles=("prefill", "decode"))
    assert decide_route(10**6, [p], colocated, config) is Route.LOCAL


async def test_admission_priority_and_bound() -> None:
    admission = Admission(max_in_flight=1, max_queue=2)
    await admission.acquire(0)
    order: list[int] = []

    async def waiter(priority: int) -> None:
        await admission.acquire(priority)
        order.append(priority)
        admission.release()

    low, high = asyncio.create_task(waiter(5)), asyncio.create_task(waiter(-5))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull) as full:
        await admission.acquire(0)
    assert full.value.retry_after_s >= 1
    admission.release()
    await asyncio.gather(low, high)
    assert order == [-5, 5]
    assert admission.in_flight == 0
    assert admission.waiting == 0


async def test_admission_cancelled_waiter_leaves_queue() -> None:
    admission = Admission(max_in_flight=1, max_queue=4, max_queue_per_priority=1)
    await admission.acquire()
    task = asyncio.create_task(admission.acquire(0))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):
        await admission.acquire(0)  # this priority level is full
    task.cancel()
    await asyncio.sleep(0)
    assert admission.waiting == 0
    admission.release()
    assert admission.in_flight == 0


def test_small_helpers() -> None:
    assert parse_priority(" 3 ") == 3
    assert parse_priority("x") == 0
    assert parse_priority("999") == 100
    assert retry_after_seconds(9, 10, 2.0) == 2
    assert msgspec.json.decode(b"{}") == {}


def test_engine_load_counts_queued_fully_and_decoding_lightly() -> None:
    engine = Engine("e", frozenset({"decode"}), in_flight=10, pending=2)
    assert engine.load(0.25) == 2 + 0.25 * 8
    engine.waiting, engine.running = 5, 20  # another router replica's requests show up here
    engine.pending_at_scrape, engine.decoding_at_scrape = 2, 8  # as the monitor records them
    assert engine.load(0.25) == 5 + 0.25 * 20


def test_engine_load_brings_the_scraped_figures_forward_by_this_routers_own_changes() -> None:
    """Another replica's requests are known only from the engine's metrics; what this router
    added since that scrape is added to them, what it finished is taken off."""
    engine = Engine("e", frozenset({"decode"}), in_flight=4, pending=2)
    engine.waiting, engine.running = 6, 10  # scraped: other replicas' requests included
    engine.pending_at_scrape, engine.decoding_at_scrape = 2, 2  # this router's share then
    assert engine.load(0.25) == 6 + 0.25 * 10
    engine.pending, engine.in_flight = 5, 7  # three more sent since the scrape
    assert engine.load(0.25) == 9 + 0.25 * 10
    engine.pending, engine.in_flight = 0, 0  # all of its own answered
    assert engine.load(0.25) == 4 + 0.25 * 8
