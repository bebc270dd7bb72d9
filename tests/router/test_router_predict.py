"""The predictive policy's predictors and decision rules, as pure functions (no sockets needed)."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest

from tandem.common.routing import PredictiveConfig, SloClass
from tandem.router.admission import Admission
from tandem.router.config import RouterConfig
from tandem.router.decision import PredictiveInputs, Route, RouteInputs, plan_route
from tandem.router.engines import Engine
from tandem.router.metrics import RouterMetrics
from tandem.router.predict.candidate import (
    Placement,
    PlacementInputs,
    Work,
    decode_candidate,
    handoff_wait_s,
    kv_overflows,
    queue_delay_s,
    slowed_by_prefills,
    stream_slack_s,
    through_first_token,
)
from tandem.router.predict.cost_model import IDLE, DecodeLoad, EngineCosts, OnlineLinear
from tandem.router.predict.disaggregation import handoff_decode
from tandem.router.predict.ledger import EngineLedger
from tandem.router.predict.output_length import (
    LengthPrediction,
    OutputLengthModel,
    length_keys,
)
from tandem.router.predict.placement import (
    CACHE_TTFT_RATIO,
    due_for_probe,
    place,
    retry_after_s,
)
from tandem.router.predict.predictor import MAX_HOLD_S, MIN_TPOT_TOKENS, Predictor, Ticket
from tandem.router.predict.prefill_queue import PrefillQueue, QueuedPrefill
from tandem.router.predict.slo import SloTarget, meet_probability, slo_class, slo_target
from tandem.router.relay import completion_tokens
from tandem.router.rendezvous import weight

# -- cost model ---------------------------------------------------------------------------------


def test_online_linear_converges_to_the_true_line() -> None:
    rng = random.Random(1)
    model = OnlineLinear([0.001, 0.001], [0.5, 0.5], forget=0.98)
    for _ in range(300):
        k = rng.uniform(0.1, 4.0)
        model.update((1.0, k), 0.006 + 0.05 * k + rng.gauss(0, 0.001))
    assert model.theta[0] == pytest.approx(0.006, abs=0.002)
    assert model.theta[1] == pytest.approx(0.05, rel=0.05)


def test_online_linear_follows_a_change_and_stays_non_negative() -> None:
    model = OnlineLinear([0.01, 0.02], [0.5, 0.5], forget=0.9)
    for i in range(200):
        k = 1.0 + (i % 5)
        model.update((1.0, k), 0.2 * k if i >= 100 else 0.001 * k)
    assert model.theta[1] == pytest.approx(0.2, rel=0.02)
    for _ in range(50):  # a sample below any non-negative fit
        model.update((1.0, 1.0), -1.0)
    assert min(model.theta) >= 0.0


def test_online_linear_covariance_stays_bounded_without_new_information() -> None:
    model = OnlineLinear([0.01, 0.02], [0.5, 0.5], forget=0.9)
    for _ in range(500):
        model.update((1.0, 2.0), 0.05)  # one point over and over: no information on the slope
    assert sum(model._p[i][i] for i in range(2)) <= 1.0 + 1e-9
    assert model.predict((1.0, 2.0)) == pytest.approx(0.05, rel=1e-3)


def test_engine_costs_formulas_and_learning() -> None:
    costs = EngineCosts(
        (0.006, 0.024, 0.002), (0.007, 0.003), (0.006, 0.00002, 0.00003), forget=0.98
    )
    assert costs.prefill_s(2000, 2e6) == pytest.approx(0.006 + 0.048 + 0.004)
    # 10,000 tokens are two chunks of at most 8,192: two steps, two fixed costs
    assert costs.prefill_s(10000, 0.0) == pytest.approx(2 * 0.006 + 0.24)
    assert costs.prefill_s(0, 0.0) == pytest.approx(0.006)  # all cached: still one step
    assert costs.prefill_compute_s(2000, 2e6) == pytest.approx(0.048 + 0.004)
    assert costs.handoff_s(1000) == pytest.approx(0.010)
    assert costs.step_s(10, 20000) == pytest.approx(0.006 + 0.0002 + 0.0006)

    def slow(tokens: float, load: DecodeLoad) -> float:  # 20 ms of overhead, a pace 4x slower
        step = 0.006 + 0.00002 * load.streams + 0.00003 * load.context / 1000
        steps = math.ceil(tokens / (8192 - load.streams))
        mid_step = step / 2 if load.streams else 0.0
        return 0.02 + 4 * (steps * step + mid_step + 2.4e-5 * tokens + 1e-9 * tokens**2)

    loads = (IDLE, DecodeLoad(40, 300_000), DecodeLoad(120, 1_000_000))
    for i, tokens in enumerate((100, 500, 1000, 2000, 4000, 8000) * 20):
        load = loads[i % 3]
        costs.observe_prefill(tokens, tokens * tokens / 2, load, slow(tokens, load))
    assert costs.prefill.theta == pytest.approx([0.02, 4.0], rel=0.1)
    assert costs.prefill_s(3000, 4.5e6) == pytest.approx(slow(3000, IDLE), rel=0.02)
    assert costs.prefill_s(16000, 1.28e8) == pytest.approx(slow(16000, IDLE), rel=0.02)
    busy = DecodeLoad(80, 600_000)
    assert costs.prefill_s(300, 4.5e4, busy, mid_step=True) == pytest.approx(
        slow(300, busy), rel=0.02
    )
    assert costs.prefill_compute_s(2000, 2e6) == pytest.approx(4 * (0.048 + 0.004), rel=0.05)


def test_a_prefill_beside_decoding_streams_carries_them_in_every_step() -> None:
    costs = EngineCosts(
        (0.006, 0.024, 0.002), (0.007, 0.003), (0.006, 0.00002, 0.00003), forget=0.98
    )
    load = DecodeLoad(100, 200_000)  # each step: 0.006 + 100 · 0.00002 + 200 · 0.00003 = 0.014
    assert costs.prefill_s(2000, 2e6, load) == pytest.approx(0.014 + 0.048 + 0.004)
    # it comes while a decode step is in flight: half of one more on average
    assert costs.prefill_s(2000, 2e6, load, mid_step=True) == pytest.approx(0.073)
    # an idle engine has no step in flight
    assert costs.prefill_s(2000, 2e6, IDLE, mid_step=True) == pytest.approx(0.058)
    # 8,100 tokens beside 100 streams: a step takes 8,192 - 100 of them, so two steps
    assert costs.prefill_s(8100, 0.0, load) == pytest.approx(2 * 0.014 + 0.1944)
    assert costs.prefill_s(8100, 0.0) == pytest.approx(0.006 + 0.1944)
    # the streams wait for its tokens, not for their own part of the steps
    assert costs.prefill_compute_s(2000, 2e6) == pytest.approx(0.048 + 0.004)
    # a pulled prompt's last token: the pull, half the step in flight, then a step beside them
    assert costs.handoff_s(1000, load) == pytest.approx(0.010 + 0.008 + 0.007)
    assert costs.handoff_s(1000, IDLE) == pytest.approx(0.010)


def test_a_burst_of_odd_samples_moves_the_costs_by_a_bounded_factor() -> None:
    costs = EngineCosts((0.006, 0.024, 0.002), (0.007, 0.003), (0.006, 0.0, 0.0), forget=0.98)
    for _ in range(5):  # a short prompt stuck behind a stalled engine: ten times its cost
        costs.observe_prefill(200, 2e4, IDLE, 10 * costs.prefill_s(200, 2e4))
    assert 1.0 < costs.prefill_s(16000, 1.28e8) / (0.012 + 0.384 + 0.256) < 10.0


def test_work_through_the_first_token_is_the_work_ahead_and_its_own() -> None:
    own = Work(1000.0, 5e5)
    assert through_first_token(Work(0.0, 0.0), own) == own  # an idle engine: its own
    assert through_first_token(Work(3000.0, 4e6), own) == Work(4000.0, 4.5e6)


def test_prefill_share_is_a_decayed_rate() -> None:
    ledger = EngineLedger(
        EngineCosts((0.005, 0.025, 0.0), (0.005, 0.003), (0.006, 0.0, 0.0), 0.98), 1.0
    )
    assert ledger.prefill_share(5.0) == 0.0
    ledger.add_prefill(10.0, 0.2)
    assert ledger.prefill_share(10.0) == pytest.approx(0.2)
    assert ledger.prefill_share(11.0) == pytest.approx(0.2 / math.e)
    for i in range(200):  # 0.1 s of prefill every 0.25 s: a share of 0.4 on average
        ledger.add_prefill(20.0 + i * 0.25, 0.1)
    peak = 0.1 / (1 - math.exp(-0.25))  # just after a prefill; just before the next, peak - 0.1
    assert ledger.prefill_share(20.0 + 199 * 0.25) == pytest.approx(peak)
    assert ledger.prefill_share(20.0 + 199.999 * 0.25) == pytest.approx(peak - 0.1, rel=1e-3)


def test_the_share_slows_a_stream_by_at_most_three_and_a_third_steps() -> None:
    """step / (1 - min(share, 0.7)): streams placed on the prefix-heavy trace where the share
    was 0.8-1.8 took 3.4-3.6 steps a token, where a cap of 0.9 predicted ten (docs/router.md)."""
    assert slowed_by_prefills(0.03, 0.0) == pytest.approx(0.03)
    assert slowed_by_prefills(0.03, 0.5) == pytest.approx(0.06)
    assert slowed_by_prefills(0.03, 0.7) == pytest.approx(0.1)
    assert slowed_by_prefills(0.03, 1.5) == pytest.approx(0.1)


# -- output length ------------------------------------------------------------------------------


def test_length_keys_levels() -> None:
    assert length_keys(True, 100, 1000, None) == ((True, 6), (True, 6, 9))
    assert length_keys(False, None, 0, "s1")[-1] == (False, -1, 0, "s1")


def test_output_length_learns_per_key_and_beats_the_mean() -> None:
    rng = random.Random(2)
    model = OutputLengthModel()
    groups = {"short": 20, "long": 800}
    errors, baseline = [], []
    for i in range(2000):
        name = rng.choice(list(groups))
        keys = length_keys(True, 1024, 300, name)
        predicted = model.predict(keys, 1024)
        actual = max(1, int(groups[name] * math.exp(rng.gauss(0, 0.3))))
        if i > 500:
            errors.append(abs(predicted.median - actual) / actual)
            baseline.append(abs(model.mean_tokens - actual) / actual)
        model.observe(keys, predicted, actual)
    assert sum(errors) / len(errors) < 0.35
    assert sum(errors) / len(errors) < 0.25 * (sum(baseline) / len(baseline))


def test_output_length_unseen_key_leans_on_its_coarser_key() -> None:
    model = OutputLengthModel()
    for _ in range(300):
        keys = length_keys(False, 512, 100, "seen")
        model.observe(keys, model.predict(keys, 512), 400)
    unseen = model.predict(length_keys(False, 512, 100, "new group"), 512)
    assert unseen.median == pytest.approx(400, rel=0.1)
    assert model.predict(length_keys(False, 512, 100, None), 16).p90 <= 16  # max_tokens caps


def test_output_length_p90_is_calibrated_on_a_skewed_distribution() -> None:
    rng = random.Random(3)
    model = OutputLengthModel()
    keys = length_keys(True, 4096, 50, None)
    above, total = 0, 0
    for i in range(4000):
        predicted = model.predict(keys, 4096)
        actual = 10 if rng.random() < 0.6 else int(rng.paretovariate(1.2) * 200)  # not log-normal
        if i >= 1000:
            above += actual > predicted.p90
            total += 1
        model.observe(keys, predicted, min(actual, 4096))
    assert above / total == pytest.approx(0.1, abs=0.03)


# -- SLO ----------------------------------------------------------------------------------------

CLASSES = [
    SloClass(min_priority=-100, ttft_ms=500, tpot_ms=50),
    SloClass(min_priority=10, ttft_ms=5000, tpot_ms=200, sheddable=True),
]


def test_slo_class_by_priority_and_headers() -> None:
    assert slo_class(CLASSES, 0).ttft_ms == 500
    assert slo_class(CLASSES, 10).sheddable
    assert slo_class(CLASSES[1:], -50).ttft_ms == 5000  # below every class: the lowest
    assert slo_target(CLASSES, 50, "250", None) == SloTarget(0.25, 0.2, True)
    assert slo_target(CLASSES, 0, "nan", "-3") == SloTarget(0.5, 0.05, False)


def test_meet_probability() -> None:
    assert meet_probability(1.0, 1.0, 0.3) == pytest.approx(0.5)
    assert meet_probability(0.5, 1.0, 0.3) > 0.98
    assert meet_probability(2.0, 1.0, 0.3) < 0.02
    assert meet_probability(0.0, 1.0, 0.3) == 1.0


# -- placement ----------------------------------------------------------------------------------


def engine(name: str, role: str) -> Engine:
    roles = frozenset(("prefill", "decode")) if role == "both" else frozenset((role,))
    return Engine(f"http://{name}:8000", roles)


def test_each_engine_is_predicted_at_its_own_pools_step_budget() -> None:
    """C, the step budget the cost models chunk prefills at: `prefillPoolChunkTokens` on an
    engine that only prefills, `prefillChunkTokens` on a decode or colocated one; the first
    falls back to the second, and that to vLLM's 8192."""

    def budgets(**predictive: int) -> list[int]:
        predictor = Predictor(PredictiveConfig.model_validate(predictive), RouterMetrics())
        engines = (engine("p", "prefill"), engine("d", "decode"), engine("w", "both"))
        return [predictor.ledger(e).costs.chunk_tokens for e in engines]

    assert budgets(prefillChunkTokens=2048, prefillPoolChunkTokens=16384) == [16384, 2048, 2048]
    assert budgets(prefillChunkTokens=2048) == [2048, 2048, 2048]
    assert budgets(prefillPoolChunkTokens=16384) == [16384, 8192, 8192]
    assert budgets() == [8192, 8192, 8192]


