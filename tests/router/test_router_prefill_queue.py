"""The replay of an engine's prefill queue (`tandem/router/predict/prefill_queue.py`): chunked
steps in order, corrected by the first tokens observed, at a pace learned from them."""

from __future__ import annotations

import math
import random

import pytest

from tandem.router.predict.prefill_queue import PRIOR_SEED_SECONDS, PrefillQueue, StepSeeds

# 5 ms a step, 25 ms per 1,000 prefill tokens, 0.1 ms per stream, 1 ms per 1,000 context tokens
SEEDS = StepSeeds(s0=0.005, s1=0.025, s2=0.0, d1=1e-4, d2=1e-3, chunk_tokens=8192)


def queue(scale: float = 1.0) -> PrefillQueue:
    return PrefillQueue(SEEDS, lambda: scale)


def step_s(tokens: float, streams: float = 0.0, context: float = 0.0) -> float:
    return 0.005 + 0.025 * tokens / 1000 + 1e-4 * streams + 1e-3 * context / 1000


def test_a_long_prompt_is_computed_in_chunks_of_the_token_budget() -> None:
    q = queue()
    q.add(0.0, 10000, 0.0, 0.0, 0.0)
    first = step_s(8192)
    assert q.step_end == pytest.approx(first)
    assert q.drain_s(0.0, 0.0, 0.0) == pytest.approx(first + step_s(1808))
    q.add(0.1, 1000, 0.0, 0.0, 0.0)  # shares the second step with the long prompt's last chunk
    assert q.drain_s(0.1, 0.0, 0.0) == pytest.approx(first - 0.1 + step_s(2808))
    assert q.drain_s(first + 0.01, 0.0, 0.0) == pytest.approx(step_s(2808) - 0.01)
    assert q.tokens == pytest.approx(2808)
    assert q.drain_s(first + step_s(2808), 0.0, 0.0) == 0.0
    assert q.tokens == 0.0
    assert q.open == 2  # computed as replayed, their first tokens not yet seen


def test_decoding_streams_take_budget_and_time_from_every_step() -> None:
    q = queue()
    q.add(0.0, 8192, 0.0, 192, 96000)  # 192 streams leave 8,000 tokens a step
    # it waits for the rest of the decode step in flight, half of one on average
    in_flight = step_s(0.0, 192, 96000) / 2
    assert q.drain_s(0.0, 192, 96000) == pytest.approx(
        in_flight + step_s(8000, 192, 96000) + step_s(192, 192, 96000)
    )


def test_prefills_placed_before_the_decode_step_in_flight_ends_share_the_next_step() -> None:
    q = queue()
    in_flight = step_s(0.0, 10, 10000) / 2
    q.add(0.0, 1000, 0.0, 10, 10000)
    assert q.sharers(0.0, 10) == (1, 8182 - 1000)  # a second prompt would join its step
    q.add(in_flight / 2, 2000, 0.0, 10, 10000)  # before that step starts: one step for both
    assert q.step_end == pytest.approx(in_flight + step_s(3000, 10, 10000))
    assert q.sharers(in_flight / 2, 10) == (2, 8182 - 3000)
    q.add(in_flight + 0.001, 500, 0.0, 10, 10000)  # the step has started: the next one
    assert q.drain_s(in_flight + 0.001, 10, 10000) == pytest.approx(
        step_s(3000, 10, 10000) - 0.001 + step_s(500, 10, 10000)
    )
    assert q.sharers(in_flight + 0.001, 10) == (1, 8182 - 500)  # its step, not the started one


def test_a_step_without_room_is_shared_by_no_one() -> None:
    q = queue()
    q.add(0.0, 8192, 0.0, 0.0, 0.0)  # an idle engine: its step starts at once, full
    assert q.sharers(0.0, 0.0) == (0, 0.0)
    q.add(0.001, 9000, 0.0, 0.0, 0.0)  # 8,192 of it in the second step, 808 in the third
    assert q.sharers(0.001, 0.0) == (1, 8192 - 808)


