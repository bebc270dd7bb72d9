"""Predictive placement: the predicted TTFT and TPOT of every candidate, the pick, and P/D by prediction.

For a request of P prompt tokens, its predicted output (median L, p90 L90, `output_length.py`),
its targets (T_ttft, T_tpot, `slo.py`) and block size B, with each engine's learned costs
(`cost_model.py`) and this router's record of its open work (`ledger.py`) at time t:

    uncached(e)  = u = max(P - hit_blocks(e) · B, 0),  its pairs(e) = u · (P - u + u / 2)
    backlog(e)   = the predicted engine time left of this router's unfinished prefill work there:
                   its prefill queue replayed in chunked steps at the engine's learned pace κ_q,
                   corrected by every first token observed (`prefill_queue.py`: max(drain, overdue))
    ahead(e)     = max(waiting(e) - pending_at_scrape(e), 0) · the mean uncached tokens and pairs
                   (the engine's queue of other routers' requests at the mean size)
    streams(d)   = `Engine.streams()` (the router's live count, or the engine's scraped one)
    context(d)   = stream_tokens(d) + max(streams(d) - own streams(d), 0) · mean stream tokens
    share(d)     = the ledger's prefill share of d's time at t
    kv_wait(d)   = max(held + claimed + u - K, 0) · max(m / 2, 1) · TPOT(d) / held   (0 when K is
                   unknown or no stream decodes on d): K the engine's KV in tokens
                   (vllm:cache_config_info: num_gpu_blocks · block_size), held = max(kv_usage(d) ·
                   K, own stream tokens), claimed the uncached prompt tokens of this router's
                   requests sent to d that have no first token yet, u this request's uncached
                   tokens there, m the mean predicted output of this router's streams there (else
                   L). vLLM admits waiting requests in order, a pulled P/D prompt only with KV
                   for all of it, a local prefill chunk by chunk (the newest running request is
                   preempted when KV runs out): either way the request's uncached prompt needs
                   KV before its first token. What d holds frees as its streams end, with half
                   their output left on average, so the excess waits that share of a stream's
                   remaining time

    through(e)   = ahead(e) + own work: the engine's prefill is work-conserving (chunked
                   prefill fills each step's token budget from the running requests, then the
                   waiting ones in arrival order), so the request's first token comes when the
                   work ahead of it and its own are done

  local on decode engine d:
    TTFT  = max(backlog(d) + prefill_s_d(through(d)), kv_wait(d) + prefill_s_d(own))
            (prefill_s at the queue's pace: a + κ_q · seed, `ledger.prefill_s`; alone, with
            backlog(d) = 0 and ahead(d) = 0 on an engine observed so, a + κ · seed: κ learns
            from exactly such prefills, κ_q from prefills that waited in line; every step of it
            carries d's decode load, streams(d) and context(d), and one that starts with
            backlog(d) = 0 waits for half a decode step in flight first: `cost_model.py`)
    stall = prefill_compute_s_d(own work)  (what each stream decoding on d waits for it)
    TPOT  = step_s_d(streams(d) + 1, context(d) + P + L / 2) / (1 - min(share(d), 0.9))
  prefill engine p, then decode engine d:
    wait  = max(busy(d) - TTFT_p, 0), TTFT_p = backlog(p) + prefill_s_p(through(p)),
            busy(d) = max(backlog(d) + prefill_s_d(ahead(d)), kv_wait(d)) (0 without any): the
            pulled request joins d's waiting queue behind the prefill work already there, and
            is admitted only with KV for its prompt
    TTFT  = TTFT_p + wait + handoff_s_d(P)   (beside d's decode load, `cost_model.py`)
    TPOT  = as local on d

  P(meet)  = Φ(ln(T_ttft / TTFT) / sigma_ttft) · Φ(ln(T_tpot / TPOT) / sigma_tpot)    (0 when d's KV is
             predicted to overflow: kv_usage(d) · (context(d) + its streams' remaining output +
             P + L90) / context(d) > 1, a preemption ahead)
  cost     = TTFT + L · TPOT + waiters(d) · stall + joined(d)  (its predicted end-to-end time plus
             the delay its prefill adds to every stream decoding there and every handoff on its
             way there, and to this router's prefills that end in the step it joins)
  joined(e) = n · κ · (s1 · m / 1000 + s2 · m · (P - u + m / 2) / 10⁶), m = min(u, room): the n
             prefills whose last chunk is in the step its first chunk joins on e, and the room
             they leave in its budget (`prefill_queue.py`, sharers); 0 when it starts a step of
             its own. A burst placed on one engine within a decode step shares one prefill
             step, so each prompt placed there delays every one placed before it
  waiters(d) = streams(d) + handoffs_due(d): the streams decoding on d, and this router's P/D
             requests to decode on d whose first token has not come (`ledger.py`); a prefilled
             prompt pulled to d joins its waiting queue and is admitted only in a step whose token
             budget a running prefill's chunk has not taken, so it waits for the prefill placed
             before it much as the streams do
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
    queued(e, s) = arrivals(e) · (backlog(e) + s) · s: a prefill of s seconds placed on e delays
                  by s each request that joins e's queue before it drains (arrivals: the requests
                  per second that joined e's queue lately, prefills and handoffs, `ledger.py`)
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
  unknown pace: a prefill engine not yet observed (its prefill model still the seed) takes one
    request at a time in mode auto: until a prefill there has answered (and taught its pace) it
    is no P/D candidate while another is open, so a burst that arrives before the first answer
    is not sent whole to an engine judged on its seed alone.
  re-probe: an engine is learned only from the work placed on it, so one judged slow would never
    be corrected; an engine is due (`due_for_probe`) when it is idle in every figure the router
    has (none of its prefill work open, nothing waiting or decoding there) and has been sent no
    request for `reprobeSeconds` since its last one (one never sent anything is tried on its
    seeds). A due decode candidate is the pick (before P(meet) and cost);
    in mode auto a due prefill engine takes the request's prefill (P/D) whatever the decision
    above says. At most one request per engine per interval is placed against the prediction,
    and only on an engine with nothing to delay.
  shed ⇔ the class is sheddable, P(meet) of the chosen placement < q and it is no probe.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from tandem.router.engines import Engine
from tandem.router.predict.cost_model import DecodeLoad
from tandem.router.predict.ledger import EngineLedger
from tandem.router.predict.output_length import LengthPrediction
from tandem.router.predict.slo import SloTarget, meet_probability
from tandem.router.rendezvous import weight

CLOSE_ENOUGH = 0.05  # P(meet) this close to the best's counts as equally likely
MAX_SHARE = 0.9  # a prefill share above it predicts a TPOT of ten steps, not an infinite one


@dataclass(frozen=True, slots=True)
class PlacementInputs:
    prompt_tokens: int
    block_size: int
    hits: Mapping[str, int]
    output: LengthPrediction
    target: SloTarget
    meet_threshold: float
    interference_budget: float
    mean_uncached_tokens: float  # the mean size of a request the router has not seen
    mean_uncached_pairs: float
    mean_stream_tokens: float
    now: float  # monotonic seconds, the clock of the ledgers' prefill shares
    first_block_key: int | None = None
    reprobe_s: float = 0.0  # an idle engine sent nothing for this long is tried (0: never)


@dataclass(frozen=True, slots=True)
class Work:
    """Prefill work: uncached tokens and their attention pairs."""

    tokens: float
    pairs: float


@dataclass(slots=True)
class Candidate:
    """One decode engine's local prediction (and the figures a P/D placement on it shares)."""

    engine: Engine
    ledger: EngineLedger
    own: Work
    backlog_s: float  # this router's prefill work left there, in predicted seconds
    open_ahead: int  # this router's prefills there whose first token has not come
    ahead: Work  # other routers' work queued before it (`ahead_work`)
    through: Work  # the engine's prefill work until its first token (`through_first_token`)
    ttft_s: float
    stall_s: float
    share: float
    tpot_s: float
    streams: float
    waiters: float  # streams + handoffs due: what its prefill delays (module docstring)
    step_delay_s: float  # joined(d): its delay to the prefills ending in the step it joins
    context: float
    meet: float
    ttft_meet: float  # P(TTFT ≤ T_ttft), the factor of P(meet) the pick ranks by (0 on overflow)
    cost: float
    overflows: bool  # its KV is predicted to overflow with this request on it
    kv_wait_s: float  # until the engine has KV free for the request (`kv_wait_s`)

    @property
    def load(self) -> DecodeLoad:
        """What each of the engine's steps carries: its streams and their context."""
        return DecodeLoad(self.streams, self.context)