def behind(ledger: EngineLedger, tokens: float) -> QueuedPrefill:
    """This router's prefill work of `tokens` placed on the ledger's engine at time 100: one step
    of 5 ms + 25 ms per 1,000 tokens at the seeds of `ledger_table`, up to 8,192 tokens."""
    return ledger.queue_work(100.0, tokens, 0.0)


def ledger_table(
    known: bool = True,
) -> tuple[dict[str, EngineLedger], Callable[[Engine], EngineLedger]]:
    """Ledgers of engines whose costs are the seeds; `known`: as if already observed at them."""
    ledgers: dict[str, EngineLedger] = {}

    def ledger_of(e: Engine) -> EngineLedger:
        if e.id not in ledgers:
            costs = EngineCosts((0.005, 0.025, 0.0), (0.005, 0.003), (0.006, 0.0, 0.0), 0.98)
            costs.prefill.samples = int(known)
            ledgers[e.id] = EngineLedger(costs, 1.0)
        return ledgers[e.id]

    return ledgers, ledger_of


def test_a_prefill_engine_of_unknown_pace_takes_one_request_at_a_time() -> None:
    """A burst before the first answer is not sent whole to an engine known only by its seed."""
    _, ledger_of = ledger_table(known=False)
    d, p = engine("d", "decode"), engine("p", "prefill")
    behind(ledger_of(d), 8000)  # local is far behind: P/D is predicted faster
    inputs = inputs_for(2000, ttft_ms=1000)
    assert place([d], [p], ledger_of, inputs, "auto").prefill is not None
    ledger_of(p).prefills_open = 1  # that first request has not ended
    assert place([d], [p], ledger_of, inputs, "auto").prefill is None
    assert place([d], [p], ledger_of, inputs, "always").prefill is not None
    ledger_of(p).costs.observe_prefill(2000, 0.0, IDLE, 0.055)  # answered at the seed's pace
    assert place([d], [p], ledger_of, inputs, "auto").prefill is not None


def inputs_for(
    prompt: int,
    ttft_ms: float = 200,
    tpot_ms: float = 50,
    sheddable: bool = False,
    hits: dict[str, int] | None = None,
) -> PlacementInputs:
    return PlacementInputs(
        prompt_tokens=prompt,
        block_size=16,
        hits=hits or {},
        output=LengthPrediction(100.0, 300.0),
        target=SloTarget(ttft_ms / 1e3, tpot_ms / 1e3, sheddable),
        meet_threshold=0.5,
        interference_budget=0.3,
        mean_uncached_tokens=1000.0,
        mean_uncached_pairs=1e6,
        mean_stream_tokens=1000.0,
        now=100.0,
    )


def test_local_when_both_meet() -> None:
    _, ledger_of = ledger_table()
    d, p = engine("d", "decode"), engine("p", "prefill")
    placement = place([d], [p], ledger_of, inputs_for(2000), "auto")
    assert placement.prefill is None
    assert placement.ranking == [d]
    assert placement.ttft_s == pytest.approx(0.005 + 0.05)


def test_a_local_prefill_counts_the_requests_that_will_queue_behind_it() -> None:
    _, ledger_of = ledger_table()
    d, p = engine("d", "decode"), engine("p", "prefill")
    behind(ledger_of(d), 1000)  # 30 ms ahead on each
    behind(ledger_of(p), 1000)
    inputs = inputs_for(2000)
    assert place([d], [p], ledger_of, inputs, "auto").prefill is None  # local: 11 ms sooner
    for i in range(10):  # ten requests a second join d's queue, none p's
        ledger_of(d).joined(99.0 + i * 0.1)
    rate = math.exp(-1.0) * (math.e - 1.0) / (math.exp(0.1) - 1.0)
    assert ledger_of(d).arrival_rate(100.0) == pytest.approx(rate)
    # its 50 ms prefill on d would delay the 6 a second that come while d's 80 ms drain
    placement = place([d], [p], ledger_of, inputs, "auto")
    assert placement.prefill is not None
    assert queue_delay_s(ledger_of(d), 0.030, 0.05, 100.0) == pytest.approx(rate * 0.08 * 0.05)


def test_pd_when_local_misses_its_ttft_and_pd_meets() -> None:
    _, ledger_of = ledger_table()
    d, p = engine("d", "decode"), engine("p", "prefill")
    behind(ledger_of(d), 6000)  # the decode engine has 6k tokens of prefill ahead
    placement = place([d], [p], ledger_of, inputs_for(2000), "auto")
    assert placement.prefill is not None  # local: 205 ms
    assert placement.prefill.engine is p
    assert placement.prefill_ranking == [p]
    # the handed-off request waits for d's 155 ms of prefill work, 55 ms of it during its own
    # prefill on p, then the 11 ms handoff
    assert placement.handoff_wait_s == pytest.approx(0.155 - 0.055)
    assert placement.ttft_s == pytest.approx(0.155 + 0.011)


