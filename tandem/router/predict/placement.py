"""Predictive placement: the pick among a request's candidates (their predictions: `candidate.py`),
P/D by prediction (`disaggregation.py`), probes and shedding. In the terms of `candidate.py`:

  pick     = among candidates whose P(TTFT ≤ T_ttft) (0 on a KV overflow) ≥ min(best - 0.05,
             q), the lowest cost (ties to the higher rendezvous weight of the first block, which
             every replica shares; q = `meetProbability`): every candidate likely to meet the
             TTFT target counts as meeting it and the cost decides among them (a cache hit
             lowers its TTFT and its stall); the TTFT probability ranks candidates only where
             none is likely to meet, the most likely first. P(meet)'s TPOT factor ranks none:
             the TPOT prediction ranks what a new stream will see poorly (rank correlation
             0.1-0.3 against the observed TPOT on the Mooncake trace, the TTFT prediction's
             0.7-0.9), and a pick ranked by it took cache hits away from engines whose recent
             prefills (the same conversation's last turn) raised their predicted TPOT. The TPOT
             stays in the cost (L · TPOT: the engine's prefill share there spreads prefills),
             in P(meet) for shedding, and in the P/D decode engine's choice
  cached   = of the candidates over the same bar whose TTFT ≤ r · TTFT(pick) (r =
             CACHE_TTFT_RATIO, 1.5), the one with the fewest uncached tokens (ties as in the
             pick); the pick itself unless one holds more of the prompt. The costs are
             predictions whose TTFT is off by 20-30% (MAPE), so two TTFTs within 1.5x of each
             other may be either way round, while the compute a hit saves is saved for sure
             (docs/router.md, "A cache hit near the pick")
  unknown pace: a prefill engine not yet observed (its prefill model still the seed) takes one
    request at a time in mode auto: until a prefill there has answered (and taught its pace) it
    is no P/D candidate while another is open, so a burst that arrives before the first answer
    is not sent whole to an engine judged on its seed alone.
  re-probe: an engine is learned only from the work placed on it, so one judged slow would never
    be corrected; an engine is due (`due_for_probe`) when it is idle in every figure the router
    has (none of its prefill work open, nothing waiting or decoding there) and has been sent no
    request for `reprobeSeconds` since its last one (one never sent anything is tried on its
    seeds). A due decode candidate is the pick (before P(meet) and cost); in mode auto a due
    prefill engine takes the request's prefill (P/D) whatever the P/D decision
    (`disaggregation.py`) says. At most one request per engine per interval is placed against
    the prediction, and only on an engine with nothing to delay.
  shed ⇔ the class is sheddable, P(meet) of the chosen placement < q and it is no probe.
  decided without a prediction: one decode candidate, no prefill engine it could hand off from
    (none, mode never, n > 1 or the candidate colocated), a class that is never shed, and
    nothing of this router's prefilling or pulling on the engine (no hold, no wait behind a
    pull): whatever the prediction says, the request goes there at once (`decided_alone`). Its
    predictions are still made, for its ticket's share of the ledgers and its errors, but once
    it has been sent (`Predictor.ticket`), not on its way to the engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from tandem.router.engines import Engine
from tandem.router.predict.candidate import (
    Candidate,
    Placement,
    PlacementInputs,
    PrefillPick,
    decode_candidate,
    prefill_pick,
)
from tandem.router.predict.disaggregation import disaggregate, pd_decode
from tandem.router.predict.ledger import EngineLedger
from tandem.router.predict.slo import SloTarget, meet_probability
from tandem.router.rendezvous import weight

CLOSE_ENOUGH = 0.05  # P(meet) this close to the best's counts as equally likely
CACHE_TTFT_RATIO = 1.5  # a candidate holding more of the prompt is taken this close in TTFT


def due_for_probe(engine: Engine, ledger: EngineLedger, now: float, reprobe_s: float) -> bool:
    """The re-probe rule (module docstring): reprobe_s > 0, the engine idle (no prefill work of
    this router open there, nothing waiting, no stream) and sent nothing for reprobe_s since
    it was last sent something (an engine never sent anything is tried on its seeds)."""
    if reprobe_s <= 0.0 or ledger.queue.open or engine.waiting > 0 or engine.streams():
        return False
    return ledger.last_placed is not None and now - ledger.last_placed >= reprobe_s


def decided_alone(
    decoders: Sequence[Engine],
    prefillers: Sequence[Engine],
    ledger_of: Callable[[Engine], EngineLedger],
    target: SloTarget,
    disaggregation: str,
) -> bool:
    """Whether `place` can only send the request to `decoders[0]`, local, at once and not shed,
    whatever it predicts (module docstring: decided without a prediction)."""
    if len(decoders) != 1 or target.sheddable:
        return False
    engine = decoders[0]
    if may_disaggregate(engine, prefillers, disaggregation):
        return False
    ledger = ledger_of(engine)
    return not ledger.queue.open and not ledger.handoffs_pulling


def may_disaggregate(engine: Engine, prefillers: Sequence[Engine], disaggregation: str) -> bool:
    """Whether a request local on decode candidate `engine` could have its prefill on one of
    `prefillers` instead: some to use, mode not "never", and `engine` not colocated (one of the
    decode pool, which a handoff can reach)."""
    return bool(prefillers) and disaggregation != "never" and not engine.colocated


def meet_bar(candidates: Sequence[Candidate], q: float) -> float:
    """min(best P(TTFT ≤ T_ttft) - 0.05, q): what a candidate's P(TTFT ≤ T_ttft) must reach for
    it to be weighed by its cost."""
    return min(max(c.ttft_meet for c in candidates) - CLOSE_ENOUGH, q)


def _pick(candidates: Sequence[Candidate], first_block_key: int | None, bar: float) -> Candidate:
    chosen: Candidate | None = None
    for candidate in candidates:
        if candidate.ttft_meet < bar:
            continue
        if chosen is None or _cheaper(candidate, chosen, first_block_key):
            chosen = candidate
    assert chosen is not None
    return chosen


def _most_cached_near(
    candidates: Sequence[Candidate], pick: Candidate, bar: float, first_block_key: int | None
) -> Candidate:
    """The cached rule (module docstring): of the candidates over `bar` predicted within
    CACHE_TTFT_RATIO of `pick`'s TTFT, the one with the fewest uncached tokens (ties as in the
    pick: `_cheaper`); `pick` unless one holds more of the prompt."""
    chosen = pick
    limit = CACHE_TTFT_RATIO * pick.ttft_s
    for candidate in candidates:
        if candidate.ttft_meet < bar or candidate.ttft_s > limit:
            continue
        own, held = candidate.own.tokens, chosen.own.tokens
        if own < held or (own == held and _cheaper(candidate, chosen, first_block_key)):
            chosen = candidate
    return chosen


def _cheaper(candidate: Candidate, chosen: Candidate, first_block_key: int | None) -> bool:
    """Whether `candidate` costs less than `chosen`, or as much with the higher rendezvous
    weight of the first block (without one, `chosen` keeps it): the same on every replica."""
    if candidate.cost != chosen.cost:
        return candidate.cost < chosen.cost
    if first_block_key is None:
        return False
    return weight(first_block_key, candidate.engine.id) > weight(first_block_key, chosen.engine.id)


def pace_unknown_and_tried(ledger: EngineLedger) -> bool:
    """The unknown-pace rule (module docstring): never observed, and a request already open."""
    return ledger.costs.prefill.samples == 0 and ledger.prefills_open > 0


def _best_prefill(
    prefillers: Sequence[Engine],
    ledger_of: Callable[[Engine], EngineLedger],
    inputs: PlacementInputs,
    trying_allowed: bool,
) -> tuple[PrefillPick | None, bool]:
    """The prefill engine of lowest predicted TTFT, or the first one due for a probe (then True);
    unless `trying_allowed`, engines of unknown pace with a request open are left out (None when
    that leaves none)."""
    best: PrefillPick | None = None
    for engine in prefillers:
        ledger = ledger_of(engine)
        if due_for_probe(engine, ledger, inputs.now, inputs.reprobe_s):
            return prefill_pick(engine, ledger, inputs), True
        if not trying_allowed and pace_unknown_and_tried(ledger):
            continue
        pick = prefill_pick(engine, ledger, inputs)
        if best is None or pick.ttft_s < best.ttft_s:
            best = pick
    return best, False


def chosen_first(chosen: Engine, engines: Sequence[Engine]) -> list[Engine]:
    """`engines` in their order with `chosen` moved to the front (added when absent)."""
    return [chosen, *(e for e in engines if e is not chosen)]


def place(
    decoders: Sequence[Engine],
    prefillers: Sequence[Engine],
    ledger_of: Callable[[Engine], EngineLedger],
    inputs: PlacementInputs,
    disaggregation: str,
) -> Placement:
    """The placement of one request (module docstring); `decoders` is never empty.

    disaggregation: "auto" decides by prediction, "always" disaggregates whenever it can, "never"
    (or no prefill engine to use: none healthy, n > 1) stays local.
    """
    candidates = [decode_candidate(engine, ledger_of(engine), inputs) for engine in decoders]
    probed = next(
        (c for c in candidates if due_for_probe(c.engine, c.ledger, inputs.now, inputs.reprobe_s)),
        None,
    )
    bar = meet_bar(candidates, inputs.meet_threshold)
    first_block_key = inputs.first_block_key
    local = probed or _most_cached_near(
        candidates, _pick(candidates, first_block_key, bar), bar, first_block_key
    )
    target = inputs.target
    q = inputs.meet_threshold
    chosen, prefill, ttft, meet, wait = local, None, local.ttft_s, local.meet, 0.0
    probe = False
    always = disaggregation == "always"
    if may_disaggregate(local.engine, prefillers, disaggregation):
        pick, probe = _best_prefill(prefillers, ledger_of, inputs, trying_allowed=always)
    else:
        pick = None
    if pick is not None:
        separate = [c for c in candidates if not c.engine.colocated]
        decode, pd_wait, pd_ttft = pd_decode(separate, pick.ttft_s, inputs)
        ledger = decode.ledger
        pd_ttft_meet = meet_probability(pd_ttft, target.ttft_s, ledger.ttft_sigma())
        if always or probe or disaggregate(local, pick, pd_ttft, pd_ttft_meet, inputs):
            tpot_meet = meet_probability(decode.tpot_s, target.tpot_s, ledger.tpot_sigma())
            chosen, prefill, ttft, meet = decode, pick, pd_ttft, pd_ttft_meet * tpot_meet
            wait = pd_wait
    return Placement(
        chosen,
        prefill,
        ttft,
        wait,
        meet,
        target.sheddable and meet < q and probed is None and not probe,
        chosen_first(chosen.engine, decoders),
        chosen_first(prefill.engine, prefillers) if prefill is not None else [],
        tuple(candidates),
        bar,
        inputs,
    )


def retry_after_s(placement: Placement, target: SloTarget) -> int:
    """For a shed request: the predicted TTFT's excess over the target, in whole seconds (1-60)."""
    excess = placement.ttft_s - target.ttft_s
    return int(min(60, max(1, math.ceil(excess))))
