"""P/D by prediction: the decode engine of a disaggregated request, the decision to disaggregate,
and the decode engine its handoff goes to, in the terms of `candidate.py`.

  P/D decode engine (`pd_decode`), after the prefill engine p of lowest TTFT_p: among the decode
  candidates whose KV is not predicted to overflow (all when none), the lowest
    TTFT_pd(d) + L · TPOT(d)     (its end-to-end time that way: the handoff's wait behind d's
                                  prefill work counts, so handoffs leave an engine whose local
                                  prefills would hold them)
  P/D decision (mode auto, n = 1, a healthy prefill engine, the chosen decode engine not colocated),
  with the local pick d:
    over budget ⇔ share(d) + stall(d) / w > `interferenceBudget` (w: the share's window)
    hurts       ⇔ stall(d) > the tightest slack of d's streams (`ledger.py`): each stream starts
                  with slack b0 = max(L - 1, 1) · (T_tpot - δ) (`stream_slack_s`; δ the
                  engine's undisturbed step when it starts) and every prefill placed on d while
                  it runs takes its predicted stall from it, so local prefill is refused once the
                  prefills a stream has met and this one together would take it past its target
    queued(e, s) = as in the local cost (`candidate.py`), for the prefill engine p with s_p
    missed(d)   = the handoffs due on d, still prefilling elsewhere and predicted to meet their
                  TTFT target, whose deadline (placed + T_ttft) comes before t + TTFT_local; 0
                  when the request's uncached tokens on d are fewer than the chunk size C (its
                  prefill leaves room in each step's budget, and a pulled prompt needs one token
                  of it): a prefill that fills every step holds each such handoff until it ends
    disaggregate ⇔ TTFT_pd + joined(p) + queued(p, s_p) ≤ TTFT_local + waiters(d) · stall(d)
                                              + joined(d) + queued(d, stall(d))   (less delay in all)
                     and (TTFT_pd ≤ TTFT_local or P(TTFT_pd ≤ T_ttft) ≥ q
                          or P(TTFT_pd ≤ T_ttft) + missed(d) > P(TTFT_local ≤ T_ttft))
                   or streams(d) > 0 and (over budget or hurts) and P(TTFT_pd ≤ T_ttft) ≥ q
    with s_p = prefill_compute_s_p(own work on p) and q = `meetProbability`: P/D when it costs the
    pool less waiting (the streams decoding beside a local prefill, and the requests that will
    queue behind the prefill on either engine: a decode engine that takes every prefill it
    predicts it can also makes every handoff to it wait behind them) and the request itself
    loses nothing by it, still meets its TTFT target, or gives up its target to keep more of
    the handoffs' (the TTFT targets expected met: its own either way, and the handoffs' that
    a local prefill would take past theirs), or when local prefill would take the
    streams decoding on d past their budget or target and P/D meets the TTFT target (so a TTFT
    target that only local meets is never given up for the streams' sake). A prefill
    pool that is behind has a large backlog(p) or ahead(p): its TTFT_pd grows until local costs
    less, and the decode engines take prefills within budget.
  handoff (`handoff_decode`): when the P/D prefill answers, the decode engine is chosen again by
    the same rule at that moment with TTFT_p = 0, among the plan's decode candidates still
    healthy (the planned one first: a tie keeps it). vLLM admits a pulled prompt only in a step
    whose token budget the running requests have left room in, so a long prefill placed on the
    planned engine while the request prefilled elsewhere would hold it for its whole length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from tandem.router.engines import Engine
from tandem.router.predict.candidate import (
    Candidate,
    Placement,
    PlacementInputs,
    PrefillPick,
    decode_candidate,
    handoff_wait_s,
    queue_delay_s,
)
from tandem.router.predict.ledger import EngineLedger


def pd_decode(
    separate: Sequence[Candidate], prefill_s: float, inputs: PlacementInputs
) -> tuple[Candidate, float, float]:
    """The P/D decode engine after a prefill of `prefill_s` (TTFT_p), its handoff wait and
    TTFT_pd: among the candidates with KV room for the request (all of them when none has), the
    lowest TTFT_pd(d) + L · TPOT(d), TTFT_pd(d) = TTFT_p + wait(d) + handoff_s_d(P) (module
    docstring); ties to the first."""
    best: tuple[Candidate, float, float] | None = None
    best_cost = 0.0
    roomy = [c for c in separate if not c.overflows] or separate
    for candidate in roomy:
        wait = handoff_wait_s(candidate, prefill_s)
        handoff = candidate.ledger.costs.handoff_s(inputs.prompt_tokens, candidate.load)
        ttft = prefill_s + wait + handoff
        cost = ttft + inputs.output.median * candidate.tpot_s
        if best is None or cost < best_cost:
            best, best_cost = (candidate, wait, ttft), cost
    assert best is not None
    return best


def handoff_decode(
    placement: Placement,
    healthy: Sequence[Engine],
    ledger_of: Callable[[Engine], EngineLedger],
    now: float,
) -> tuple[Candidate, float, float] | None:
    """The decode engine a P/D request's handoff goes to once its prefill has answered, its wait
    there and the handoff's time to the first token (wait + handoff_s_d(P)): `pd_decode` again at
    `now` with TTFT_p = 0 (the prompt's KV is ready to pull),
    over the placement's decode candidates still in `healthy` (the planned one first, so a tie
    keeps it); None when that leaves none. The pool moved on while the prefill ran: a prefill
    placed on the planned engine since would hold the handoff for its whole length (a pulled
    prompt is admitted only in a step whose token budget the running prefill's chunk has left
    room in), while another engine may be free."""
    inputs = replace(placement.inputs, now=now)
    planned = placement.decode.engine
    engines = [c.engine for c in placement.candidates if not c.engine.colocated]
    engines.sort(key=lambda engine: engine is not planned)
    serving = {e.id for e in healthy}
    fresh = [decode_candidate(e, ledger_of(e), inputs) for e in engines if e.id in serving]
    if not fresh:
        return None
    return pd_decode(fresh, 0.0, inputs)


def disaggregate(
    local: Candidate,
    pick: PrefillPick,
    pd_ttft: float,
    pd_ttft_meet: float,
    inputs: PlacementInputs,
) -> bool:
    """The P/D decision of mode auto (module docstring)."""
    q = inputs.meet_threshold
    now = inputs.now
    local_delay = local.waiters * local.stall_s + local.step_delay_s + local.queued_s
    pd_compute = pick.ledger.costs.prefill_compute_s(pick.own.tokens, pick.own.pairs)
    pd_delay = pick.step_delay_s + queue_delay_s(pick.ledger, pick.backlog_s, pd_compute, now)
    if pd_ttft + pd_delay <= local.ttft_s + local_delay and (
        pd_ttft <= local.ttft_s
        or pd_ttft_meet >= q
        or pd_ttft_meet + handoffs_missed(local, now) > local.ttft_meet
    ):
        return True
    ledger = local.ledger
    window = ledger.share_window_s
    over_budget = local.share + local.stall_s / window > inputs.interference_budget
    if local.streams <= 0 or not (over_budget or hurts_running_streams(local)):
        return False
    return pd_ttft_meet >= q


def fills_step_budget(local: Candidate) -> bool:
    """Its uncached tokens on the engine are at least the chunk size C: while its prefill runs,
    no step leaves budget for a pulled prompt's last token."""
    return local.own.tokens >= local.ledger.costs.chunk_tokens


def handoffs_missed(local: Candidate, now: float) -> int:
    """missed(d): the handoffs due on d that its local prefill takes past their TTFT target
    (module docstring); none for a prefill that leaves room in every step's token budget."""
    if not fills_step_budget(local):
        return 0
    return local.ledger.handoffs_missed(now + local.ttft_s)


def hurts_running_streams(local: Candidate) -> bool:
    """Local prefill's stall passes the tightest slack of the streams decoding on the engine."""
    slack = local.ledger.tightest_slack_s()
    return slack is not None and local.stall_s > slack