def test_a_cached_prefix_makes_each_chunk_attend_to_more_pairs() -> None:
    seeds = StepSeeds(s0=0.0, s1=0.0, s2=1.0, d1=0.0, d2=0.0, chunk_tokens=1000)
    q = PrefillQueue(seeds, lambda: 1.0)
    q.add(0.0, 2000, 500, 0.0, 0.0)  # chunks of 1,000 after 500 cached, then after 1,500
    pairs = 1000 * (500 + 500) + 1000 * (1500 + 500)
    assert q.drain_s(0.0, 0.0, 0.0) == pytest.approx(pairs * 1e-6)
    assert pairs == 2000 * (500 + 1000)  # the same pairs as one chunk: u · (c + u / 2)


def test_a_first_token_takes_the_work_ahead_with_it_and_starts_the_next_step() -> None:
    q = queue()
    q.add(0.0, 10000, 0.0, 0.0, 0.0)  # a: 8,192 in the first step, which ends at 0.21
    b = q.add(0.01, 6000, 0.0, 0.0, 0.0)  # arrived during it: in the second step, beside a
    c = q.add(0.01, 3000, 0.0, 0.0, 0.0)  # 384 of it in the second step
    d = q.add(0.3, 1000, 0.0, 0.0, 0.0)  # arrived during the second step: not in it
    q.complete(b, 0.35, 0.0, 0.0)  # sooner than the replay's 0.42: that step ended now
    assert list(q.entries) == [c, d]  # a was ahead of b: done too
    assert q.tokens == pytest.approx(2616 + 1000)  # c's chunk beside b is computed too
    assert q.step_end == pytest.approx(0.35 + step_s(3616))
    q.withdraw(c)  # c abandoned: d stays
    assert list(q.entries) == [d]


def test_the_pace_follows_an_engine_slower_than_its_seeds() -> None:
    seed = step_s(8192)
    q = queue()
    a = q.add(0.0, 8192, 0.0, 0.0, 0.0)
    b = q.add(0.0, 8192, 0.0, 0.0, 0.0)
    q.complete(a, 0.15, 0.0, 0.0)
    assert q.pace == 1.0  # one completion is no sample: b's starts now
    q.complete(b, 0.15 + 2 * seed, 0.0, 0.0)  # b's 8,192 tokens took twice their seed
    assert q.pace == pytest.approx((2 * seed + PRIOR_SEED_SECONDS) / (seed + PRIOR_SEED_SECONDS))
    for i in range(40):  # and so on: the pace tends to 2
        x = q.add(1.0 + i, 8192, 0.0, 0.0, 0.0)
        y = q.add(1.0 + i, 8192, 0.0, 0.0, 0.0)
        q.complete(x, 1.01 + i, 0.0, 0.0)
        q.complete(y, 1.01 + i + 2 * seed, 0.0, 0.0)
    assert q.pace == pytest.approx(2.0, rel=0.03)
    assert q.drain_s(100.0, 0.0, 0.0) == 0.0
    q.add(100.0, 8192, 0.0, 0.0, 0.0)
    assert q.drain_s(100.0, 0.0, 0.0) == pytest.approx(q.pace * seed)


def test_a_first_token_computed_in_the_step_before_it_joins_that_steps_pace_sample() -> None:
    q = queue()
    a = q.add(0.0, 2000, 0.0, 10, 10000)
    b = q.add(0.02, 2000, 0.0, 10, 10000)  # after a's step started: planned for the next one
    q.complete(a, 0.08, 10, 10000)
    # 2 ms later: vLLM had put b's chunk in a's step; the replay's 2,000 tokens took no time
    q.complete(b, 0.082, 10, 10000)
    assert q.pace == 1.0
    c = q.add(1.0, 2000, 0.0, 10, 10000)
    d = q.add(1.02, 2000, 0.0, 10, 10000)
    e = q.add(1.021, 2000, 0.0, 10, 10000)
    q.complete(c, 1.08, 10, 10000)
    both = step_s(4000, 10, 10000)  # d and e in one step, at the seeds' pace
    q.complete(d, 1.08 + both, 10, 10000)
    assert q.pace > 1.0  # d alone: its 2,000 tokens seemed to take 4,000 tokens' time
    q.complete(e, 1.08 + both + 0.002, 10, 10000)
    assert q.pace == pytest.approx(1.0)  # e's tokens were in that time: the seeds' pace