@dataclass(frozen=True, slots=True)
class PrefillPick:
    engine: Engine
    ledger: EngineLedger
    own: Work
    backlog_s: float
    open_ahead: int
    ahead: Work
    through: Work
    load: DecodeLoad  # what each of its steps carries
    ttft_s: float  # the prefill's part, without the handoff
    step_delay_s: float  # joined(p): its delay to the prefills ending in the step it joins


@dataclass(frozen=True, slots=True)
class Placement:
    decode: Candidate
    prefill: PrefillPick | None  # set when disaggregated
    ttft_s: float  # of the chosen route
    handoff_wait_s: float  # P/D: the predicted wait behind the decode engine's prefill work
    meet: float  # P(meet both) of the chosen route
    shed: bool
    ranking: list[Engine]  # decode engines, the chosen first
    prefill_ranking: list[Engine]  # prefill engines, the chosen first; empty when local
    candidates: tuple[Candidate, ...]  # every decode engine's local prediction, as weighed
    meet_bar: float  # the P(TTFT ≤ T_ttft) a candidate needed to be weighed (`meet_bar`)
    inputs: PlacementInputs  # what it was placed with (the handoff's decode engine is chosen again)

    @property
    def prefill_ledger(self) -> EngineLedger:
        """The ledger of the engine that prefills: the prefill engine's, else the decode one's."""
        return self.prefill.ledger if self.prefill else self.decode.ledger

    @property
    def prefill_work(self) -> Work:
        """The uncached work the prefilling engine computes."""
        return self.prefill.own if self.prefill else self.decode.own


