"""Scheduler and KV cache units: token budget, chunked prefill, prefix hits, LRU, preemption."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.common.block_hash import hash_function, none_hash
from tandem.emulator.kv_cache import KVCacheManager
from tandem.emulator.profile import TimingProfile, load_profile
from tandem.emulator.request import EngineRequest, FinishReason, Status
from tandem.emulator.scheduler import Scheduler

pytestmark = pytest.mark.timeout(30)
BS = 16


def make(
    num_blocks: int = 64,
    max_seqs: int = 8,
    budget: int = 64,
    events: bool = True,
    **options: Any,
) -> Scheduler:
    """A scheduler over a fresh pool; `options` go to Scheduler (speculation, static batching)."""
    kv = KVCacheManager(
        num_blocks,
        BS,
        4096,
        True,
        hash_function("sha256_cbor"),
        none_hash("sha256_cbor", {}),
        events,
    )
    return Scheduler(
        kv,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        max_model_len=4096,
        output_ids=list(range(1000, 1100)),
        **options,
    )


def request(rid: str, prompt: list[int], max_tokens: int = 4) -> EngineRequest:
    return EngineRequest(
        request_id=rid, prompt_token_ids=list(prompt), max_tokens=max_tokens, arrival_time=0.0
    )


def run_to_end(s: Scheduler, limit: int = 1000) -> list[list[int]]:
    """Step until idle; returns the scheduled token counts of every step."""
    steps = []
    for _ in range(limit):
        batch = s.schedule()
        if not batch:
            break
        steps.append(list(batch.num_tokens))
        _, _, finished = s.update(batch)
        for r in finished:
            s.kv.free(r)
    return steps


def test_chunked_prefill_respects_the_token_budget() -> None:
    s = make(budget=64)
    s.add(request("a", list(range(150)), max_tokens=3))
    steps = run_to_end(s)
    assert steps[:3] == [[64], [64], [22]]  # prefill in chunks
    assert steps[3:] == [[1], [1]]  # then decode, one token per step
    assert sum(sum(x) for x in steps) == 150 + 2


def test_decodes_go_first_and_share_the_budget_with_a_prefill() -> None:
    s = make(budget=40)
    s.add(request("a", list(range(10)), max_tokens=10))
    batch = s.schedule()
    s.update(batch)
    s.add(request("b", list(range(100, 200)), max_tokens=2))
    batch = s.schedule()
    assert [r.request_id for r in batch.requests] == ["a", "b"]
    assert batch.num_tokens == [1, 39]
    assert batch.decode_seqs == 1
    assert batch.prefill_chunks == [(39, 0)]


def test_a_long_prefill_leaves_room_in_each_step_under_the_threshold() -> None:
    """vLLM's --long-prefill-token-threshold: one request computes at most that many prompt
    tokens a step while another request is there, so one that comes behind a long prompt is
    admitted beside it."""
    s = make(budget=64, long_prefill_token_threshold=16)
    s.add(request("long", list(range(200)), max_tokens=2))
    batch = s.schedule()
    assert list(batch.num_tokens) == [64]  # alone: nobody to leave room for
    s.update(batch)
    s.add(request("short", list(range(200, 210)), max_tokens=2))
    batch = s.schedule()
    assert [r.request_id for r in batch.requests] == ["long", "short"]
    assert list(batch.num_tokens) == [16, 10]
    unbounded = make(budget=64)
    unbounded.add(request("long", list(range(200)), max_tokens=2))
    unbounded.update(unbounded.schedule())
    unbounded.add(request("short", list(range(200, 210)), max_tokens=2))
    batch = unbounded.schedule()
    assert [r.request_id for r in batch.requests] == ["long"]  # it takes the whole budget
    assert list(batch.num_tokens) == [64]


def test_max_num_seqs_caps_the_running_set() -> None:
    s = make(max_seqs=2, budget=1000)
    for i in range(4):
        s.add(request(str(i), [i] * 20, max_tokens=5))
    batch = s.schedule()
    assert len(batch.requests) == 2
    assert len(s.waiting) == 2


def test_prefix_hit_skips_cached_blocks_and_leaves_the_last_token() -> None:
    s = make(budget=1000)
    prompt = list(range(64))
    s.add(request("a", prompt, max_tokens=1))
    run_to_end(s)
    s.add(request("b", prompt, max_tokens=1))
    batch = s.schedule()
    # 4 full blocks cached, but the last token is always computed: 3 blocks hit
    assert batch.num_tokens == [16]
    assert batch.prefill_chunks == [(16, 48)]
    assert s.kv.hits == 48


def test_lru_evicts_least_recently_freed_blocks_first() -> None:
    s = make(num_blocks=9, budget=1000)  # 8 usable blocks
    s.add(request("a", list(range(0, 64)), max_tokens=1))  # 4 blocks
    run_to_end(s)
    s.add(request("b", list(range(100, 164)), max_tokens=1))  # 4 more blocks
    run_to_end(s)
    s.kv.pool.take_events()
    s.add(request("c", list(range(200, 232)), max_tokens=1))  # needs 2 blocks: evicts a's tail
    run_to_end(s)
    events = s.kv.pool.take_events()
    removed = [e for e in events if e["type"] == "BlockRemoved"]
    assert len(removed) == 2
    a = request("a2", list(range(0, 64)))
    s.kv.update_digests(a)
    from tandem.common.block_hash import event_hash

    assert [e["block_hashes"][0] for e in removed] == [
        event_hash(a.block_digests[3]),
        event_hash(a.block_digests[2]),
    ]


def test_preemption_when_kv_runs_out_and_recompute() -> None:
    s = make(num_blocks=7, budget=1000)  # 6 usable blocks of 16 tokens
    a, b = (
        request("a", list(range(40)), max_tokens=30),
        request("b", list(range(500, 540)), max_tokens=30),
    )
    s.add(a)
    s.add(b)
    steps = run_to_end(s)
    assert s.num_preemptions >= 1
    assert b.num_preemptions >= 1  # the newest running request is preempted
    assert a.finish_reason is FinishReason.LENGTH
    assert b.finish_reason is FinishReason.LENGTH
    assert a.num_output_tokens == 30
    assert b.num_output_tokens == 30
    assert a.status is Status.FINISHED
    assert max(sum(x) for x in steps) > 1  # b's prompt and outputs were recomputed
    assert s.kv.pool.num_free == 6


def test_output_is_deterministic_per_prompt() -> None:
    outs = []
    for _ in range(2):
        s = make()
        r = request("x", list(range(30)), max_tokens=12)
        r.rng_state = 12345
        s.add(r)
        run_to_end(s)
        outs.append(r.output_token_ids)
    assert outs[0] == outs[1]
    assert len(set(outs[0])) > 1


def test_step_time_formula() -> None:
    profile = TimingProfile.model_validate(
        {
            "name": "t",
            "step": {
                "base_s": 0.01,
                "per_token_s": 1e-4,
                "per_attention_pair_s": 1e-8,
                "per_decode_seq_s": 1e-3,
                "per_context_token_s": 1e-6,
            },
        }
    )
    t = profile.step_seconds([(100, 50)], decode_seqs=2, decode_context_tokens=300)
    expected = 0.01 + 1e-4 * 102 + 1e-8 * 100 * (50 + 50) + 1e-3 * 2 + 1e-6 * 300
    assert t == pytest.approx(expected)


def test_shipped_profiles_load() -> None:
    llmd = load_profile("llm-d-h100-8b")
    assert llmd.model.kv_bytes_per_token == 131072
    # llm-d reference: prefill 30 ms + 250 us/token, ITL 12 ms, 3 us/token transfer
    assert llmd.step_seconds([(1000, 0)], 0, 0) == pytest.approx(0.030 + 0.25)
    assert llmd.step_seconds([], 64, 64000) == pytest.approx(0.012)
    assert llmd.transfer_seconds(1000) == pytest.approx(0.003, rel=1e-3)
    assert load_profile().name  # the default profile
