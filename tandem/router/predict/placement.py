"""Predictive placement: the predicted TTFT and TPOT of every candidate, the pick, and P/D by prediction.

For a request of P prompt tokens, its predicted output (median L, p90 L90, `output_length.py`),
its targets (T_ttft, T_tpot, `slo.py`) and block size B, with each engine's learned costs
(`cost_model.py`) and this router's record of its open work (`ledger.py`):

    ahead(e)     = queued_tokens(e) + max(waiting(e) - pending_at_scrape(e), 0) · mean uncached tokens
                   (this router's unfinished prefill work there, plus the engine's queue of other
                   routers' requests at the mean size)
    uncached(e)  = max(P - hit_blocks(e) · B, 0)
    streams(d)   = `Engine.streams()` (the router's live count, or the engine's scraped one)
    context(d)   = stream_tokens(d) + max(streams(d) - own streams(d), 0) · mean stream tokens

  local on decode engine d:
    TTFT  = prefill_s_d(ahead(d) + uncached(d))
    TPOT  = step_s_d(streams(d) + 1, context(d) + P + L / 2)
  prefill engine p, then decode engine d:
    TTFT  = prefill_s_p(ahead(p) + uncached(p)) + handoff_s_d(P)
    TPOT  = as local on d

  P(meet)  = Φ(ln(T_ttft / TTFT) / sigma_ttft) · Φ(ln(T_tpot / TPOT) / sigma_tpot)    (0 when d's KV is
             predicted to overflow: kv_usage(d) · (context(d) + its streams' remaining output +
             P + L90) / context(d) > 1, a preemption ahead)
  cost     = TTFT + L · TPOT  (the predicted end-to-end time)
  pick     = among candidates whose P(meet) ≥ best P(meet) - 0.05, the lowest cost
             (ties to the higher rendezvous weight of the first block, which every replica shares)

  P/D decision (mode auto, n = 1, a healthy prefill engine, the chosen decode engine not colocated):
    local prefill on d stalls its running streams for its uncached tokens; their TPOT becomes
      TPOT_running = step_s_d(streams(d) + 1, context(d) + P)
                     + uncached(d) · prefill_s_per_token_d / max(remaining per stream, 1)
      (remaining per stream = stream_output_tokens(d) / (2 · own streams(d)): halfway on average)
    disaggregate ⇔ P(TTFT_pd ≤ T_ttft) ≥ q and
                   (P(TTFT_local ≤ T_ttft) < q or P(TPOT_running ≤ tightest target on d) < q)
    where q = `meetProbability`, the prefill engine is the one of lowest TTFT_pd and the P/D
    decode engine the candidate of lowest TPOT. A prefill pool that is behind has a large
    ahead(p), so its TTFT_pd misses and the request stays local.
  shed ⇔ the class is sheddable and P(meet) of the chosen placement < q.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from tandem.router.engines import Engine
from tandem.router.predict.ledger import EngineLedger
from tandem.router.predict.output_length import LengthPrediction
from tandem.router.predict.slo import SloTarget, meet_probability
from tandem.router.rendezvous import weight

CLOSE_ENOUGH = 0.05  # P(meet) this close to the best's counts as equally likely


@dataclass(frozen=True, slots=True)
class PlacementInputs:
    prompt_tokens: int
    block_size: int
    hits: Mapping[str, int]
    output: LengthPrediction
    target: SloTarget
    meet_threshold: float
    mean_uncached_tokens: float  # the mean size of a request the router has not seen
    mean_stream_tokens: float
    first_block_key: int | None = None


@dataclass(slots=True)
class Candidate:
    """One decode engine's local prediction (and the figures a P/D placement on it shares)."""

    engine: Engine
    ledger: EngineLedger
    uncached: float
    ahead: float
    ttft_s: float
    tpot_s: float
    streams: float
    context: float
    meet: float
    cost: float


@dataclass(frozen=True, slots=True)
class PrefillPick:
    engine: Engine
    ledger: EngineLedger
    uncached: float
    ahead: float
    ttft_s: float  # the prefill's part, without the handoff


@dataclass(frozen=True, slots=True)
class Placement:
    decode: Candidate
    prefill: PrefillPick | None  # set when disaggregated
    ttft_s: float  # of the chosen route
    meet: float  # P(meet both) of the chosen route
    shed: bool
    ranking: list[Engine]  # decode engines, the chosen first
    prefill_ranking: list[Engine]  # prefill engines, the chosen first; empty when local

    @property
    def prefill_ledger(self) -> EngineLedger:
        """The ledger of the engine that prefills: the prefill engine's, else the decode one's."""
        return self.prefill.ledger if self.prefill else self.decode.ledger

    @property
    def prefill_tokens(self) -> float:
        """The uncached tokens the prefilling engine computes."""
        return self.prefill.uncached if self.prefill else self.decode.uncached


def ahead_tokens(engine: Engine, ledger: EngineLedger, mean_uncached_tokens: float) -> float:
    """ahead(e) (module docstring)."""
    others = engine.waiting - engine.pending_at_scrape
    return ledger.queued_tokens + (others * mean_uncached_tokens if others > 0 else 0.0)


def uncached_tokens(engine: Engine, inputs: PlacementInputs) -> float:
    """uncached(e) = max(P - hit_blocks(e) · B, 0)."""
    uncached = inputs.prompt_tokens - inputs.hits.get(engine.id, 0) * inputs.block_size
    return float(uncached) if uncached > 0 else 0.0


