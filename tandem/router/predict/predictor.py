"""The predictive policy's state at the edge of the router: per-engine ledgers, the output-length
model, and the tickets through which the proxy reports what happened to each request.

A `Ticket` holds what the plan predicted and what it added to the ledgers, and takes it back as
the request moves on (prefill answered, first byte, end); when the request ends, after its answer
has left, each observation goes to the model that predicted it, but for the P/D prefill's, which
teaches the prefill engine's model when the prefill answers (an engine of unknown pace waits on
it: `placement.pace_unknown_and_tried`):

    placed                  -> both engines' last placement time (the re-probe rule)
    placed, local           -> the decode engine's prefill share and stall clock: + its
                               predicted stall
    placed, P/D             -> the decode engine's handoffs due: + 1, until the first byte
                               (or the end of a request that never had one)
    P/D prefill answered    -> the decode engine chosen again (`hand_off`); its handoffs
                               pulling: + 1, until the first byte (or the end)
    sent local              -> waits for the handoffs pulling on its engine (`behind_pulls`)
    first byte              -> a stream on the decode engine, with slack
                               max(L - 1, 1) · (T_tpot - step_s(own streams + 1, their tokens))
    P/D prefill answered    -> prefill model of the prefill engine: (own work, prefill s)
    first byte, local       -> prefill model of the decode engine: (own work, upstream s)
                               (both only when nothing was ahead of it: none of this router's
                               prefills open there, none of other routers' seen waiting; a
                               sample of the engine's pace, not of how a queue drained)
    first byte, P/D         -> handoff model of the decode engine: (prompt tokens, handoff s),
                               when none of this router's prefills was open on it as the
                               handoff started (a wait behind them is not the handoff's cost)
    end of a stream         -> step model of the decode engine: (streams + 1, context + its
                               tokens, TPOT · (1 - min(share, 0.7))), with TPOT = (last event -
                               first byte) / (output events - 1) and share the prefill share its
                               prediction was slowed by (the step itself, as the model predicts it);
                               answers of fewer than MIN_TPOT_TOKENS events give no TPOT sample
                            -> output-length model: the stream's output events
    every TTFT and TPOT     -> sigma² ← sigma² + 0.05 · (ln(observed / predicted)² - sigma²) of its engine,
                               and |observed - predicted| / observed into
                               tandem_router_prediction_error_ratio{quantity}: ttft (upstream
                               part), prefill (P/D prefill), tpot, output_tokens (the median)
                               and output_tokens_mean (the running mean: the baseline)

The `placed` lines are taken at `Predictor.settle`, as of the placement time: the proxy schedules
it as the ticket is made, so it runs when the request's task first waits, which on a pooled
connection is once its upstream request is written, off its way to its first token; every reader
of a ledger (a plan, `Predictor.ledger`, each ticket's methods) settles first, so no plan misses
a placement. A plan that no prediction could change (`placement.decided_alone`: one decode
engine, nothing to weigh it against) is sent before its predictions are made: its ticket
(`Predictor.ticket`) makes them at the settle that takes its share, with the ledgers (and the
engine's figures: no first byte or scrape has come yet) as they were when it was planned.

The TTFT predicted and observed is the upstream part (first upstream request → first byte): the
router's own queue and scheduling come before it. A non-streaming answer's first byte comes with
its last, so it teaches only the P/D prefill model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from tandem.common.routing import PredictiveConfig
from tandem.router.engines import Engine
from tandem.router.metrics import RouterMetrics
from tandem.router.predict.candidate import MAX_SHARE, Placement, PrefillPick, stream_slack_s
from tandem.router.predict.cost_model import EngineCosts
from tandem.router.predict.disaggregation import fills_step_budget, handoff_decode
from tandem.router.predict.ledger import EngineLedger
from tandem.router.predict.output_length import LengthKeys, OutputLengthModel
from tandem.router.predict.placement import chosen_first
from tandem.router.predict.prefill_queue import QueuedPrefill

log = logging.getLogger(__name__)

MEAN_WEIGHT = 0.02  # the running means of request sizes: a window of about 50 requests
# An answer of fewer tokens teaches and scores no TPOT: one or two gaps are mostly jitter, and a
# short answer whose events arrive in one read shows a TPOT near zero (an error of ~100 %).
MIN_TPOT_TOKENS = 4
MAX_HOLD_S = 1.0  # the longest a local prefill waits for the handoffs sent to its engine


class Predictor:
    def __init__(self, config: PredictiveConfig, metrics: RouterMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.lengths = OutputLengthModel()
        self.ledgers: dict[str, EngineLedger] = {}
        self._unsettled: list[Ticket] = []  # tickets whose share of the ledgers is not taken yet
        self._errors: dict[str, Any] = {}  # the error histogram's child of each quantity
        self.mean_uncached_tokens = 512.0
        self.mean_uncached_pairs = 512.0 * 256.0
        self.mean_stream_tokens = 1024.0
        self._prefill_seed = (
            config.prefill_base_ms * 1e-3,
            config.prefill_ms_per_kilo_token * 1e-3,
            config.prefill_ms_per_mega_pair * 1e-3,
        )
        self._handoff_seed = (
            config.handoff_base_ms * 1e-3,
            config.handoff_ms_per_kilo_token * 1e-3,
        )
        self._step_seed = (
            config.step_base_ms * 1e-3,
            config.step_ms_per_stream * 1e-3,
            config.step_ms_per_kilo_context * 1e-3,
        )

    def ledger(self, engine: Engine) -> EngineLedger:
        """The engine's ledger, with every ticket's share in it (`settle`)."""
        self.settle()
        ledger = self.ledgers.get(engine.id)
        if ledger is None:
            config = self.config
            costs = EngineCosts(
                self._prefill_seed,
                self._handoff_seed,
                self._step_seed,
                config.forget,
                config.chunk_tokens(engine.prefill_only),
            )
            ledger = self.ledgers[engine.id] = EngineLedger(
                costs, self.config.interference_window_seconds
            )
        return ledger

    def forget(self, engine_id: str) -> None:
        self.ledgers.pop(engine_id, None)

    def ticket(
        self, placement: Placement | Callable[[], Placement], keys: LengthKeys, streaming: bool
    ) -> Ticket:
        """The ticket of a request placed as `placement` says; its share of the ledgers is taken
        at the next `settle`, as of its placement time (module docstring).

        Or of a request whose placement was decided without its predictions
        (`placement.decided_alone`): `placement()` makes them at that settle, in placement
        order, so with the ledgers as they were when it was planned (nothing reads a ledger
        without settling first). The caller schedules the settle for when the request has been
        sent and before its first byte, as for every ticket: the engine's own figures are then
        those of the plan too."""
        ticket = Ticket(self, keys, streaming)
        if callable(placement):
            ticket.place_later = placement
        else:
            ticket.placed(placement)
        self._unsettled.append(ticket)
        return ticket

    def settle(self) -> None:
        """Takes every new ticket's share of the ledgers and the size means, in placement order."""
        if self._unsettled:
            tickets, self._unsettled = self._unsettled, []
            for ticket in tickets:
                ticket.take_share()

    def observe_error(self, quantity: str, predicted: float, observed: float) -> float | None:
        """Records |observed - predicted| / observed; returns ln(observed / predicted), None
        when either is not positive (nothing to learn from)."""
        if observed <= 0.0 or predicted <= 0.0:
            return None
        errors = self._errors.get(quantity)
        if errors is None:
            metrics = self.metrics
            errors = self._errors[quantity] = metrics.child(metrics.prediction_error, quantity)
        errors.observe(abs(observed - predicted) / observed)
        return math.log(observed / predicted)


