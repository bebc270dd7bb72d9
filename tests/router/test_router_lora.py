"""LoRA in the router, its pure parts: vLLM's adapter-slot metric parsed, the adapter affinity
scorer and the ranking it gives, adapter requests keyed as the engines' KV events key them, and
the answers of a runtime load sent to every engine."""

from __future__ import annotations

import pytest

from tandem.router.config import RouterConfig
from tandem.router.decision import RouteInputs, plan_route
from tandem.router.engines import Engine
from tandem.router.features import Featurizer
from tandem.router.index import PrefixIndex
from tandem.router.kv_events import EngineBlockMap
from tandem.router.lora import LoraSlots, adapter_stream, adapters_of, parse_lora_slots
from tandem.router.lora_admin import (
    EngineAnswer,
    RuntimeAdapters,
    combined_answer,
    record_answers,
)
from tandem.router.scorers.lora_affinity import lora_affinity_score

pytestmark = pytest.mark.timeout(30)

# vllm:lora_requests_info as real vLLM 0.32 (CPU build, --max-loras 1) rendered it while requests
# for ad1, ad2 and the base model ran at once: every label set seen since start stays on the page
# with the time it was last current as its value.
METRICS = b"""# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""} 1.7962293570576186e+09
vllm:lora_requests_info{max_lora="1",running_lora_adapters="ad1",waiting_lora_adapters="ad1"} 1.796229357012162e+09
vllm:lora_requests_info{max_lora="1",running_lora_adapters="ad2",waiting_lora_adapters="ad2"} 1.7962293581062567e+09
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
"""


def test_the_current_series_of_lora_requests_info_is_the_latest() -> None:
    slots = parse_lora_slots(METRICS)
    assert slots == LoraSlots(1, frozenset({"ad2"}), frozenset({"ad2"}))
    assert parse_lora_slots(b"vllm:num_requests_running 1.0\n") is None
    several = b'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters=""} 5\n'
    assert parse_lora_slots(several) == LoraSlots(4, frozenset({"a", "b"}), frozenset())


def test_adapters_of_models_are_those_with_a_parent() -> None:
    models = {
        "object": "list",
        "data": [
            {"id": "tiny", "root": "/models/tiny", "parent": None},
            {"id": "ad1", "root": "/adapters/ad1", "parent": "tiny"},
        ],
    }
    assert adapters_of(models) == {"ad1": "/adapters/ad1"}
    assert adapters_of({"detail": "Not Found"}) == {}


def test_lora_affinity_active_beats_room_beats_wait() -> None:
    assert lora_affinity_score("a", {"a", "b"}, 2) == 1.0
    assert lora_affinity_score("c", {"a"}, 2) == 0.5
    assert lora_affinity_score("c", {"a", "b"}, 2) == 0.0
    assert lora_affinity_score("c", set(), None) == 0.5  # no LoRA metric: no preference


def _config() -> RouterConfig:
    return RouterConfig.model_validate(
        {"servedModelName": "tiny", "static": {"decode": [{"url": "http://d"}]}}
    )


def _engine(url: str, running: set[str], max_loras: int = 1) -> Engine:
    engine = Engine(url, frozenset({"decode"}))
    engine.lora = LoraSlots(max_loras, frozenset(running), frozenset())
    engine.adapters = {"a": "/a", "b": "/b"}
    return engine


def _inputs(decoders: list[Engine], adapter: str | None, **extra: object) -> RouteInputs:
    fields: dict[str, object] = {
        "prompt_tokens": 100,
        "total_blocks": 3,
        "n": 1,
        "decoders": decoders,
        "prefillers": [],
        "any_prefill_configured": False,
        "hits": {},
        "cached_blocks": {},
        "first_block_key": 12345,
        "adapter": adapter,
    }
    return RouteInputs(**(fields | extra))  # type: ignore[arg-type]


def test_an_adapter_request_goes_where_its_adapter_runs_then_where_a_slot_is_free() -> None:
    config = _config()
    busy_other = _engine("http://e1", {"b"})
    free = _engine("http://e2", set())
    running = _engine("http://e3", {"a"})
    for order in ([busy_other, free, running], [running, free, busy_other]):
        plan = plan_route(_inputs(order, "a"), config)
        assert plan is not None
        assert [c.engine.url for c in plan.decode_ranking] == [
            "http://e3",
            "http://e2",
            "http://e1",
        ]
    # weight 0: no adapter tiers, the plain rendezvous order of the first block
    off = RouterConfig.model_validate(
        {
            "servedModelName": "tiny",
            "static": {"decode": [{"url": "http://d"}]},
            "scoring": {"loraAffinityWeight": 0},
        }
    )
    base = plan_route(_inputs([busy_other, free, running], None), off)
    without = plan_route(_inputs([busy_other, free, running], "a"), off)
    assert base is not None
    assert without is not None
    assert [c.engine for c in without.decode_ranking] == [c.engine for c in base.decode_ranking]
    # the router's own open requests count before the next scrape shows them
    with adapter_stream(free.adapter_streams, "a"):
        assert "a" in free.active_adapters()
    assert free.adapter_streams == {}