def ahead_work(engine: Engine, inputs: PlacementInputs) -> Work:
    """ahead(e) (module docstring)."""
    others = engine.waiting - engine.pending_at_scrape
    if others <= 0:
        return Work(0.0, 0.0)
    return Work(others * inputs.mean_uncached_tokens, others * inputs.mean_uncached_pairs)


def own_work(engine: Engine, inputs: PlacementInputs) -> Work:
    """u = max(P - hit_blocks(e) · B, 0) uncached tokens after P - u cached ones, and their
    u · (P - u + u / 2) attention pairs."""
    prompt = inputs.prompt_tokens
    uncached = prompt - inputs.hits.get(engine.id, 0) * inputs.block_size
    if uncached <= 0:
        return Work(0.0, 0.0)
    return Work(float(uncached), uncached * (prompt - uncached * 0.5))


def through_first_token(ahead: Work, own: Work) -> Work:
    """The work an engine computes before the request's first token: ahead + own (module
    docstring: the engine's prefill is work-conserving)."""
    return Work(ahead.tokens + own.tokens, ahead.pairs + own.pairs)


def decode_load(engine: Engine, ledger: EngineLedger, inputs: PlacementInputs) -> DecodeLoad:
    """(streams(e), context(e)) (module docstring): what each of the engine's steps carries."""
    streams = engine.streams()
    foreign = streams - ledger.streams
    context = ledger.stream_tokens + (foreign * inputs.mean_stream_tokens if foreign > 0 else 0.0)
    return DecodeLoad(streams, context)


def first_token_s(
    ledger: EngineLedger, backlog_s: float, ahead: Work, through: Work, load: DecodeLoad
) -> float:
    """backlog(e) + prefill_s_e(through(e)) beside the engine's decode load, mid-step when
    nothing of this router's is ahead (`cost_model.py`), alone when nothing is
    (`EngineLedger.prefill_s`): the engine's time to the request's first token."""
    idle = backlog_s <= 0.0
    return backlog_s + ledger.prefill_s(
        through.tokens, through.pairs, load, mid_step=idle, alone=idle and ahead.tokens <= 0.0
    )


def handoff_wait_s(decode: Candidate, prefill_s: float) -> float:
    """max(busy(d) - prefill_s, 0): how long a request whose prefill elsewhere takes `prefill_s`
    waits on decode engine d for the prefill work there before it, or for KV to pull its prompt
    into (module docstring)."""
    ahead = decode.ahead
    busy = decode.backlog_s
    if ahead.tokens > 0.0:
        busy += decode.ledger.prefill_s(ahead.tokens, ahead.pairs, decode.load)
    return max(max(busy, decode.kv_wait_s) - prefill_s, 0.0)