def test_the_handoff_goes_where_it_ends_soonest_not_to_the_lowest_tpot() -> None:
    _, ledger_of = ledger_table()
    d1, d2, p = engine("d1", "decode"), engine("d2", "decode"), engine("p", "prefill")
    for _ in range(4):
        behind(ledger_of(d1), 8000)  # 4 · 205 ms of prefill work queued on d1
    ledger_of(d2).add_prefill(100.0, 0.2)  # d2 prefilled lately: its steps are 1 / 0.8 slower
    inputs = inputs_for(2000)
    ttft_p = 0.005 + 0.05
    slower = decode_candidate(d2, ledger_of(d2), inputs)
    assert slower.tpot_s == pytest.approx(0.006 / 0.8)
    # on d1 the handoff waits behind 820 ms of prefill, 765 ms past its own prefill on p; on d2
    # its 100 predicted tokens take 150 ms longer: d2 ends sooner
    placement = place([d1, d2], [p], ledger_of, inputs, "always")
    assert placement.decode.engine is d2
    assert placement.handoff_wait_s == 0.0
    assert placement.ttft_s == pytest.approx(ttft_p + 0.011)
    ledger_of(d2).add_prefill(100.0, 0.5)  # now 1 / 0.3 slower: 1.4 s more over 100 tokens
    placement = place([d1, d2], [p], ledger_of, inputs, "always")
    assert placement.decode.engine is d1
    assert placement.handoff_wait_s == pytest.approx(4 * 0.205 - ttft_p)


def test_handoff_waits_for_the_decode_engines_prefill_work_beyond_its_own_prefill() -> None:
    _, ledger_of = ledger_table()
    d = engine("d", "decode")
    inputs = inputs_for(2000)
    candidate = decode_candidate(d, ledger_of(d), inputs)
    assert handoff_wait_s(candidate, 0.1) == 0.0  # nothing ahead on d
    behind(ledger_of(d), 8000)  # 205 ms of prefill work ahead on d
    candidate = decode_candidate(d, ledger_of(d), inputs)
    assert handoff_wait_s(candidate, 0.1) == pytest.approx(0.105)
    assert handoff_wait_s(candidate, 0.3) == 0.0  # done before the prefill elsewhere ends


def test_prefill_pool_behind_is_a_predicted_wait_and_keeps_it_local() -> None:
    _, ledger_of = ledger_table()
    d, p1, p2 = engine("d", "decode"), engine("p1", "prefill"), engine("p2", "prefill")
    behind(ledger_of(d), 8000)
    open_on_p1 = behind(ledger_of(p1), 20000)  # this router's own unfinished prefills
    p2.waiting, p2.pending_at_scrape = 30, 0  # other routers' queue, seen in the engine's metrics
    placement = place([d], [p1, p2], ledger_of, inputs_for(2000), "auto")
    assert placement.prefill is None  # P/D would miss too: local, never a hop that loses
    ledger_of(p1).work_done(100.0, open_on_p1, computed=True)  # done: no backlog left
    placement = place([d], [p1, p2], ledger_of, inputs_for(2000), "auto")
    assert placement.prefill is not None
    assert placement.prefill.engine is p1


def test_backlog_is_the_replayed_queue_and_first_tokens_correct_it() -> None:
    _, ledger_of = ledger_table()
    ledger = ledger_of(engine("d", "decode"))
    first = ledger.queue_work(100.0, 4000, 0.0)  # a step of 105 ms
    second = ledger.queue_work(100.0, 2000, 0.0)  # in the same step: 155 ms
    third = ledger.queue_work(100.05, 2000, 0.0)  # the next step: 55 ms
    assert ledger.backlog_s(100.05) == pytest.approx(0.105 + 0.055)
    assert ledger.queue.tokens == 8000
    ledger.work_done(100.06, second, computed=True)  # first token: the first is done too
    assert ledger.queue.tokens == 2000
    ledger.work_done(100.06, first, computed=True)  # a late first token changes nothing
    assert ledger.backlog_s(100.06) == pytest.approx(0.055)  # the next step starts now
    ledger.work_done(100.07, third, computed=False)  # abandoned: it leaves alone
    assert ledger.backlog_s(100.07) == 0.0
    assert ledger.queue.tokens == 0.0
    ledger.queue_work(100.1, 1000, 0.0)
    assert ledger.backlog_s(100.1) == pytest.approx(0.03)  # starts from now, not from before


def test_stream_slack_counts_every_prefill_that_lands_while_it_runs() -> None:
    # 21 tokens at a 7 ms target on a 6 ms step: 20 gaps of 1 ms to spare
    assert stream_slack_s(21, 0.007, 0.006) == pytest.approx(0.020)
    assert stream_slack_s(1, 0.007, 0.006) == pytest.approx(0.001)  # one gap at least
    assert stream_slack_s(21, 0.005, 0.006) < 0  # even undisturbed it misses
    _, ledger_of = ledger_table()
    ledger = ledger_of(engine("d", "decode"))
    assert ledger.tightest_slack_s() is None
    ledger.add_prefill(100.0, 0.5)  # before any stream: counts against none
    first = ledger.add_stream(1000, 20, 0.3)
    ledger.add_prefill(100.1, 0.1)
    second = ledger.add_stream(1000, 20, 0.25)
    assert ledger.tightest_slack_s() == pytest.approx(0.2)  # the first met 0.1 s of stall
    ledger.add_prefill(100.2, 0.05)
    assert ledger.tightest_slack_s() == pytest.approx(0.15)
    ledger.end_stream(1000, 20, first)
    assert ledger.tightest_slack_s() == pytest.approx(0.2)  # the second: 0.25 - 0.05
    ledger.end_stream(1000, 20, second)
    assert ledger.tightest_slack_s() is None
    assert ledger.streams == 0


def test_pd_when_local_prefill_would_take_a_stream_past_its_tpot_target() -> None:
    _, ledger_of = ledger_table()
    d, p = engine("d", "decode"), engine("p", "prefill")
    ledger = ledger_of(d)
    for _ in range(4):  # four streams of 11 tokens at a 7 ms target on a 6 ms step: 10 ms slack
        ledger.add_stream(1000, 11, stream_slack_s(11, 0.007, 0.006))
    d.in_flight = 4
    behind(ledger_of(p), 8032)  # P/D: 8,192 tokens + 5.5 ms handoff = 215 ms
    # a 160-token prefill stalls them 4 ms: within their slack, local (9 + 4 · 4 ms in all)
    placement = place([d], [p], ledger_of, inputs_for(160, ttft_ms=1000), "auto")
    assert placement.prefill is None
    # ... but it is counted: two more such prefills and a third no longer fits
    ledger.add_prefill(100.0, placement.decode.stall_s)
    ledger.add_prefill(100.0, placement.decode.stall_s)
    assert ledger.tightest_slack_s() == pytest.approx(0.002)
    placement = place([d], [p], ledger_of, inputs_for(160, ttft_ms=1000), "auto")
    assert placement.prefill is not None
    # a TTFT target that only local meets is not given up for it
    placement = place([d], [p], ledger_of, inputs_for(160, ttft_ms=12), "auto")
    assert placement.prefill is None


def test_an_idle_engine_sent_nothing_for_a_while_is_probed() -> None:
    _, ledger_of = ledger_table()
    d, p = engine("d", "decode"), engine("p", "prefill")
    ledger_of(p).costs.prefill.theta = [1.0, 1.0]  # judged slow: a 1 s prefill at least
    inputs = inputs_for(2000, ttft_ms=500)
    assert place([d], [p], ledger_of, inputs, "auto").prefill is None
    probing = replace(inputs, reprobe_s=2.0)
    assert not due_for_probe(p, ledger_of(p), 100.0, 2.0)  # never tried: its seeds decide
    ledger_of(p).last_placed = ledger_of(d).last_placed = 90.0  # tried 10 s ago
    placement = place([d], [p], ledger_of, probing, "auto")
    assert placement.prefill is not None
    assert placement.prefill.engine is p
    ledger_of(p).last_placed = ledger_of(d).last_placed = 99.0
    assert place([d], [p], ledger_of, probing, "auto").prefill is None  # tried 1 s ago
    ledger_of(p).last_placed = 97.5
    assert place([d], [p], ledger_of, probing, "auto").prefill is not None  # 2.5 s ago
    p.waiting = 1  # busy now: what it does is being observed, no probe
    assert not due_for_probe(p, ledger_of(p), 100.0, 2.0)
    assert place([d], [p], ledger_of, probing, "auto").prefill is None
    assert not due_for_probe(p, ledger_of(p), 100.0, 0.0)  # 0 turns it off


def test_a_probed_decode_candidate_is_picked_and_not_shed() -> None:
    _, ledger_of = ledger_table()
    a, b = engine("a", "both"), engine("b", "both")
    ledger_of(b).costs.prefill.theta = [5.0, 1.0]  # b judged very slow
    ledger_of(a).last_placed, ledger_of(b).last_placed = 99.5, 90.0
    inputs = replace(inputs_for(2000, sheddable=True), reprobe_s=2.0)
    placement = place([a, b], [], ledger_of, inputs, "auto")
    assert placement.decode.engine is b
    assert not placement.shed  # a probe is served even when predicted to miss
    ledger_of(b).last_placed = 99.5
    placement = place([a, b], [], ledger_of, inputs, "auto")
    assert placement.decode.engine is a