def test_the_prior_is_the_cost_models_scale_and_a_withdrawn_request_is_no_sample() -> None:
    scale = [1.0]
    q = PrefillQueue(SEEDS, lambda: scale[0])
    scale[0] = 1.5  # the cost model learned from requests at an idle engine
    assert q.pace == pytest.approx(1.5)
    a = q.add(0.0, 8192, 0.0, 0.0, 0.0)
    b = q.add(0.0, 8192, 0.0, 0.0, 0.0)
    q.complete(a, 0.1, 0.0, 0.0)
    q.withdraw(b)  # abandoned: its time is no measure of the engine
    c = q.add(1.0, 8192, 0.0, 0.0, 0.0)
    q.complete(c, 5.0, 0.0, 0.0)  # c was never first at a completion: no sample either
    assert q.pace == pytest.approx(1.5)


def test_a_replay_that_ran_ahead_keeps_its_entries_open_and_learns_a_slower_pace() -> None:
    seed = step_s(8192)
    q = queue()
    a = q.add(0.0, 8192, 0.0, 0.0, 0.0)
    b = q.add(0.0, 8192, 0.0, 0.0, 0.0)
    c = q.add(0.0, 8192, 0.0, 0.0, 0.0)
    # the replay ended all three by 3 seeds; a has no first token yet, so the engine has not
    # ended a, and b and c, which the replay computed after a, are still to do
    assert q.drain_s(1.0, 0.0, 0.0) == pytest.approx(2 * seed)
    assert q.drain_s(5.0, 0.0, 0.0) == pytest.approx(2 * seed)
    assert q.open == 3
    q.complete(a, 1.0, 0.0, 0.0)  # the engine is three times slower: b and c start again
    assert q.open == 2
    assert q.tokens == 2 * 8192
    assert q.step_end == pytest.approx(1.0 + seed)
    q.complete(b, 1.0 + 3 * seed, 0.0, 0.0)  # b's sample: 3 seeds for 1
    slower = (3 * seed + PRIOR_SEED_SECONDS) / (seed + PRIOR_SEED_SECONDS)
    assert q.pace == pytest.approx(slower)
    assert q.drain_s(1.0 + 3 * seed, 0.0, 0.0) == pytest.approx(slower * seed)
    q.withdraw(c)
    assert q.open == 0


def test_a_replay_ahead_of_the_engine_counts_the_entries_behind_the_oldest_open_one_whole() -> None:
    """overdue(t): once the replay has ended the oldest open entry h, every entry it did not end
    in h's last step is still to compute, whole; those it ended with h add nothing."""
    seed = step_s(8192)
    q = queue()
    a = q.add(0.0, 8192, 0.0, 0.0, 0.0)
    q.add(0.0, 8192, 0.0, 0.0, 0.0)
    assert q.drain_s(0.0, 0.0, 0.0) == pytest.approx(2 * seed)
    # at 1.5 seeds the replay has ended a (at 1 seed) and is half through b: b is left whole
    assert q.drain_s(1.5 * seed, 0.0, 0.0) == pytest.approx(seed)
    q.complete(a, 1.5 * seed, 0.0, 0.0)  # a's first token: b starts now
    assert q.drain_s(1.5 * seed, 0.0, 0.0) == pytest.approx(seed)
    together = queue()
    together.add(0.0, 10000, 0.0, 0.0, 0.0)
    together.add(0.1, 1000, 0.0, 0.0, 0.0)  # in the long prompt's last step
    assert together.drain_s(1.0, 0.0, 0.0) == 0.0


def engine_first_tokens(arrivals: list[tuple[float, int]], pace: float) -> list[float]:
    """When each prompt's first token comes from an engine that fills each step's budget with
    the waiting prompts in arrival order, a step of n tokens taking pace · step_s(n)."""
    waiting: list[list[int]] = []  # [index, tokens left]
    first = [0.0] * len(arrivals)
    now, next_arrival = 0.0, 0
    while next_arrival < len(arrivals) or waiting:
        if not waiting:
            now = max(now, arrivals[next_arrival][0])
        while next_arrival < len(arrivals) and arrivals[next_arrival][0] <= now:
            waiting.append([next_arrival, arrivals[next_arrival][1]])
            next_arrival += 1
        budget, tokens, ended = SEEDS.chunk_tokens, 0, []
        for prompt in waiting:
            take = min(prompt[1], budget)
            prompt[1] -= take
            tokens += take
            budget -= take
            if prompt[1] == 0:
                ended.append(prompt[0])
        now += pace * step_s(tokens)
        waiting = [prompt for prompt in waiting if prompt[1] > 0]
        for index in ended:
            first[index] = now
    return first