def decode_candidate(engine: Engine, ledger: EngineLedger, inputs: PlacementInputs) -> Candidate:
    """The local prediction on decode engine `engine` (module docstring)."""
    costs = ledger.costs
    prompt = inputs.prompt_tokens
    uncached = uncached_tokens(engine, inputs)
    ahead = ahead_tokens(engine, ledger, inputs.mean_uncached_tokens)
    streams = engine.streams()
    foreign = streams - ledger.streams
    context = ledger.stream_tokens + (foreign * inputs.mean_stream_tokens if foreign > 0 else 0.0)
    output = inputs.output
    ttft = costs.prefill_s(ahead + uncached)
    tpot = costs.step_s(streams + 1, context + prompt + output.median * 0.5)
    target = inputs.target
    meet = meet_probability(ttft, target.ttft_s, ledger.ttft_sigma()) * meet_probability(
        tpot, target.tpot_s, ledger.tpot_sigma()
    )
    if kv_overflows(engine, ledger, context, prompt + output.p90):
        meet = 0.0
    return Candidate(
        engine, ledger, uncached, ahead, ttft, tpot, streams, context, meet,
        ttft + output.median * tpot,
    )  # fmt: skip


def kv_overflows(engine: Engine, ledger: EngineLedger, context: float, new_tokens: float) -> bool:
    """kv_usage · (context + remaining of its streams + new tokens) / context > 1."""
    if engine.kv_usage <= 0.0 or context <= 0.0:
        return False
    grown = context + ledger.stream_output_tokens * 0.5 + new_tokens
    return engine.kv_usage * grown > context


def running_tpot_s(candidate: Candidate, prompt_tokens: int) -> float:
    """TPOT_running of the streams already on the candidate's engine if it prefills locally."""
    ledger = candidate.ledger
    costs = ledger.costs
    remaining = ledger.stream_output_tokens / (2 * ledger.streams) if ledger.streams else 1.0
    stall = candidate.uncached * costs.prefill_s_per_token()
    return costs.step_s(candidate.streams + 1, candidate.context + prompt_tokens) + stall / max(
        remaining, 1.0
    )


def _pick(candidates: Sequence[Candidate], first_block_key: int | None) -> Candidate:
    best_meet = max(c.meet for c in candidates)
    chosen: Candidate | None = None
    chosen_weight = 0.0
    for candidate in candidates:
        if candidate.meet < best_meet - CLOSE_ENOUGH:
            continue
        if chosen is not None and candidate.cost > chosen.cost:
            continue
        tie_weight = (
            0.0 if first_block_key is None else weight(first_block_key, candidate.engine.id)
        )
        if chosen is None or candidate.cost < chosen.cost or tie_weight > chosen_weight:
            chosen, chosen_weight = candidate, tie_weight
    assert chosen is not None
    return chosen


def _best_prefill(
    prefillers: Sequence[Engine],
    ledger_of: Callable[[Engine], EngineLedger],
    inputs: PlacementInputs,
) -> PrefillPick:
    best: PrefillPick | None = None
    for engine in prefillers:
        ledger = ledger_of(engine)
        uncached = uncached_tokens(engine, inputs)
        ahead = ahead_tokens(engine, ledger, inputs.mean_uncached_tokens)
        ttft = ledger.costs.prefill_s(ahead + uncached)
        if best is None or ttft < best.ttft_s:
            best = PrefillPick(engine, ledger, uncached, ahead, ttft)
    assert best is not None
    return best


def _first(chosen: Engine, engines: Sequence[Engine]) -> list[Engine]:
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
    local = _pick(candidates, inputs.first_block_key)
    target = inputs.target
    q = inputs.meet_threshold
    chosen, prefill, ttft, meet = local, None, local.ttft_s, local.meet
    separate = [c for c in candidates if not c.engine.colocated]
    if prefillers and separate and disaggregation != "never" and not local.engine.colocated:
        pick = _best_prefill(prefillers, ledger_of, inputs)
        decode = min(separate, key=lambda c: c.tpot_s)
        ledger = decode.ledger
        pd_ttft = pick.ttft_s + ledger.costs.handoff_s(inputs.prompt_tokens)
        pd_ttft_meet = meet_probability(pd_ttft, target.ttft_s, ledger.ttft_sigma())
        if disaggregation == "always" or (pd_ttft_meet >= q and _local_hurts(local, inputs, q)):
            tpot_meet = meet_probability(decode.tpot_s, target.tpot_s, ledger.tpot_sigma())
            chosen, prefill, ttft, meet = decode, pick, pd_ttft, pd_ttft_meet * tpot_meet
    return Placement(
        chosen,
        prefill,
        ttft,
        meet,
        target.sheddable and meet < q,
        _first(chosen.engine, decoders),
        _first(prefill.engine, prefillers) if prefill is not None else [],
    )


def _local_hurts(local: Candidate, inputs: PlacementInputs, q: float) -> bool:
    """Local misses its TTFT target, or its prefill pushes the running streams past theirs."""
    ledger = local.ledger
    if meet_probability(local.ttft_s, inputs.target.ttft_s, ledger.ttft_sigma()) < q:
        return True
    tightest = ledger.tightest_tpot_s()
    if tightest is None or local.streams <= 0:
        return False
    running = running_tpot_s(local, inputs.prompt_tokens)
    return meet_probability(running, tightest, ledger.tpot_sigma()) < q


def retry_after_s(placement: Placement, target: SloTarget) -> int:
    """For a shed request: the predicted TTFT's excess over the target, in whole seconds (1-60)."""
    excess = placement.ttft_s - target.ttft_s
    return int(min(60, max(1, math.ceil(excess))))