def test_interference_budget_sends_prefills_to_the_pool_unless_only_local_meets() -> None:
    _, ledger_of = ledger_table()
    d, p = engine("d", "decode"), engine("p", "prefill")
    behind(ledger_of(p), 6192)  # P/D: 8,192 tokens, 0.011 s handoff
    placement = place([d], [p], ledger_of, inputs_for(2000, ttft_ms=300), "auto")
    assert placement.prefill is None  # local is faster and within budget (share 0 + 0.05)
    ledger_of(d).add_prefill(100.0, 0.28)  # the decode engine already spends 28% prefilling
    placement = place([d], [p], ledger_of, inputs_for(2000, ttft_ms=300), "auto")
    assert placement.decode.tpot_s == pytest.approx(0.006 / (1 - 0.28))
    assert placement.prefill is None  # over budget, but no stream decodes there to suffer it
    ledger_of(d).add_stream(1000, 100, 1.0)
    d.in_flight = 1  # one stream: 58 + 50 ms local against 224 ms P/D, but over budget
    placement = place([d], [p], ledger_of, inputs_for(2000, ttft_ms=300), "auto")
    assert placement.prefill is not None  # 0.28 + 0.05 > 0.3, and P/D meets its 300 ms
    # a step of p's 6,192 tokens ahead, one of its own 2,000, the handoff after half the step
    # in flight on d (its one stream decoding)
    assert placement.ttft_s == pytest.approx(
        0.005 + 0.025 * 6.192 + 0.005 + 0.025 * 2 + 0.011 + 0.005 / 2
    )
    placement = place([d], [p], ledger_of, inputs_for(2000, ttft_ms=100), "auto")
    assert placement.prefill is None  # P/D would miss 100 ms, local meets it: local


def test_local_costs_the_delay_it_adds_to_running_streams() -> None:
    _, ledger_of = ledger_table()
    d, p = engine("d", "decode"), engine("p", "prefill")
    behind(ledger_of(p), 6192)  # P/D: 8,192 tokens + 11 ms handoff = 221 ms
    assert place([d], [p], ledger_of, inputs_for(2000), "auto").prefill is None  # 55 ms local
    d.in_flight = 4  # four streams would wait 50 ms each: 55 + 200 ms > 221 ms
    within_target = inputs_for(2000, ttft_ms=500)
    assert place([d], [p], ledger_of, within_target, "auto").prefill is not None


def test_local_costs_the_delay_it_adds_to_handoffs_on_their_way() -> None:
    """A prompt prefilled elsewhere and pulled to d waits in d's queue for a local prefill's
    chunks to leave room in a step's token budget, as long as a stream waits for them."""
    _, ledger_of = ledger_table()
    d, p = engine("d", "decode"), engine("p", "prefill")
    behind(ledger_of(p), 6192)  # P/D: 221 ms, local 55 ms
    within_target = inputs_for(2000, ttft_ms=500)
    assert place([d], [p], ledger_of, within_target, "auto").prefill is None
    ledger_of(d).handoffs_due = 4  # no stream decodes on d, four handoffs are on their way
    placement = place([d], [p], ledger_of, within_target, "auto")
    assert placement.prefill is not None
    assert placement.candidates[0].waiters == 4
    # between two decode engines alike but for the handoffs due, the local prefill goes where
    # it holds none up
    quiet = engine("quiet", "decode")
    local = place([d, quiet], [], ledger_of, within_target, "auto")
    assert local.decode.engine is quiet
    assert local.candidates[0].cost - local.candidates[1].cost == pytest.approx(
        4 * local.decode.stall_s
    )


def test_a_long_prompt_gives_up_its_target_to_keep_more_handoffs_within_theirs() -> None:
    """A local prefill that fills every step's token budget holds each prompt pulled to its
    engine until it ends: when that takes a handoff on its way there past its TTFT target, the
    request goes P/D though P/D misses its own (one target kept for one expected to be lost)."""
    _, ledger_of = ledger_table()
    d, p = engine("d", "decode"), engine("p", "prefill")
    behind(ledger_of(p), 6192)  # P/D: ~0.42 s, local: two steps, ~0.235 s
    ledger = ledger_of(d)
    ledger.handoffs_due = 1
    inputs = inputs_for(9000, ttft_ms=300)
    local = place([d], [p], ledger_of, inputs, "auto")
    assert local.prefill is None  # local meets 300 ms, P/D would not
    ledger.handoff_deadlines[1] = 100.0 + local.ttft_s + 0.01  # met even behind it
    assert place([d], [p], ledger_of, inputs, "auto").prefill is None
    ledger.handoff_deadlines[1] = 100.0 + local.ttft_s - 0.01  # taken past its target
    moved = place([d], [p], ledger_of, inputs, "auto")
    assert moved.prefill is not None
    assert moved.ttft_s > 0.3
    # a prompt within one step's budget leaves room in it for the pulled prompt: local
    assert place([d], [p], ledger_of, inputs_for(8000, ttft_ms=300), "auto").prefill is None


def test_the_streams_delay_never_buys_a_p_d_wait_past_the_requests_own_target() -> None:
    _, ledger_of = ledger_table()
    d, p = engine("d", "decode"), engine("p", "prefill")
    behind(ledger_of(p), 6192)  # P/D: 221 ms, local 55 ms
    d.in_flight = 40  # forty streams would wait 50 ms each: P/D costs the pool far less
    past_target = inputs_for(2000, ttft_ms=150)
    assert place([d], [p], ledger_of, past_target, "auto").prefill is None


def test_ttft_sigma_is_the_decayed_squared_log_ratio() -> None:
    _, ledger_of = ledger_table()
    ledger = ledger_of(engine("p", "prefill"))
    for _ in range(200):
        ledger.learn_ttft(0.0)  # predicted right each time
    assert ledger.ttft_sigma() == pytest.approx(0.05, abs=1e-3)  # the floor
    for _ in range(400):
        ledger.learn_ttft(math.log(100.0))
    assert ledger.ttft_sigma() == pytest.approx(math.log(100.0), rel=1e-3)


def test_an_observation_of_nothing_teaches_nothing() -> None:
    predictor = Predictor(PredictiveConfig(), RouterMetrics())
    assert predictor.observe_error("ttft", 0.0, 1.0) is None
    assert predictor.observe_error("ttft", 1.0, 0.0) is None
    assert predictor.observe_error("ttft", 0.5, 1.0) == pytest.approx(math.log(2.0))


SEED_2000 = 0.005 + 0.025 * 2  # a prefill of 2,000 tokens at the seeds of `ledger_table`


def teach_a_pace_of_two(queue: PrefillQueue) -> None:
    """Forty pairs of 2,000-token prefills in line, the second of each taking twice its seed."""
    for i in range(40):
        first = queue.add(10.0 + i, 2000, 0.0, 0.0, 0.0)
        second = queue.add(10.0 + i, 2000, 0.0, 0.0, 0.0)
        queue.complete(first, 10.0 + i + 0.01, 0.0, 0.0)
        queue.complete(second, 10.0 + i + 0.01 + 2 * SEED_2000, 0.0, 0.0)


def test_a_prefill_engine_slower_under_load_than_its_model_loses_its_requests() -> None:
    """The cost models learn only from requests with nothing ahead; the queue's pace, from the
    first tokens under load, moves the P/D prefill to the engine that keeps its predictions."""
    _, ledger_of = ledger_table()
    d, p1, p2 = engine("d", "decode"), engine("p1", "prefill"), engine("p2", "prefill")
    behind(ledger_of(d), 8000)  # local is far behind: P/D
    behind(ledger_of(p2), 400)  # p2 has a little of this router's work open, p1 none
    inputs = inputs_for(2000, ttft_ms=1000)
    placement = place([d], [p1, p2], ledger_of, inputs, "auto")
    assert placement.prefill is not None
    assert placement.prefill.engine is p1
    slow = ledger_of(p1).queue
    teach_a_pace_of_two(slow)  # p1's prefills under load take twice the predicted time
    assert slow.pace == pytest.approx(2.0, rel=0.1)  # the prior still weighs a little
    behind(ledger_of(p1), 400)  # now both have the same work open: p1's waits at its pace
    placement = place([d], [p1, p2], ledger_of, inputs, "auto")
    assert placement.prefill is not None
    assert placement.prefill.engine is p2
    assert placement.prefill_ranking == [p2, p1]
    assert decode_candidate(d, ledger_of(d), inputs).ttft_s == pytest.approx(0.205 + 0.055)


def test_a_prefill_alone_is_predicted_by_the_model_of_prefills_alone() -> None:
    """κ is learned from prefills that met an idle engine, the queue's pace κ_q from those that
    waited in line: each predicts its own kind, and κ_q an engine never observed alone."""
    _, ledger_of = ledger_table()
    d = engine("d", "decode")
    ledger = ledger_of(d)
    queue = ledger.queue
    teach_a_pace_of_two(queue)  # in line, each prefill takes twice its seed; alone, its seed
    assert queue.pace == pytest.approx(2.0, rel=0.1)
    inputs = inputs_for(2000)
    alone = decode_candidate(d, ledger, inputs)
    assert (alone.ttft_s, alone.pace) == pytest.approx((SEED_2000, 1.0))  # idle: κ = 1
    ahead = behind(ledger, 2000)  # 2,000 tokens ahead, then its own, both at the pace
    candidate = decode_candidate(d, ledger, inputs)
    assert candidate.backlog_s == pytest.approx(queue.pace * SEED_2000)
    assert candidate.ttft_s == pytest.approx(2 * queue.pace * SEED_2000)
    assert candidate.pace == queue.pace
    ledger.work_done(100.0, ahead, computed=False)
    assert decode_candidate(d, ledger, inputs).ttft_s == pytest.approx(SEED_2000)
    ledger.costs.prefill.samples = 0  # never observed alone: its seed is no measure of it
    assert decode_candidate(d, ledger, inputs).ttft_s == pytest.approx(queue.pace * SEED_2000)