@pytest.mark.parametrize("rate", [2.0, 10.0])
def test_the_pace_of_an_engine_that_fills_its_steps_in_order_is_its_true_pace(rate: float) -> None:
    """Each step's budget holds the end of one prompt and the start of the next: the tokens a
    sample's last step computed behind its prompt are in its time and its seed, and in no later
    sample's seed (left out, the pace settled at 2.4-2.6 here)."""
    rng = random.Random(7)
    arrivals, t = [], 0.0
    for _ in range(400):
        t += rng.expovariate(rate)
        arrivals.append((t, max(1, int(rng.lognormvariate(math.log(3000), 1.0)))))
    first = engine_first_tokens(arrivals, pace=2.0)
    events = sorted(
        [(at, 0, i) for i, (at, _) in enumerate(arrivals)]
        + [(at, 1, i) for i, at in enumerate(first)]
    )
    q = queue(scale=1.6)
    entries = {}
    for at, is_first_token, i in events:
        if is_first_token:
            q.complete(entries.pop(i), at, 0.0, 0.0)
        else:
            entries[i] = q.add(at, arrivals[i][1], 0.0, 0.0, 0.0)
    assert q.pace == pytest.approx(2.0, rel=0.02)


def test_a_step_planned_again_with_less_budget_computes_only_what_the_new_plan_takes() -> None:
    """Two prefills share the step after the decode step in flight; before it starts, a third comes
    with so many more streams that the budget holds only part of the first: the second is not in
    that step any more, and its end computes nothing of it."""
    seeds = StepSeeds(s0=0.005, s1=0.025, s2=0.0, d1=1e-4, d2=0.0, chunk_tokens=100)
    q = PrefillQueue(seeds, lambda: 1.0)
    first = q.add(0.0, 60, 0.0, 1, 0.0)
    second = q.add(0.0001, 30, 0.0, 1, 0.0)  # 60 + 30 of a budget of 99: one step for both
    assert q.step_start > 0.0001
    q.add(0.0002, 10, 0.0, 80, 0.0)  # 80 streams leave 20 tokens: the first's chunk alone
    q.advance(q.step_end, 80, 0.0)
    assert (first.left, second.left) == (40.0, 30.0)
    assert second.done_at == 0.0


def test_a_prefill_held_past_the_next_step_is_planned_after_it() -> None:
    """A long prompt's step in flight, a short one placed after it started (its step is next):
    a prompt held to halfway through that step misses it, and is computed in the one after."""
    q = queue()
    q.add(0.0, 8000, 0.0, 0.0, 0.0)
    assert q.last_step(0.01, 0.0, 0.0) is None  # the step in flight ends everything
    q.add(0.01, 100, 0.0, 0.0, 0.0)  # the step after it is the short one's last
    assert q.last_step(0.02, 0.0, 0.0) == pytest.approx((step_s(8000), step_s(100)))
    send = step_s(8000) + step_s(100) / 2
    assert q.held_until(0.02) is None
    q.add(0.02, 4000, 0.0, 0.0, 0.0, sent=send)
    assert q.held_until(0.03) == send  # whatever comes next waits as long
    q.advance(step_s(8000) + 0.001, 0.0, 0.0)  # the short prompt's step, without the held one
    assert q.step_end == pytest.approx(step_s(8000) + step_s(100))
    q.advance(q.step_end + 0.001, 0.0, 0.0)
    assert q.step_start == pytest.approx(step_s(8000) + step_s(100))
    assert q.step_end == pytest.approx(q.step_start + step_s(4000))


def test_a_held_prefill_sent_after_the_engine_went_idle_starts_when_it_comes() -> None:
    q = queue()
    q.add(0.0, 1000, 0.0, 0.0, 0.0)
    q.add(0.001, 1000, 0.0, 0.0, 0.0, sent=1.0)  # held far past the first one's step
    q.advance(step_s(1000) + 0.001, 0.0, 0.0)
    assert q.step_end == pytest.approx(1.0)  # nothing of this router's there until it comes
    q.advance(1.0, 0.0, 0.0)
    assert (q.step_start, q.step_end) == pytest.approx((1.0, 1.0 + step_s(1000)))