def test_a_prefix_hit_can_outweigh_adapter_affinity_and_base_requests_ignore_it() -> None:
    config = _config()
    free = _engine("http://e1", set(), max_loras=2)
    running = _engine("http://e2", {"a"}, max_loras=2)
    hit = plan_route(_inputs([running, free], "a", hits={"http://e1": 3}), config)
    assert hit is not None
    assert hit.decode.engine is free  # 3 * prefix (1.0) beats 2 * (1.0 - 0.5)
    base = plan_route(_inputs([running, free], None, hits={"http://e1": 3}), config)
    assert base is not None
    assert base.decode.engine is free


def test_adapter_keys_meet_the_keys_of_the_engines_events() -> None:
    """The event of a real vLLM 0.32 adapter request (lora_name and untagged extra keys as it
    published them) keys the same blocks as the router's features of that request; the base
    model's request of the same tokens hits none of them."""
    tokens = list(range(10, 74))
    featurizer = Featurizer(32, base_models=frozenset({"tiny"}))
    index = PrefixIndex()
    block_map = EngineBlockMap("http://e", index, 32)
    for salt, hashes in ((None, [1, 2]), ("s1", [3, 4])):
        extra = [["ad1"], ["ad1"]] if salt is None else [["ad1", salt], ["ad1"]]
        block_map.apply(
            [
                {
                    "type": "BlockStored",
                    "block_hashes": hashes,
                    "parent_block_hash": None,
                    "token_ids": tokens,
                    "block_size": 32,
                    "lora_id": 1,
                    "medium": "GPU",
                    "lora_name": "ad1",
                    "extra_keys": extra,
                }
            ]
        )
        body = {"model": "ad1", "prompt": tokens, **({"cache_salt": salt} if salt else {})}
        features = featurizer.of_body(body, chat=False)
        assert features.adapter == "ad1"
        assert index.match(features.keys, ["http://e"]) == {"http://e": 2}
    base = featurizer.of_body({"model": "tiny", "prompt": tokens}, chat=False)
    assert base.adapter is None
    assert not index.match(base.keys, ["http://e"]).get("http://e")
    approx_base = featurizer.approximate("x" * 400)
    approx_adapter = featurizer.approximate("x" * 400, adapter="ad1")
    assert approx_base.keys[0] != approx_adapter.keys[0]


def test_a_runtime_load_answers_as_the_engines_did() -> None:
    e1, e2 = Engine("http://e1", frozenset({"prefill"})), Engine("http://e2", frozenset({"decode"}))
    ok = [EngineAnswer(e1, 200, b"Success"), EngineAnswer(e2, 200, b"Success")]
    assert combined_answer(ok, True, "a") == (
        200,
        b"Success: LoRA adapter 'a' added successfully.",
    )
    record_answers(ok, True, "a", "/adapters/a")
    assert e1.adapters == e2.adapters == {"a": "/adapters/a"}
    refused = [EngineAnswer(e1, 200, b"Success"), EngineAnswer(e2, 404, b'{"error":{}}')]
    assert combined_answer(refused, False, "a") == (404, b'{"error":{}}')
    record_answers(refused, False, "a", None)
    assert e1.adapters == {}
    assert e2.adapters == {"a": "/adapters/a"}  # it refused: it keeps what it has
    assert e2.serves_model("a")
    assert not e1.serves_model("a")
    assert e1.serves_model(None)
    assert combined_answer([EngineAnswer(e1, 0, b"")], True, "a")[0] == 502


def test_a_runtime_adapter_is_owed_to_engines_that_lack_it_while_another_lists_it() -> None:
    old, new, sick, unread = (Engine(f"http://{n}", frozenset({"decode"})) for n in "onsu")
    body = b'{"lora_name": "a", "lora_path": "/adapters/a"}'
    adapters = RuntimeAdapters()
    adapters.record([EngineAnswer(old, 200, b"Success")], True, "a", body)
    old.adapters, new.adapters, sick.adapters = {"a": "/adapters/a"}, {}, {}
    sick.healthy = False
    everyone = [old, new, sick, unread]
    assert adapters.replays(everyone) == [(new, "a", body)]
    adapters.record([EngineAnswer(new, 400, b"runtime updating off")], True, "a", body)
    assert adapters.replays(everyone) == []  # a 4xx is not asked again
    old.adapters = {}  # unloaded through another router: listed nowhere, forgotten
    assert adapters.replays(everyone) == []
    assert "a" not in adapters
    adapters.record([EngineAnswer(old, 200, b"Success")], True, "a", body)
    adapters.record([EngineAnswer(old, 200, b"Success")], False, "a", body)
    assert "a" not in adapters