def test_pick_prefers_the_cached_engine_and_the_idle_one() -> None:
    _, ledger_of = ledger_table()
    a, b = engine("a", "both"), engine("b", "both")
    hits = {a.id: 100}  # 1,600 of 2,000 tokens cached on a
    placement = place([a, b], [], ledger_of, inputs_for(2000, hits=hits), "auto")
    assert placement.decode.engine is a
    assert placement.ranking == [a, b]
    behind(ledger_of(a), 12000)  # a is far behind: b meets the target, a does not
    placement = place([a, b], [], ledger_of, inputs_for(2000, hits=hits), "auto")
    assert placement.decode.engine is b


def test_the_pick_counts_what_uncached_work_delays_the_requests_that_queue_behind_it() -> None:
    """An idle engine would reach the first token sooner than the cached one behind its queue,
    but its whole prompt to compute delays every request that joins its queue meanwhile; the
    cached engine's wait delays no one, and its short prefill delays them little."""
    _, ledger_of = ledger_table()
    cached, idle = engine("cached", "both"), engine("idle", "both")
    hits = {cached.id: 100}  # 1,600 of 2,000 tokens cached
    behind(ledger_of(cached), 3000)  # 80 ms of prefill queued there
    inputs = inputs_for(2000, hits=hits)
    placement = place([cached, idle], [], ledger_of, inputs, "auto")
    by_engine = {c.engine: c for c in placement.candidates}
    assert by_engine[cached].backlog_s == pytest.approx(0.08)
    # 95 ms against 55 ms: further off than the cached rule's 1.5x
    assert by_engine[cached].ttft_s > CACHE_TTFT_RATIO * by_engine[idle].ttft_s
    assert placement.decode.engine is idle  # nothing joins either queue: nobody to delay
    for e in (cached, idle):  # sixty requests a second join each engine's queue
        for i in range(60):
            ledger_of(e).joined(99.0 + i / 60)
    rate = ledger_of(idle).arrival_rate(100.0)
    placement = place([cached, idle], [], ledger_of, inputs, "auto")
    by_engine = {c.engine: c for c in placement.candidates}
    assert by_engine[idle].queued_s == pytest.approx(rate * 0.05 * 0.05)  # its 50 ms prefill
    assert by_engine[cached].queued_s == pytest.approx(rate * (0.08 + 0.01) * 0.01)
    assert by_engine[cached].cost < by_engine[idle].cost
    assert placement.decode.engine is cached


def test_a_cached_candidate_close_enough_in_ttft_is_taken_over_a_cheaper_one() -> None:
    """TTFTs within 1.5x of each other are within the predictions' error, the compute a hit
    saves is not: the candidate holding more of the prompt is taken over the cheapest one while
    it is predicted within CACHE_TTFT_RATIO of its TTFT and likely to meet its target."""
    _, ledger_of = ledger_table()
    cached, idle, other = engine("cached", "both"), engine("idle", "both"), engine("o", "both")
    hits = {cached.id: 100, other.id: 50}  # 1,600 and 800 of 2,000 tokens cached
    behind(ledger_of(cached), 2000)  # 55 ms of prefill queued there
    behind(ledger_of(other), 3000)
    inputs = inputs_for(2000, hits=hits)
    placement = place([idle, other, cached], [], ledger_of, inputs, "auto")
    by_engine = {c.engine: c for c in placement.candidates}
    assert by_engine[idle].cost < by_engine[cached].cost  # the cost alone picks the idle one
    # 70 ms against 55 ms
    assert by_engine[cached].ttft_s < CACHE_TTFT_RATIO * by_engine[idle].ttft_s
    assert placement.decode.engine is cached
    assert placement.ranking == [cached, idle, other]
    behind(ledger_of(cached), 1000)  # 97.5 ms now: too far off, the cheapest is taken
    assert place([idle, other, cached], [], ledger_of, inputs, "auto").decode.engine is idle
    tight = inputs_for(2000, ttft_ms=60, hits=hits)  # unlikely to meet 60 ms: not over the bar
    _, ledger_of = ledger_table()
    behind(ledger_of(cached), 2000)
    placement = place([idle, cached], [], ledger_of, tight, "auto")
    assert {c.engine: c for c in placement.candidates}[cached].ttft_meet < placement.meet_bar
    assert placement.decode.engine is idle


def test_of_two_equally_cached_candidates_at_one_cost_every_replica_takes_the_same() -> None:
    """The cached rule breaks an exact tie as the pick does, by the first block's rendezvous
    weight, so the candidates' order (each replica's pool order) does not decide it."""
    _, ledger_of = ledger_table()
    idle, a, b = engine("idle", "both"), engine("a", "both"), engine("b", "both")
    hits = {a.id: 100, b.id: 100}
    for twin in (a, b):
        behind(ledger_of(twin), 2000)  # alike in every figure: the same cost
    for key in range(8):
        inputs = replace(inputs_for(2000, hits=hits), first_block_key=key)
        heavier = a if weight(key, a.id) > weight(key, b.id) else b
        for order in ([idle, a, b], [idle, b, a]):
            assert place(order, [], ledger_of, inputs, "auto").decode.engine is heavier


def test_every_candidate_likely_to_meet_its_ttft_is_weighed_by_cost() -> None:
    """The pick ranks by P(TTFT ≤ T_ttft) only below meetProbability, and never by the TPOT
    factor of P(meet): the cached engine, whose recent prefills make its predicted TPOT the less
    likely to meet, is taken while it is the cheaper one and likely to meet its TTFT."""
    _, ledger_of = ledger_table()
    cached, busy = engine("cached", "both"), engine("busy", "both")
    busy.running = 10.0  # ten streams that a local prefill there would stall
    hits = {cached.id: 100}  # 1,600 of 2,000 tokens cached
    ledger_of(cached).add_prefill(100.0, 0.3)  # a prefill share of 0.3: TPOT 8.6 ms, not 6
    inputs = inputs_for(2000, tpot_ms=10, hits=hits)
    placement = place([cached, busy], [], ledger_of, inputs, "auto")
    by_engine = {c.engine: c for c in placement.candidates}
    assert 0.5 < by_engine[cached].meet < by_engine[busy].meet - 0.05
    assert by_engine[cached].cost < by_engine[busy].cost
    assert placement.decode.engine is cached
    busy.running = 30.0
    ledger_of(cached).add_prefill(100.0, 0.3)  # now 0.6: TPOT 15 ms, likely to miss its target
    placement = place([cached, busy], [], ledger_of, inputs, "auto")
    by_engine = {c.engine: c for c in placement.candidates}
    assert by_engine[cached].meet < 0.5 < by_engine[cached].ttft_meet
    assert placement.decode.engine is cached  # still the cheaper, and its TTFT is likely met
    behind(ledger_of(cached), 12000)  # 320 ms to its first token against a 200 ms target
    placement = place([cached, busy], [], ledger_of, inputs, "auto")
    assert {c.engine: c for c in placement.candidates}[cached].ttft_meet < 0.5
    assert placement.decode.engine is busy


def test_modes_and_colocated_engines() -> None:
    _, ledger_of = ledger_table()
    d, p, c = engine("d", "decode"), engine("p", "prefill"), engine("c", "both")
    assert place([d], [p], ledger_of, inputs_for(2000), "always").prefill is not None
    behind(ledger_of(d), 8000)
    assert place([d], [p], ledger_of, inputs_for(2000), "never").prefill is None
    assert place([c], [p], ledger_of, inputs_for(2000), "auto").prefill is None


def test_sheddable_request_is_shed_when_no_placement_meets() -> None:
    _, ledger_of = ledger_table()
    d = engine("d", "decode")
    behind(ledger_of(d), 100000)  # 2.5 s ahead
    placement = place([d], [], ledger_of, inputs_for(1000, sheddable=True), "auto")
    assert placement.shed
    assert retry_after_s(placement, SloTarget(0.2, 0.05, True)) == 3
    assert not place([d], [], ledger_of, inputs_for(1000), "auto").shed


def test_a_full_kv_cache_is_a_wait_until_its_streams_free_enough() -> None:
    _, ledger_of = ledger_table()
    d1, d2 = engine("d1", "decode"), engine("d2", "decode")
    for e in (d1, d2):
        e.kv_capacity, e.running = 10_000.0, 4.0
    d1.kv_usage = 0.9  # 9,000 of 10,000 tokens held by four streams
    inputs = inputs_for(2000)  # median output 100: a stream has 50 tokens left on average
    full = decode_candidate(d1, ledger_of(d1), inputs)
    # 1,000 tokens too many, freed at 9,000 tokens per 50 steps of 6 ms
    assert full.kv_wait_s == pytest.approx(1000 * 50 * 0.006 / 9000)
    assert full.ttft_s == pytest.approx(full.kv_wait_s + 0.055)  # then its own prefill
    assert handoff_wait_s(full, 0.01) == pytest.approx(full.kv_wait_s - 0.01)
    ledger_of(d2).claim(1500)  # a request this router sent d2 still needs 1,500 tokens
    d2.kv_usage = 0.6
    assert decode_candidate(d2, ledger_of(d2), inputs).kv_wait_s == 0.0  # 9,500 fit
    ledger_of(d2).claim(1000)
    assert decode_candidate(d2, ledger_of(d2), inputs).kv_wait_s == pytest.approx(
        500 * 50 * 0.006 / 6000
    )
    assert place([d1, d2], [], ledger_of, inputs, "auto").decode.engine is d2
    d1.kv_capacity = 0.0  # an engine that reports no cache config: no term
    assert decode_candidate(d1, ledger_of(d1), inputs).kv_wait_s == 0.0
    d2.running = 0.0  # nothing decoding: what it holds is prefills that finish soon
    assert decode_candidate(d2, ledger_of(d2), inputs).kv_wait_s == 0.0