def kv_wait_s(
    engine: Engine,
    ledger: EngineLedger,
    need_tokens: float,
    streams: float,
    tpot_s: float,
    median_output: float,
) -> float:
    """kv_wait(d) (module docstring): until the KV the engine's streams hold has freed enough
    for what this router has sent there ahead of the request and the request itself (0 without
    streams: nothing is held long)."""
    capacity = engine.kv_capacity
    if capacity <= 0.0 or streams <= 0.0:
        return 0.0
    held = max(engine.kv_usage * capacity, ledger.stream_tokens)
    excess = held + ledger.claimed_tokens + need_tokens - capacity
    if excess <= 0.0 or held <= 0.0:
        return 0.0
    own = ledger.streams
    output = ledger.stream_output_tokens / own if own else median_output
    return excess * max(output * 0.5, 1.0) * tpot_s / held


def joined_step_s(ledger: EngineLedger, own: Work, prompt_tokens: int, now: float) -> float:
    """joined(e) = n · compute_e(m), m = min(u, room): the delay the request's first chunk of m
    tokens adds to the n prefills of this router's whose last chunk is in the step it joins on
    e, the room that step's budget has left (`PrefillQueue.sharers`; call after the backlog)."""
    sharing, room = ledger.queue.sharers(now, ledger.streams)
    if not sharing or own.tokens <= 0.0:
        return 0.0
    chunk = min(own.tokens, room)
    cached = prompt_tokens - own.tokens
    return sharing * ledger.costs.prefill_compute_s(chunk, chunk * (cached + chunk * 0.5))


def decode_candidate(engine: Engine, ledger: EngineLedger, inputs: PlacementInputs) -> Candidate:
    """The local prediction on decode engine `engine` (module docstring)."""
    costs = ledger.costs
    prompt = inputs.prompt_tokens
    own = own_work(engine, inputs)
    ahead = ahead_work(engine, inputs)
    backlog = ledger.backlog_s(inputs.now)
    open_ahead = ledger.queue.open
    load = decode_load(engine, ledger, inputs)
    streams, context = load.streams, load.context
    output = inputs.output
    through = through_first_token(ahead, own)
    stall = costs.prefill_compute_s(own.tokens, own.pairs)
    share = ledger.prefill_share(inputs.now)
    tpot = slowed_by_prefills(
        costs.step_s(streams + 1, context + prompt + output.median * 0.5), share
    )
    kv_wait = kv_wait_s(engine, ledger, own.tokens, streams, tpot, output.median)
    ttft = first_token_s(ledger, backlog, ahead, through, load)
    if kv_wait > 0.0:
        ttft = max(ttft, kv_wait + ledger.prefill_s(own.tokens, own.pairs, load))
    target = inputs.target
    ttft_meet = meet_probability(ttft, target.ttft_s, ledger.ttft_sigma())
    meet = ttft_meet * meet_probability(tpot, target.tpot_s, ledger.tpot_sigma())
    overflows = kv_overflows(engine, ledger, context, prompt + output.p90)
    if overflows:
        meet = ttft_meet = 0.0
    waiters = streams + ledger.handoffs_due
    step_delay = joined_step_s(ledger, own, prompt, inputs.now)
    return Candidate(
        engine, ledger, own, backlog, open_ahead, ahead, through, ttft, stall, share, tpot, streams,
        waiters,
        step_delay,
        context,
        meet,
        ttft_meet,
        ttft + output.median * tpot + waiters * stall + step_delay,
        overflows,
        kv_wait,
    )  # fmt: skip


def kv_overflows(engine: Engine, ledger: EngineLedger, context: float, new_tokens: float) -> bool:
    """kv_usage · (context + remaining of its streams + new tokens) / context > 1."""
    if engine.kv_usage <= 0.0 or context <= 0.0:
        return False
    grown = context + ledger.stream_output_tokens * 0.5 + new_tokens
    return engine.kv_usage * grown > context


def slowed_by_prefills(step_s: float, share: float) -> float:
    """A decode step's time per output token on an engine that prefills `share` of its time:
    step / (1 - min(share, 0.9))."""
    return step_s / (1.0 - min(share, MAX_SHARE))


def stream_slack_s(output_tokens: float, tpot_target_s: float, step_s: float) -> float:
    """The prefill stall a stream of `output_tokens` can absorb over its life and still meet its
    TPOT target: max(L - 1, 1) · (T_tpot - δ), its time from first to last token at the target
    less the steps themselves (negative when even an undisturbed step misses the target)."""
    return max(output_tokens - 1.0, 1.0) * (tpot_target_s - step_s)