def prefill_model(ledger: EngineLedger) -> dict[str, float]:
    """An engine's prefill model: its fixed part a (ms), scale κ and queue pace κ_q."""
    fixed, scale = ledger.costs.prefill.theta
    return {
        "fixed_ms": round(fixed * 1e3, 3),
        "scale": round(scale, 3),
        "pace": round(ledger.queue.pace, 3),
    }


def observed_tpot_s(
    first_byte: float | None, last_event: float | None, output_tokens: int | None
) -> float | None:
    """(last event - first byte) / (output events - 1), the TPOT the router learns from and
    scores; None without both clock readings, below MIN_TPOT_TOKENS events, or when every event
    came at once."""
    if (
        first_byte is None
        or last_event is None
        or output_tokens is None
        or output_tokens < MIN_TPOT_TOKENS
        or last_event <= first_byte
    ):
        return None
    return (last_event - first_byte) / (output_tokens - 1)


class Ticket:
    """One request's predictions and its share of the ledgers (module docstring). The ledgers
    change as the request moves on; the models learn only at `finished`, after the answer has
    left, so no fit runs on a request's way to its first token."""

    __slots__ = (
        "_alone",
        "_at",
        "_first_byte",
        "_first_engine",
        "_handoff_clean",
        "_handoff_due",
        "_handoff_load",
        "_held_s",
        "_kv_claim",
        "_placed_at",
        "_prefill_done",
        "_prefill_s",
        "_prefilled_on",
        "_pulling",
        "_queued",
        "_queued_on",
        "_slack_key",
        "_stream_on",
        "_stream_tokens",
        "_upstream_start",
        "keys",
        "output",
        "place_later",
        "placement",
        "predictor",
        "prompt_tokens",
        "streaming",
        "target",
    )

    def __init__(self, predictor: Predictor, keys: LengthKeys, streaming: bool) -> None:
        """A ticket whose placement comes next: `placed`, or `place_later` (made at `settle`)."""
        self.predictor = predictor
        self.keys = keys
        self.streaming = streaming
        self.place_later: Callable[[], Placement] | None = None
        self._queued_on: EngineLedger | None = None
        self._prefilled_on: EngineLedger | None = None
        self._queued: QueuedPrefill | None = None
        self._kv_claim = 0.0
        self._handoff_due = False
        self._pulling = False  # sent to the decode engine, no first byte yet
        self._stream_on: EngineLedger | None = None
        self._slack_key = 0.0
        self._prefill_s: float | None = None
        self._first_byte: float | None = None
        self._first_engine: Engine | None = None
        self._upstream_start: float | None = None
        self._prefill_done: float | None = None
        self._handoff_clean = False
        self._alone = False  # nothing of this router's was placed behind it on its engine
        self._held_s = 0.0  # the hold it waited out before its first upstream request
        self._placed_at = time.perf_counter()

    def placed(self, placement: Placement) -> None:
        """The request's placement and the predictions it was made with."""
        inputs = placement.inputs
        self.placement = placement
        self.prompt_tokens = inputs.prompt_tokens
        self.output = output = inputs.output
        self.target = inputs.target
        self._at = inputs.now
        self._stream_tokens = inputs.prompt_tokens + output.median * 0.5
        self._handoff_load = placement.decode.load  # the decode engine's as the handoff starts

    def take_share(self) -> None:
        """Adds the request, as placed at its placement time, to its engines' ledgers (the
        module docstring's `placed` lines) and to the predictor's size means; a ticket made by
        `Predictor.ticket` with a placement to make is placed first."""
        if self.place_later is not None:
            self.placed(self.place_later())
            self.place_later = None
        predictor, placement, now = self.predictor, self.placement, self._at
        work = placement.prefill_work
        predictor.mean_uncached_tokens += MEAN_WEIGHT * (
            work.tokens - predictor.mean_uncached_tokens
        )
        predictor.mean_uncached_pairs += MEAN_WEIGHT * (work.pairs - predictor.mean_uncached_pairs)
        decode, queued_on = placement.decode.ledger, placement.prefill_ledger
        decode.last_placed = queued_on.last_placed = now
        decode.joined(now)
        if placement.prefill is None:
            decode.add_prefill(now, placement.decode.stall_s)
        else:
            queued_on.joined(now)
        self._queued_on = self._prefilled_on = queued_on
        queued_on.prefills_open += 1
        self._queued = queued_on.queue_work(now, work.tokens, work.pairs, now + placement.hold_s)
        self._claim_decode()

    def _release_queue(self, *, computed: bool) -> None:
        queued_on, queued = self._queued_on, self._queued
        if queued_on is not None and queued is not None:
            self._alone = queued_on.queue.last(queued)
            queued_on.work_done(time.monotonic(), queued, computed=computed)
            self._queued_on = None

    def _claim_decode(self) -> None:
        """The decode engine waits for this request's prompt: its KV and, after a P/D prefill,
        its handoff (with its deadline while it prefills elsewhere predicted to meet it)."""
        placement = self.placement
        decode = placement.decode
        self._kv_claim = decode.own.tokens
        decode.ledger.claim(self._kv_claim)
        self._handoff_due = placement.prefill is not None
        decode.ledger.handoffs_due += self._handoff_due
        if self._handoff_due and not self._pulling and placement.ttft_s <= self.target.ttft_s:
            decode.ledger.handoff_deadlines[id(self)] = placement.inputs.now + self.target.ttft_s

    def _release_decode_claim(self) -> None:
        """The decode engine no longer waits for this request's prompt: its KV and, after a P/D
        prefill, its handoff."""
        ledger = self.placement.decode.ledger
        if self._kv_claim:
            ledger.unclaim(self._kv_claim)
            self._kv_claim = 0.0
        if self._handoff_due:
            ledger.handoffs_due -= 1
            ledger.handoff_deadlines.pop(id(self), None)
            self._handoff_due = False
        if self._pulling:
            ledger.pull_landed()
            self._pulling = False

    def hand_off(self, healthy: Sequence[Engine], now: float) -> Engine:
        """The P/D prefill handed off its KV at `now`: the decode engine to pull it, chosen again
        among the `healthy` ones (`disaggregation.handoff_decode`). When that is another engine
        than planned, the plan's decode part, handoff wait and TTFT become that engine's (its
        prefill part as predicted), and what the request holds of the decode engine moves there."""
        self.predictor.settle()
        placement = self.placement
        prefill = placement.prefill
        if prefill is None:
            return placement.decode.engine
        self._release_decode_claim()  # its own claim is no load of the engines it weighs
        chosen = handoff_decode(placement, healthy, self.predictor.ledger, now)
        if chosen is not None:
            self._handoff_load = chosen[0].load
        if chosen is not None and chosen[0].engine is not placement.decode.engine:
            decode, wait, handoff_ttft = chosen
            self.placement = placement = replace(
                placement,
                decode=decode,
                handoff_wait_s=wait,
                ttft_s=prefill.ttft_s + handoff_ttft,
                ranking=chosen_first(decode.engine, placement.ranking),
            )
            decode.ledger.joined(now)
            self.predictor.metrics.handoffs_moved.inc()
        self._pulling = True
        self._claim_decode()
        placement.decode.ledger.pull_started()
        return placement.decode.engine

    async def past_the_shared_step(self) -> float:
        """Waits out the placement's hold (hold(d), `candidate.py`: the request would otherwise
        join the step that ends this router's prefills queued on its engine); returns the
        seconds it waited, which its observed TTFT includes from then on."""
        hold = self.placement.hold_s
        if hold <= 0.0:
            return 0.0
        self.predictor.metrics.step_holds.inc()
        started = time.perf_counter()
        await asyncio.sleep(hold)
        self._held_s = time.perf_counter() - started
        return self._held_s

    async def behind_pulls(self) -> None:
        """A local prefill that fills a whole step's token budget (its uncached tokens at least
        the chunk size C) waits for the handoffs already sent to its engine to land, for at most
        its predicted stall: vLLM moves a pulled prompt out of the waiting queue while its KV
        arrives and admits it only in a step with budget left, so a long prefill admitted
        meanwhile would run first and hold every one of them for its whole length. Waiting w
        costs this request w; not waiting costs each of them up to the stall."""
        if self.place_later is not None:
            return  # decided alone: nothing was pulling to its engine (`placement.decided_alone`)
        decode = self.placement.decode
        ledger = decode.ledger
        if (
            self.placement.prefill is not None
            or not ledger.handoffs_pulling
            or not fills_step_budget(decode)
        ):
            return
        self.predictor.metrics.prefills_held.inc()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ledger.pulls_landed.wait(), min(decode.stall_s, MAX_HOLD_S))

    def prefilled(self, handed_off: bool, seconds: float | None) -> None:
        """The P/D prefill answered (`handed_off`: with a KV handoff the decode engine will pull).

        Its time teaches the prefill engine's model now, not when the request ends: until an
        engine of unknown pace has been observed it takes one request at a time, and a request
        whose decode is slow would hold the whole prefill engine that long."""
        if self.place_later is not None:
            return  # decided alone: local
        prefill = self.placement.prefill
        if prefill is None:
            return
        self.predictor.settle()
        self._release_queue(computed=True)
        if handed_off:
            self._prefill_s = seconds
            # nothing of this router's is prefilling on the decode engine as the handoff starts
            self._handoff_clean = not self.placement.decode.ledger.queue.open
            if seconds is not None:
                self._learn_prefill(prefill, seconds)
        self._close_prefill()

    def _close_prefill(self) -> None:
        prefilled_on = self._prefilled_on
        if prefilled_on is not None:
            prefilled_on.prefills_open -= 1
            self._prefilled_on = None

    def predicted_ttft_s(self) -> float:
        """The TTFT its placement predicted."""
        self.predictor.settle()
        return self.placement.ttft_s

    def first_byte(
        self, engine: Engine, now: float, upstream_start: float | None, prefill_done: float | None
    ) -> None:
        """The decode engine's first body byte: the prefill is over, a stream starts on `engine`."""
        self.predictor.settle()
        placement = self.placement
        self._release_queue(
            computed=placement.prefill is None and engine is placement.decode.engine
        )
        self._release_decode_claim()
        self._first_byte = now
        self._first_engine = engine
        self._upstream_start = upstream_start
        self._prefill_done = prefill_done
        ledger = self.predictor.ledger(engine)
        step = ledger.costs.step_s(ledger.streams + 1, ledger.stream_tokens + self._stream_tokens)
        slack = stream_slack_s(self.output.median, self.target.tpot_s, step)
        self._slack_key = ledger.add_stream(self._stream_tokens, self.output.median, slack)
        self._stream_on = ledger

    def finished(self, output_tokens: int | None, last_event: float | None) -> None:
        """The request is over (answered, failed or abandoned): everything held is given back, and
        what was observed teaches the models that predicted it."""
        self.predictor.settle()  # a placement made later (`Predictor.ticket`) is made by now
        if log.isEnabledFor(logging.DEBUG):
            log.debug("prediction %s", json.dumps(self.explain(output_tokens, last_event)))
        self._release_queue(computed=False)
        self._release_decode_claim()
        self._close_prefill()
        ledger = self._stream_on
        if ledger is None:
            return
        self._stream_on = None
        ledger.end_stream(self._stream_tokens, self.output.median, self._slack_key)
        self._learn_first_byte(ledger)
        if output_tokens is not None:
            self._learn_stream(ledger, output_tokens, last_event)

    def explain(self, output_tokens: int | None, last_event: float | None) -> dict[str, Any]:
        """The predicted TTFT split into its terms beside what was observed (ms; the debug log's
        line per request): the work ahead and its own (tokens), the decode load its prefill's
        steps carry (streams, context tokens), the prefilling engine's model as it stands at the
        end (`prefill_model`), the pace its prefill was predicted at (the model's κ alone on the
        engine, else the queue's κ_q: `EngineLedger.pace`), the prefill part, the wait on the
        decode engine and the handoff after a P/D prefill, the hold before it is sent
        (`hold_ms`, hold(d) in `candidate.py`), and the observed wait from the plan to the first
        upstream request, upstream TTFT, P/D prefill, handoff and TPOT, the clock readings (s) of
        the placement, the first upstream request and the first byte (a replay's arrivals), and
        every decode candidate as the pick weighed it (its uncached tokens, TTFT, TPOT, streams,
        stall, prefill share, P(meet), P(TTFT ≤ T_ttft), cost, hold, KV overflow). Observed
        figures missing from the request's path are None."""
        placement = self.placement
        decode, prefill = placement.decode, placement.prefill
        part = prefill if prefill is not None else decode
        first, start, done = self._first_byte, self._upstream_start, self._prefill_done
        tpot = observed_tpot_s(first, last_event, output_tokens)

        def ms(seconds: float | None) -> float | None:
            return None if seconds is None else round(seconds * 1e3, 3)

        return {
            "route": "local" if prefill is None else "pd",
            "meet_bar": round(placement.meet_bar, 3),
            "candidates": [
                {
                    "engine": c.engine.id,
                    "own": c.own.tokens,
                    "ttft_ms": ms(c.ttft_s),
                    "tpot_ms": ms(c.tpot_s),
                    "streams": c.streams,
                    "waiters": c.waiters,
                    "stall_ms": ms(c.stall_s),
                    "queued_ms": ms(c.queued_s),
                    "share": round(c.share, 3),
                    "meet": round(c.meet, 3),
                    "ttft_meet": round(c.ttft_meet, 3),
                    "cost_ms": ms(c.cost),
                    "hold_ms": ms(c.hold_s),
                    "overflows": c.overflows,
                }
                for c in placement.candidates
            ],
            "decode": decode.engine.id,
            "prefill": None if prefill is None else prefill.engine.id,
            "prompt": self.prompt_tokens,
            "own": part.own.tokens,
            "ahead": part.ahead.tokens,
            "backlog_ms": ms(part.backlog_s),
            "load": [part.load.streams, round(part.load.context)],
            "prefill_model": prefill_model(part.ledger),
            "prefill_pace": round(part.pace, 3),
            "through": part.through.tokens,
            "streams": decode.streams,
            "output": output_tokens,
            "ttft_ms": ms(placement.ttft_s),
            "prefill_ms": ms(part.ttft_s),
            "decode_ahead": decode.ahead.tokens,
            "decode_backlog_ms": ms(decode.backlog_s),
            "wait_ms": ms(placement.handoff_wait_s),
            "kv_wait_ms": ms(decode.kv_wait_s),
            "handoff_ms": None
            if prefill is None
            else ms(placement.ttft_s - prefill.ttft_s - placement.handoff_wait_s),
            "tpot_ms": ms(decode.tpot_s),
            "hold_ms": ms(placement.hold_s),
            "wait_obs_ms": ms(None if start is None else start - self._placed_at),
            "ttft_obs_ms": ms(None if first is None or start is None else first - start),
            "prefill_obs_ms": ms(self._prefill_s),
            "handoff_obs_ms": ms(None if first is None or done is None else first - done),
            "tpot_obs_ms": ms(tpot),
            "placed_s": self._placed_at,
            "upstream_s": start,
            "first_byte_s": first,
        }

    def _learn_prefill(self, prefill: PrefillPick, seconds: float) -> None:
        ledger = prefill.ledger
        if self._alone and prefill.ahead.tokens <= 0.0 and not prefill.open_ahead:
            own = prefill.own
            ledger.costs.observe_prefill(own.tokens, own.pairs, prefill.load, seconds)
        log_ratio = self.predictor.observe_error("prefill", prefill.ttft_s, seconds)
        if log_ratio is not None:
            ledger.learn_ttft(log_ratio)

    def _learn_first_byte(self, ledger: EngineLedger) -> None:
        placement = self.placement
        first, start = self._first_byte, self._upstream_start
        if not self.streaming or first is None or start is None:
            return  # a whole answer's first byte comes with its last
        if self._first_engine is not placement.decode.engine:
            return  # retried on another engine: not what was predicted
        observed = first - start
        local = placement.prefill is None
        if local:
            decode = placement.decode
            if self._alone and decode.ahead.tokens <= 0.0 and not decode.open_ahead:
                own = decode.own
                ledger.costs.observe_prefill(own.tokens, own.pairs, decode.load, observed)
        elif self._prefill_done is not None and self._handoff_clean:
            seconds = first - self._prefill_done
            ledger.costs.observe_handoff(self.prompt_tokens, self._handoff_load, seconds)
        # predicted from the placement: `observed` ran from the upstream request, after the hold
        log_ratio = self.predictor.observe_error("ttft", placement.ttft_s, observed + self._held_s)
        if log_ratio is not None:
            ledger.learn_ttft(log_ratio)

    def _learn_stream(
        self, ledger: EngineLedger, output_tokens: int, last_event: float | None
    ) -> None:
        predictor = self.predictor
        predictor.mean_stream_tokens += MEAN_WEIGHT * (
            self._stream_tokens - predictor.mean_stream_tokens
        )
        lengths = predictor.lengths
        predictor.observe_error("output_tokens_mean", lengths.mean_tokens, output_tokens)
        predictor.observe_error("output_tokens", self.output.median, output_tokens)
        lengths.observe(self.keys, self.output, output_tokens)
        tpot = observed_tpot_s(self._first_byte, last_event, output_tokens)
        if tpot is None:
            return
        decode = self.placement.decode
        if ledger is decode.ledger:
            # the step the prediction divided by (1 - share): the sample without that slowdown
            step = tpot * (1.0 - min(decode.share, MAX_SHARE))
            ledger.costs.observe_step(
                decode.streams + 1, decode.context + self._stream_tokens, step
            )
            log_ratio = predictor.observe_error("tpot", decode.tpot_s, tpot)
            if log_ratio is not None:
                ledger.learn_tpot(log_ratio)