def test_kv_overflow_rules_an_engine_out() -> None:
    ledger = EngineLedger(
        EngineCosts((0.005, 0.025, 0.0), (0.005, 0.003), (0.006, 0.0, 0.0), 0.98), 1.0
    )
    ledger.add_stream(9000, 2000, 1.0)
    full = engine("full", "decode")
    full.kv_usage = 0.9
    assert kv_overflows(full, ledger, 9000.0, 2000.0)
    full.kv_usage = 0.5
    assert not kv_overflows(full, ledger, 9000.0, 2000.0)


# -- the plan and the ticket ----------------------------------------------------------------------


def config(**scoring: object) -> RouterConfig:
    return RouterConfig.model_validate(
        {"servedModelName": "m", "static": {}, "scoring": {"policy": "predictive", **scoring}}
    )


def predictive_inputs(predictor: Predictor) -> PredictiveInputs:
    keys = length_keys(False, 100, 2000, None)
    return PredictiveInputs(predictor, SloTarget(0.2, 0.05, False), keys, 100, 100.0)


def test_plan_keeps_a_session_on_its_engine_and_n_above_one_local() -> None:
    cfg = config()
    predictor = Predictor(cfg.scoring.predictive, RouterMetrics())
    d1, d2, p = engine("d1", "decode"), engine("d2", "decode"), engine("p", "prefill")
    for e in (d1, d2):
        behind(predictor.ledger(e), 8000)

    def inputs(n: int, session: str | None = None) -> RouteInputs:
        return plan_inputs([d1, d2], predictive_inputs(predictor), [p], n, session)

    session = plan_route(inputs(1, "alice"), cfg)
    again = plan_route(inputs(1, "alice"), cfg)
    assert session is not None
    assert again is not None
    assert session.decode.engine is again.decode.engine
    assert {c.engine for c in session.decode_ranking} == {d1, d2}
    assert session.route is Route.DISAGGREGATED
    many = plan_route(inputs(2), cfg)
    assert many is not None
    assert many.route is Route.LOCAL
    assert not many.prefill_ranking


def test_a_plan_sees_every_placement_before_it_settled_or_not() -> None:
    """A ticket's share of the ledgers waits for `settle` (the proxy runs it once the request is
    sent), but the next plan settles first: the request placed just before it is in its
    engine's queue, and its size in the means the plan reads."""
    cfg = config()
    predictor = Predictor(cfg.scoring.predictive, RouterMetrics())
    d1, d2 = engine("d1", "decode"), engine("d2", "decode")
    ledger = predictor.ledger(d1)
    planned = plan_route(plan_inputs([d1, d2], predictive_inputs(predictor)), cfg)
    assert planned is not None
    assert planned.placement is not None
    assert planned.placement.decode.backlog_s == 0.0
    assert planned.decode.engine is d1  # the tie's rendezvous order without a first block
    predictor.ticket(planned.placement, length_keys(False, 100, 2000, None), True)
    assert not ledger.queue.open  # not yet taken
    assert predictor.mean_uncached_tokens == 512.0
    again = plan_route(plan_inputs([d1], predictive_inputs(predictor)), cfg)
    assert again is not None
    assert again.placement is not None
    assert ledger.queue.open == 1
    assert again.placement.decode.backlog_s > 0.0  # behind the first one's 2,000 tokens
    assert predictor.mean_uncached_tokens > 512.0