def due_for_probe(engine: Engine, ledger: EngineLedger, now: float, reprobe_s: float) -> bool:
    """The re-probe rule (module docstring): reprobe_s > 0, the engine idle (no prefill work of
    this router open there, nothing waiting, no stream) and sent nothing for reprobe_s since
    it was last sent something (an engine never sent anything is tried on its seeds)."""
    if reprobe_s <= 0.0 or ledger.queue.open or engine.waiting > 0 or engine.streams():
        return False
    return ledger.last_placed is not None and now - ledger.last_placed >= reprobe_s


def meet_bar(candidates: Sequence[Candidate], q: float) -> float:
    """min(best P(TTFT ≤ T_ttft) - 0.05, q): what a candidate's P(TTFT ≤ T_ttft) must reach for
    it to be weighed by its cost."""
    return min(max(c.ttft_meet for c in candidates) - CLOSE_ENOUGH, q)


def _pick(candidates: Sequence[Candidate], first_block_key: int | None, bar: float) -> Candidate:
    chosen: Candidate | None = None
    chosen_weight = 0.0
    for candidate in candidates:
        if candidate.ttft_meet < bar:
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


def _prefill_pick(engine: Engine, ledger: EngineLedger, inputs: PlacementInputs) -> PrefillPick:
    own = own_work(engine, inputs)
    ahead = ahead_work(engine, inputs)
    backlog = ledger.backlog_s(inputs.now)
    through = through_first_token(ahead, own)
    load = decode_load(engine, ledger, inputs)
    ttft = first_token_s(ledger, backlog, ahead, through, load)
    step_delay = joined_step_s(ledger, own, inputs.prompt_tokens, inputs.now)
    return PrefillPick(
        engine, ledger, own, backlog, ledger.queue.open, ahead, through, load, ttft, step_delay
    )


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
            return _prefill_pick(engine, ledger, inputs), True
        if not trying_allowed and pace_unknown_and_tried(ledger):
            continue
        pick = _prefill_pick(engine, ledger, inputs)
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
    local = probed or _pick(candidates, inputs.first_block_key, bar)
    target = inputs.target
    q = inputs.meet_threshold
    chosen, prefill, ttft, meet, wait = local, None, local.ttft_s, local.meet, 0.0
    probe = False
    separate = [c for c in candidates if not c.engine.colocated]
    always = disaggregation == "always"
    if prefillers and separate and disaggregation != "never" and not local.engine.colocated:
        pick, probe = _best_prefill(prefillers, ledger_of, inputs, trying_allowed=always)
    else:
        pick = None
    if pick is not None:
        decode, pd_wait, pd_ttft = pd_decode(separate, pick.ttft_s, inputs)
        ledger = decode.ledger
        pd_ttft_meet = meet_probability(pd_ttft, target.ttft_s, ledger.ttft_sigma())
        if always or probe or _disaggregate(local, pick, pd_ttft, pd_ttft_meet, inputs):
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


def queue_delay_s(ledger: EngineLedger, backlog_s: float, compute_s: float, now: float) -> float:
    """arrivals(e) · (backlog(e) + s) · s: what a prefill of s seconds placed on e delays the
    requests that join e's queue behind it before the queue drains (module docstring)."""
    return ledger.arrival_rate(now) * (backlog_s + compute_s) * compute_s


def _disaggregate(
    local: Candidate,
    pick: PrefillPick,
    pd_ttft: float,
    pd_ttft_meet: float,
    inputs: PlacementInputs,
) -> bool:
    """The P/D decision of mode auto (module docstring)."""
    q = inputs.meet_threshold
    now = inputs.now
    local_delay = (
        local.waiters * local.stall_s
        + local.step_delay_s
        + queue_delay_s(local.ledger, local.backlog_s, local.stall_s, now)
    )
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
    if local.streams <= 0 or not (over_budget or _hurts_running_streams(local)):
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


def _hurts_running_streams(local: Candidate) -> bool:
    """Local prefill's stall passes the tightest slack of the streams decoding on the engine."""
    slack = local.ledger.tightest_slack_s()
    return slack is not None and local.stall_s > slack


def retry_after_s(placement: Placement, target: SloTarget) -> int:
    """For a shed request: the predicted TTFT's excess over the target, in whole seconds (1-60)."""
    excess = placement.ttft_s - target.ttft_s
    return int(min(60, max(1, math.ceil(excess))))