def test_a_plan_no_prediction_could_change_is_predicted_once_it_is_sent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One decode engine, nothing to hand off from, a class never shed, nothing of the router's
    prefilling or pulling there: the plan is decided before any prediction, and its predictions
    are made at the next `settle`, with the ledgers as they were when it was planned (the proxy
    schedules it for once the request is sent; here the next plan runs it first)."""
    cfg = config()
    predictor = Predictor(cfg.scoring.predictive, RouterMetrics())
    d, p = engine("d", "decode"), engine("p", "prefill")
    ledger = predictor.ledger(d)
    planned = plan_route(plan_inputs([d], predictive_inputs(predictor)), cfg)
    assert planned is not None
    assert planned.placement is None
    assert planned.place_later is not None
    assert [c.engine for c in planned.decode_ranking] == [d]
    assert planned.route is Route.LOCAL
    made = planned.place_later()  # what `settle` will make: as if placed now
    assert made.decode.engine is d
    assert made.decode.backlog_s == 0.0
    ticket = predictor.ticket(planned.place_later, length_keys(False, 100, 2000, None), True)
    assert not ledger.queue.open
    ticket.prefilled(False, None)  # local: nothing to report, and nothing made for it
    assert not ledger.queue.open
    again = plan_route(plan_inputs([d], predictive_inputs(predictor)), cfg)
    assert again is not None
    assert ledger.queue.open == 1  # the first one's share, taken as the plan settled
    assert ticket.placement.ttft_s == made.ttft_s  # predicted as of its own plan
    assert again.placement is not None  # now behind it: a hold is possible, so it predicts
    assert again.placement.decode.backlog_s > 0.0
    ticket.first_byte(d, now=10.5, upstream_start=10.0, prefill_done=None)
    ticket.finished(output_tokens=51, last_event=11.5)
    assert ledger.streams == 0
    # a request that fails before its first byte, with no plan after it: made as it ends
    failed = plan_route(plan_inputs([d], predictive_inputs(predictor)), cfg)
    assert failed is not None
    assert failed.place_later is not None
    lost = predictor.ticket(failed.place_later, length_keys(False, 100, 2000, None), True)
    with caplog.at_level(logging.DEBUG, logger="tandem.router.predict.predictor"):
        lost.finished(None, None)  # its debug line explains the placement made for it
    assert '"route": "local"' in caplog.text
    assert not ledger.queue.open
    assert ledger.claimed_tokens == 0
    # a session keeps its engine: with nothing to hand off from, decided alone as well
    d2 = engine("d2", "decode")
    pinned = plan_route(plan_inputs([d, d2], predictive_inputs(predictor), session="alice"), cfg)
    assert pinned is not None
    assert pinned.place_later is not None
    assert {c.engine for c in pinned.decode_ranking} == {d, d2}  # the rest for retries
    # a sheddable class, a second engine or a prefill engine to weigh: predicted at once
    for target, decoders, prefillers in (
        (SloTarget(0.2, 0.05, True), [d], []),
        (SloTarget(0.2, 0.05, False), [d, d2], []),
        (SloTarget(0.2, 0.05, False), [d], [p]),
    ):
        inputs = predictive_inputs(predictor)
        inputs.target = target
        plan = plan_route(plan_inputs(decoders, inputs, prefillers), cfg)
        assert plan is not None
        assert plan.placement is not None
        assert plan.place_later is None


def plan_inputs(
    decoders: list[Engine],
    predictive: PredictiveInputs,
    prefillers: list[Engine] | None = None,
    n: int = 1,
    session: str | None = None,
) -> RouteInputs:
    """A request of 2,000 tokens (125 blocks), nothing cached, for `plan_route`."""
    return RouteInputs(
        prompt_tokens=2000,
        total_blocks=125,
        n=n,
        decoders=decoders,
        prefillers=prefillers or [],
        any_prefill_configured=bool(prefillers),
        hits={},
        cached_blocks={},
        session=session,
        predictive=predictive,
    )


def test_ticket_holds_and_gives_back_and_teaches() -> None:
    cfg = config()
    metrics = RouterMetrics()
    predictor = Predictor(cfg.scoring.predictive, metrics)
    d = engine("d", "decode")
    target = SloTarget(0.2, 0.05, False)
    keys = length_keys(False, 100, 2000, None)
    output = predictor.lengths.predict(keys, 100)
    inputs = PlacementInputs(2000, 16, {}, output, target, 0.5, 0.3, 1000.0, 1e6, 1000.0, 100.0)
    placement = place([d], [], predictor.ledger, inputs, "auto")
    ledger = predictor.ledger(d)
    ticket = predictor.ticket(placement, keys, True)
    assert ledger.queue.tokens == 0  # its share is taken at the next settle, off its way
    assert predictor.ledger(d) is ledger  # which every reader of a ledger calls first
    assert ledger.queue.tokens == 2000
    assert ledger.claimed_tokens == 2000  # its prompt's KV, needed before its first token
    assert ledger.prefills_open == 1
    assert ledger.prefill_share(100.0) == pytest.approx(placement.decode.stall_s)
    before = ledger.costs.prefill_s(2000, 2e6)
    ticket.first_byte(d, now=10.5, upstream_start=10.0, prefill_done=None)
    assert ledger.queue.tokens == 0
    assert ledger.claimed_tokens == 0  # now a stream's
    assert ledger.streams == 1
    assert ledger.last_placed == 100.0
    # the stream's slack: its predicted output's gaps at the 50 ms target less a 6 ms step
    slack = stream_slack_s(output.median, 0.05, ledger.costs.step_s(1, 2000 + output.median / 2))
    assert ledger.tightest_slack_s() == pytest.approx(slack)  # its own prefill came before it
    assert ledger.costs.prefill_s(2000, 2e6) == before  # models learn once the answer has left
    ticket.finished(output_tokens=51, last_event=11.5)
    assert ledger.streams == 0
    assert ledger.stream_tokens == 0
    assert ledger.costs.prefill_s(2000, 2e6) > before  # 0.5 s observed against ~0.06 s predicted
    assert ledger.tightest_slack_s() is None
    assert ledger.costs.step_s(1, 2000) > 0.006  # 1 s over 50 tokens: 20 ms a step
    text = metrics.render().decode()
    for quantity in ("ttft", "tpot", "output_tokens", "output_tokens_mean"):
        assert f'tandem_router_prediction_error_ratio_count{{quantity="{quantity}"}} 1.0' in text
    assert ledger.prefills_open == 0
    ticket.finished(None, None)  # a second end gives nothing back twice
    assert ledger.streams == 0
    assert ledger.prefills_open == 0


def test_a_prefill_answer_teaches_its_engine_before_the_request_ends() -> None:
    """An engine of unknown pace takes one request at a time only until that request's prefill
    answers, not until its decode elsewhere ends: a slow decode pool would hold the prefill
    engine idle that long."""
    predictor = Predictor(config().scoring.predictive, RouterMetrics())
    d, p = engine("d", "decode"), engine("p", "prefill")
    target = SloTarget(1.0, 0.05, False)
    keys = length_keys(False, 100, 2000, None)
    output = predictor.lengths.predict(keys, 100)
    inputs = PlacementInputs(2000, 16, {}, output, target, 0.5, 0.3, 1000.0, 1e6, 1000.0, 100.0)
    behind(predictor.ledger(d), 30000)  # local is far behind: P/D is predicted faster
    placement = place([d], [p], predictor.ledger, inputs, "auto")
    assert placement.prefill is not None
    ticket = predictor.ticket(placement, keys, True)
    ledger = predictor.ledger(p)
    assert ledger.prefills_open == 1
    assert predictor.ledger(d).handoffs_due == 1  # on its way to d until its first byte
    assert place([d], [p], predictor.ledger, inputs, "auto").prefill is None  # one at a time
    ticket.prefilled(handed_off=True, seconds=0.06)
    assert ledger.costs.prefill.samples == 1
    assert ledger.prefills_open == 0
    assert place([d], [p], predictor.ledger, inputs, "auto").prefill is not None
    ticket.first_byte(d, now=100.2, upstream_start=100.0, prefill_done=100.06)
    assert predictor.ledger(d).handoffs_due == 0
    assert ticket.explain(51, 110.0)["prefill_obs_ms"] == 60.0  # still there for the debug line
    ticket.finished(output_tokens=51, last_event=110.0)
    assert ledger.costs.prefill.samples == 1  # taught once
    assert ledger.prefills_open == 0


def test_a_prefill_placed_before_another_on_its_engine_teaches_no_cost_sample() -> None:
    """A request joined on its engine by one placed behind it before its first token may share
    its last step with it (vLLM fills a step's token budget from every waiting request): its
    time is not its own work's, and would teach the fixed part a what the work behind it took."""
    predictor = Predictor(config().scoring.predictive, RouterMetrics())
    d = engine("d", "decode")
    ledger = predictor.ledger(d)
    target = SloTarget(1.0, 0.05, False)
    keys = length_keys(False, 100, 2000, None)
    output = predictor.lengths.predict(keys, 100)

    def placed(now: float) -> Ticket:
        inputs = PlacementInputs(2000, 16, {}, output, target, 0.5, 0.3, 1e3, 1e6, 1e3, now)
        placement = place([d], [], predictor.ledger, inputs, "never")
        return predictor.ticket(placement, keys, True)

    first, second = placed(100.0), placed(100.001)
    first.first_byte(d, now=100.3, upstream_start=100.0, prefill_done=None)
    second.first_byte(d, now=100.3, upstream_start=100.001, prefill_done=None)
    for ticket in (first, second):
        ticket.finished(output_tokens=51, last_event=101.0)
    assert ledger.costs.prefill.samples == 0  # the first was followed, the second queued
    alone = placed(200.0)
    alone.first_byte(d, now=200.1, upstream_start=200.0, prefill_done=None)
    alone.finished(output_tokens=51, last_event=201.0)
    assert ledger.costs.prefill.samples == 1


@dataclass
class HandedOff:
    """A P/D request of 2,000 tokens planned onto the first of two decode engines alike."""

    predictor: Predictor
    planned: Engine
    other: Engine
    inputs: PlacementInputs
    placement: Placement
    ticket: Ticket


def handed_off_between_two(metrics: RouterMetrics) -> HandedOff:
    predictor = Predictor(config().scoring.predictive, metrics)
    planned, other, p = engine("d1", "decode"), engine("d2", "decode"), engine("p", "prefill")
    target = SloTarget(1.0, 0.05, False)
    keys = length_keys(False, 100, 2000, None)
    output = predictor.lengths.predict(keys, 100)
    inputs = PlacementInputs(2000, 16, {}, output, target, 0.5, 0.3, 1000.0, 1e6, 1000.0, 100.0)
    for decode in (planned, other):
        behind(predictor.ledger(decode), 30000)  # local is far behind on both: P/D
    placement = place([planned, other], [p], predictor.ledger, inputs, "auto")
    assert placement.prefill is not None
    assert placement.decode.engine is planned  # a tie: the first
    ticket = predictor.ticket(placement, keys, True)
    return HandedOff(predictor, planned, other, inputs, placement, ticket)


def test_a_handoff_goes_where_the_pool_is_free_when_its_prefill_answers() -> None:
    """The decode engine is chosen again once the prompt's KV is ready to pull: a prefill placed
    on the planned engine meanwhile would hold the handoff for its whole length."""
    metrics = RouterMetrics()
    case = handed_off_between_two(metrics)
    predictor, planned, other = case.predictor, case.planned, case.other
    placement, ticket = case.placement, case.ticket
    assert placement.prefill is not None
    # nothing changed by the time the prefill answers: the plan stands
    assert handoff_decode(placement, [planned, other], predictor.ledger, 100.0)[0].engine is planned
    assert predictor.ledger(planned).handoffs_due == 1
    assert placement.ttft_s > 1.0  # behind the planned engine's backlog: no target to keep
    assert not predictor.ledger(planned).handoff_deadlines
    behind(predictor.ledger(planned), 16000)  # a long prefill placed there while p prefilled
    assert handoff_decode(placement, [planned], predictor.ledger, 100.0)[0].engine is planned
    chosen = ticket.hand_off([planned, other], now=100.0)
    assert chosen is other
    moved = ticket.placement
    assert moved.decode.engine is other
    assert moved.ranking == [other, planned]
    assert moved.ttft_s == pytest.approx(
        placement.prefill.ttft_s
        + moved.handoff_wait_s
        + predictor.ledger(other).costs.handoff_s(2000)
    )
    assert moved.handoff_wait_s < handoff_wait_s(
        handoff_decode(placement, [planned], predictor.ledger, 100.0)[0], 0.0
    )
    for ledger, held in ((predictor.ledger(planned), 0), (predictor.ledger(other), 1)):
        assert ledger.handoffs_due == held
        assert ledger.claimed_tokens == 2000 * held
    assert "tandem_router_handoffs_moved_total 1.0" in metrics.render().decode()
    ticket.prefilled(handed_off=True, seconds=0.06)
    ticket.first_byte(other, now=100.3, upstream_start=100.0, prefill_done=100.06)
    assert predictor.ledger(other).handoffs_due == 0
    assert predictor.ledger(other).streams == 1
    ticket.finished(output_tokens=51, last_event=101.0)
    # what it observed is scored against the plan as carried out, on the engine it ran on
    text = metrics.render().decode()
    assert 'tandem_router_prediction_error_ratio_count{quantity="ttft"} 1.0' in text
    assert predictor.ledger(other).costs.step.samples == 1


def test_a_handoff_stays_on_its_engine_when_no_other_is_healthy() -> None:
    case = handed_off_between_two(RouterMetrics())
    predictor, planned, other = case.predictor, case.planned, case.other
    placement, ticket, inputs = case.placement, case.ticket, case.inputs
    behind(predictor.ledger(planned), 16000)
    assert ticket.hand_off([planned], now=100.0) is planned  # the other one went away
    assert handoff_decode(placement, [], predictor.ledger, 100.0) is None
    assert ticket.hand_off([], now=100.0) is planned  # none healthy: the plan's, to be retried
    assert predictor.ledger(planned).handoffs_due == 1
    assert predictor.ledger(planned).claimed_tokens == 2000
    local = place([planned], [], predictor.ledger, inputs, "auto")
    local_ticket = predictor.ticket(local, case.ticket.keys, True)
    assert local_ticket.hand_off([planned, other], now=100.0) is planned  # nothing to hand off


async def test_a_long_local_prefill_waits_for_the_handoffs_sent_to_its_engine() -> None:
    """A prefill that fills a whole step's budget goes to the engine after the prompts it is
    pulling have their first token (vLLM would admit it while they pull and run it first), for
    at most its own predicted stall; a shorter one, or one with nothing pulling there, goes at
    once."""
    metrics = RouterMetrics()
    predictor = Predictor(config().scoring.predictive, metrics)
    d, p = engine("d", "decode"), engine("p", "prefill")
    target = SloTarget(5.0, 0.05, False)
    keys = length_keys(False, 100, 2000, None)
    output = predictor.lengths.predict(keys, 100)

    def ticket_of(prompt: int, prefillers: list[Engine]) -> Ticket:
        inputs = PlacementInputs(
            prompt, 16, {}, output, target, 0.5, 0.3, 1000.0, 1e6, 1000.0, time.monotonic()
        )
        placement = place([d], prefillers, predictor.ledger, inputs, "auto")
        ticket = predictor.ticket(placement, keys, True)
        predictor.settle()  # as the proxy once it has sent the request
        return ticket

    ledger = predictor.ledger(d)

    def handed_off_ticket() -> Ticket:
        backlog = ledger.queue_work(time.monotonic(), 30000, 0.0)
        ticket = ticket_of(2000, [p])
        ledger.queue.withdraw(backlog)  # the backlog that made it P/D is gone
        assert ticket.placement.prefill is not None
        return ticket

    handed_off = handed_off_ticket()
    # predicted to meet its 5 s: its deadline is one a long local prefill on d would weigh
    deadline = handed_off.placement.inputs.now + 5.0
    assert ledger.handoff_deadlines == {id(handed_off): deadline}
    await ticket_of(20000, []).behind_pulls()  # nothing sent to d yet: at once
    assert handed_off.hand_off([d], time.monotonic()) is d
    assert not ledger.handoff_deadlines  # it pulls: the hold, not its deadline, protects it
    handed_off.prefilled(handed_off=True, seconds=0.05)
    assert ledger.handoffs_pulling == 1
    await asyncio.wait_for(ticket_of(4000, []).behind_pulls(), 0.05)  # under one step: at once
    long_local = ticket_of(20000, [])
    assert long_local.placement.prefill is None
    held = asyncio.create_task(long_local.behind_pulls())
    await asyncio.sleep(0.05)
    assert not held.done()
    handed_off.first_byte(d, time.monotonic(), time.monotonic() - 0.1, time.monotonic() - 0.01)
    await asyncio.wait_for(held, 0.05)
    assert ledger.handoffs_pulling == 0
    assert "tandem_router_local_prefills_held_total 1.0" in metrics.render().decode()
    # a handoff that never lands holds it no longer than the stall it would impose
    stuck = handed_off_ticket()
    stuck.hand_off([d], time.monotonic())
    bounded = ticket_of(20000, [])
    started = time.monotonic()
    await bounded.behind_pulls()
    assert time.monotonic() - started == pytest.approx(
        min(bounded.placement.decode.stall_s, MAX_HOLD_S), abs=0.05
    )
    stuck.finished(None, None)
    assert ledger.pulls_landed.is_set()


def test_a_short_answer_teaches_and_scores_no_tpot() -> None:
    """Three tokens whose events came in one read: a TPOT near zero is not a step's cost."""
    metrics = RouterMetrics()
    predictor = Predictor(PredictiveConfig(), metrics)
    d = engine("d", "decode")
    keys = length_keys(False, 3, 500, None)
    output = predictor.lengths.predict(keys, 3)
    target = SloTarget(0.2, 0.05, False)
    inputs = PlacementInputs(500, 16, {}, output, target, 0.5, 0.3, 1000.0, 1e6, 1000.0, 100.0)
    placement = place([d], [], predictor.ledger, inputs, "auto")
    step = predictor.ledger(d).costs.step_s(1, 500)
    ticket = predictor.ticket(placement, keys, True)
    ticket.first_byte(d, now=10.1, upstream_start=10.0, prefill_done=None)
    ticket.finished(output_tokens=MIN_TPOT_TOKENS - 1, last_event=10.1 + 1e-5)
    assert predictor.ledger(d).costs.step_s(1, 500) == step
    text = metrics.render().decode()
    assert 'prediction_error_ratio_count{quantity="tpot"}' not in text
    assert 'prediction_error_ratio_count{quantity="output_tokens"} 1.0' in text


def test_ticket_of_an_abandoned_request_gives_back_its_queue() -> None:
    predictor = Predictor(PredictiveConfig(), RouterMetrics())
    d, p = engine("d", "decode"), engine("p", "prefill")
    behind(predictor.ledger(d), 8000)
    keys = length_keys(False, 100, 2000, None)
    output = predictor.lengths.predict(keys, 100)
    target = SloTarget(0.2, 0.05, False)
    inputs = PlacementInputs(2000, 16, {}, output, target, 0.5, 0.3, 1000.0, 1e6, 1000.0, 100.0)
    placement = place([d], [p], predictor.ledger, inputs, "auto")
    assert placement.prefill is not None
    ticket = predictor.ticket(placement, keys, True)
    assert predictor.ledger(p).queue.tokens == 2000
    ticket.prefilled(handed_off=True, seconds=0.05)
    assert predictor.ledger(d).claimed_tokens == 2000  # the pull onto d has not happened yet
    assert predictor.ledger(d).handoffs_due == 1
    ticket.finished(None, None)
    assert predictor.ledger(p).queue.tokens == 0
    assert predictor.ledger(d).claimed_tokens == 0
    assert predictor.ledger(d).handoffs_due == 0
    ticket.finished(None, None)  # a second end gives nothing back twice
    assert predictor.ledger(d).handoffs_due == 0


async def test_admission_serves_a_level_by_deadline() -> None:
    admission = Admission(max_in_flight=1, max_queue=8)
    await admission.acquire(0)
    order: list[str] = []

    async def wait(name: str, deadline: float) -> None:
        await admission.acquire(0, deadline)
        order.append(name)
        admission.release()

    tasks = [
        asyncio.create_task(wait(n, t)) for n, t in (("late", 9.0), ("soon", 1.0), ("mid", 5.0))
    ]
    await asyncio.sleep(0)
    admission.release()
    await asyncio.gather(*tasks)
    assert order == ["soon", "mid", "late"]


def test_completion_tokens_of_a_whole_answer() -> None:
    body = b'{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens": 37,"total_tokens":49}}'
    assert completion_tokens(body) == 37
    assert completion_tokens(b'{"choices":[]}') is None


def test_a_long_prompt_is_held_past_the_step_that_ends_the_short_one_before_it() -> None:
    """vLLM fills a step's budget from what waits when it starts: a long prompt sent now would
    share the next step with the short prompt that step ends, and delay its first token by its
    own chunk. It is held to halfway through that step instead, and pays one step's fixed time;
    a short prompt, whose chunk costs that step less than the step's own length, is sent at
    once."""
    _, ledger_of = ledger_table()
    d = engine("d", "decode")
    ledger = ledger_of(d)
    ledger.queue_work(99.9, 8000, 0.0)  # its step in flight: 99.9 to 100.105
    ledger.queue_work(99.95, 100, 0.0)  # the next step is its last
    fixed = ledger.queue.pace * ledger.queue.seeds.fixed(0.0, 0.0)
    step = ledger.queue.last_step(100.0, 0.0, 0.0)
    assert step is not None
    long = place([d], [], ledger_of, inputs_for(6000, ttft_ms=2000), "never")
    assert long.hold_s == pytest.approx(step[0] + step[1] / 2 - 100.0)
    assert 0.105 < long.hold_s < 0.12
    assert long.decode.step_delay_s == 0.0
    unheld = ledger.backlog_s(100.0) + ledger.prefill_s(6000, 6000 * 3000, long.decode.load)
    assert long.ttft_s == pytest.approx(unheld + fixed)
    short = place([d], [], ledger_of, inputs_for(50, ttft_ms=2000), "never")
    assert short.hold_s == 0.0
    assert short.decode.step_delay_s > 0.0


def test_a_held_request_waits_out_its_hold_and_is_judged_from_its_placement() -> None:
    """The ticket waits out the placement's hold, counts it, and its TTFT error compares the
    prediction, made at placement, with the time since then: the hold and the upstream part."""

    async def scenario() -> None:
        metrics = RouterMetrics()
        predictor = Predictor(PredictiveConfig(), metrics)
        d = engine("d", "decode")
        ledger = predictor.ledger(d)
        now = time.monotonic()
        ledger.queue_work(now - 0.01, 8000, 0.0)  # a step in flight
        ledger.queue_work(now - 0.005, 100, 0.0)  # the next one ends it
        target = SloTarget(5.0, 0.05, False)
        keys = length_keys(False, 100, 6000, None)
        output = predictor.lengths.predict(keys, 100)
        inputs = PlacementInputs(6000, 16, {}, output, target, 0.5, 0.3, 1000.0, 1e6, 1000.0, now)
        placement = place([d], [], predictor.ledger, inputs, "never")
        assert placement.hold_s > 0.0
        ticket = predictor.ticket(placement, keys, True)
        started = time.perf_counter()
        held = await ticket.past_the_shared_step()
        assert time.perf_counter() - started >= placement.hold_s
        assert held == pytest.approx(placement.hold_s, abs=0.05)
        assert "tandem_router_prefills_held_for_step_total 1.0" in metrics.render().decode()
        upstream = time.monotonic()
        observed = placement.ttft_s - held  # as predicted, from the placement
        ticket.first_byte(d, upstream + observed, upstream, None)
        ticket.finished(1, upstream + observed)
        (error,) = (
            float(line.rsplit(" ", 1)[1])
            for line in metrics.render().decode().splitlines()
            if line.startswith('tandem_router_prediction_error_ratio_sum{quantity="ttft"}')
        )
        assert error == pytest.approx(0.0, abs=1e-9)  # without the hold: held / observed

    asyncio.run(scenario())
