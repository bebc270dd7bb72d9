"""Predicted TTFT and TPOT of each candidate placement of a request: local on a decode engine, or
a prefill engine and then a decode engine (the pick among them: `placement.py`).

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
            (prefill_s at the queue's pace: a + κ_q · seed, `EngineLedger.pace`; alone, with
            backlog(d) = 0 and ahead(d) = 0 on an engine observed so, a + κ · seed: κ learns
            from exactly such prefills, κ_q from prefills that waited in line; every step of it
            carries d's decode load, streams(d) and context(d), and one that starts with
            backlog(d) = 0 waits for half a decode step in flight first: `cost_model.py`)
    stall = prefill_compute_s_d(own work)  (what each stream decoding on d waits for it)
    TPOT  = step_s_d(streams(d) + 1, context(d) + P + L / 2) / (1 - min(share(d), 0.7))
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
  cost     = TTFT + L · TPOT + waiters(d) · stall + joined(d) + queued(d, stall)  (its predicted
             end-to-end time plus the delay its prefill adds to every stream decoding there and
             every handoff on its way there, to this router's prefills that end in the step it
             joins, and to the requests that will queue behind it: uncached work delays them, a
             cache hit's wait delays no one)
  queued(e, s) = arrivals(e) · (backlog(e) + s) · s: a prefill of s seconds placed on e delays by
             s each request that joins e's queue before it drains (arrivals: the requests per
             second that joined e's queue lately, prefills and handoffs, `ledger.py`)
  joined(e) = n · κ · (s1 · m / 1000 + s2 · m · (P - u + m / 2) / 10⁶), m = min(u, room): the n
             prefills whose last chunk is in the step its first chunk joins on e, and the room
             they leave in its budget (`prefill_queue.py`, sharers); 0 when it starts a step of
             its own. A burst placed on one engine within a decode step shares one prefill
             step, so each prompt placed there delays every one placed before it
  hold(d)  = how long a local request waits in the router before it is sent to d: until the
             last of this router's prefills held for d is sent, if one is still held (vLLM takes
             prefills in the order they come); else, when its first chunk would join the next
             step, in which this router's prefills queued on d all end, and joined(d) > δ(d),
             that step's predicted duration without it (`PrefillQueue.last_step`), until
             halfway through that step, t0 + δ(d) / 2; else 0. vLLM fills a step's budget from
             what waits when the step starts, so a prompt that comes mid-step waits for the next
             one and its chunk delays none of the prefills ending in that step, nor the streams
             decoding in it; it then takes one more step, whose fixed time
             f(d) = κ_q · (s0 + d1 · D + d2 · X / 1000) it pays: TTFT + f(d), joined(d) = 0.
             Sent up to δ(d) / 2 early or late, it still misses that step, so the bar is δ(d). A
             P/D prefill is never held: on the Azure trace, held on the prefill pool, P/D TTFT
             p99 was 1.24x (docs/router.md)
  waiters(d) = streams(d) + handoffs_due(d): the streams decoding on d, and this router's P/D
             requests to decode on d whose first token has not come (`ledger.py`); a prefilled
             prompt pulled to d joins its waiting queue and is admitted only in a step whose token
             budget a running prefill's chunk has not taken, so it waits for the prefill placed
             before it much as the streams do
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tandem.router.engines import Engine
from tandem.router.predict.cost_model import DecodeLoad
from tandem.router.predict.ledger import EngineLedger
from tandem.router.predict.output_length import LengthPrediction
from tandem.router.predict.slo import SloTarget, meet_probability

# Streams placed where the share was higher saw about 1 / (1 - 0.7) steps a token, no more: the
# work behind such a share is mostly ahead of them, done by their first token (docs/router.md)
MAX_SHARE = 0.7


@dataclass(slots=True)  # per request: a frozen one's __init__ takes ~5x as long
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


@dataclass(slots=True)  # per request: a frozen one's __init__ takes ~5x as long
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
    queued_s: float  # queued(d, stall): its delay to the requests that will queue behind it
    context: float
    meet: float
    ttft_meet: float  # P(TTFT ≤ T_ttft), the factor of P(meet) the pick ranks by (0 on overflow)
    cost: float
    overflows: bool  # its KV is predicted to overflow with this request on it
    kv_wait_s: float  # until the engine has KV free for the request (`kv_wait_s`)
    pace: float  # the pace its prefill was predicted at (`prefill_pace`)
    hold_s: float  # hold(d): how long it waits in the router before it is sent

    @property
    def load(self) -> DecodeLoad:
        """What each of the engine's steps carries: its streams and their context."""
        return DecodeLoad(self.streams, self.context)


@dataclass(slots=True)  # per request: a frozen one's __init__ takes ~5x as long
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
    pace: float  # the pace its prefill was predicted at (`prefill_pace`)


@dataclass(slots=True)  # per request: a frozen one's __init__ takes ~5x as long
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
    def hold_s(self) -> float:
        """How long the request waits in the router before it is sent: hold(d) when local."""
        return 0.0 if self.prefill is not None else self.decode.hold_s

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


def prefill_pace(ledger: EngineLedger, backlog_s: float, ahead: Work) -> float:
    """The pace that predicts the request's prefill on the engine (`EngineLedger.pace`): alone
    when nothing is ahead of it, backlog(e) = 0 and ahead(e) = 0."""
    return ledger.pace(alone=backlog_s <= 0.0 and ahead.tokens <= 0.0)


def first_token_s(
    ledger: EngineLedger, backlog_s: float, through: Work, load: DecodeLoad, pace: float
) -> float:
    """backlog(e) + prefill_s_e(through(e)) at `pace` (`prefill_pace`) beside the engine's
    decode load, mid-step when nothing of this router's is ahead (`cost_model.py`): the
    engine's time to the request's first token."""
    return backlog_s + ledger.costs.prefill_s(
        through.tokens, through.pairs, load, mid_step=backlog_s <= 0.0, pace=pace
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


def queue_delay_s(ledger: EngineLedger, backlog_s: float, compute_s: float, now: float) -> float:
    """queued(e, s) = arrivals(e) · (backlog(e) + s) · s (module docstring)."""
    return ledger.arrival_rate(now) * (backlog_s + compute_s) * compute_s


def decode_candidate(engine: Engine, ledger: EngineLedger, inputs: PlacementInputs) -> Candidate:
    """The local prediction on decode engine `engine` (module docstring)."""
    costs = ledger.costs
    prompt = inputs.prompt_tokens
    own = own_work(engine, inputs)
    ahead = ahead_work(engine, inputs)
    open_ahead = ledger.queue.open  # with none, no backlog, no hold and no step to join
    backlog = ledger.backlog_s(inputs.now) if open_ahead else 0.0
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
    pace = prefill_pace(ledger, backlog, ahead)
    ttft = first_token_s(ledger, backlog, through, load, pace)
    if kv_wait > 0.0:
        ttft = max(ttft, kv_wait + ledger.prefill_s(own.tokens, own.pairs, load))
    target = inputs.target
    ttft_meet = meet_probability(ttft, target.ttft_s, ledger.ttft_sigma())
    meet = ttft_meet * meet_probability(tpot, target.tpot_s, ledger.tpot_sigma())
    overflows = kv_overflows(engine, ledger, context, prompt + output.p90)
    if overflows:
        meet = ttft_meet = 0.0
    waiters = streams + ledger.handoffs_due
    queued = queue_delay_s(ledger, backlog, stall, inputs.now)
    hold = step_delay = 0.0
    if open_ahead:
        hold, ttft, step_delay = held_step(
            ledger, load, ttft, joined_step_s(ledger, own, prompt, inputs.now), inputs.now
        )
    return Candidate(
        engine, ledger, own, backlog, open_ahead, ahead, through, ttft, stall, share, tpot, streams,
        waiters,
        step_delay,
        queued,
        context,
        meet,
        ttft_meet,
        ttft + output.median * tpot + waiters * stall + step_delay + queued,
        overflows,
        kv_wait,
        pace,
        hold,
    )  # fmt: skip


def step_fixed_s(ledger: EngineLedger, load: DecodeLoad) -> float:
    """f(e) = κ_q · (s0 + d1 · D + d2 · X / 1000): a step's time before its prefill."""
    queue = ledger.queue
    return queue.pace * queue.seeds.fixed(load.streams, load.context)


def held_step(
    ledger: EngineLedger, load: DecodeLoad, ttft_s: float, step_delay_s: float, now: float
) -> tuple[float, float, float]:
    """(hold(e), TTFT, joined(e)) of a request predicted `ttft_s` and `step_delay_s` if sent now
    (module docstring; call after the backlog)."""
    queue = ledger.queue
    held = queue.held_until(now)
    if held is not None:
        return held - now, ttft_s, step_delay_s
    step = queue.last_step(now, load.streams, load.context)
    if step is None or step_delay_s <= step[1]:
        return 0.0, ttft_s, step_delay_s
    start, duration = step  # start > now: the backlog advanced the replay to now
    return start + duration * 0.5 - now, ttft_s + step_fixed_s(ledger, load), 0.0


def prefill_pick(engine: Engine, ledger: EngineLedger, inputs: PlacementInputs) -> PrefillPick:
    """The prediction on prefill engine `engine` of a P/D placement: TTFT_p (module docstring)."""
    own = own_work(engine, inputs)
    ahead = ahead_work(engine, inputs)
    open_ahead = ledger.queue.open  # with none, no backlog and no step to join
    backlog = ledger.backlog_s(inputs.now) if open_ahead else 0.0
    through = through_first_token(ahead, own)
    load = decode_load(engine, ledger, inputs)
    pace = prefill_pace(ledger, backlog, ahead)
    ttft = first_token_s(ledger, backlog, through, load, pace)
    step_delay = joined_step_s(ledger, own, inputs.prompt_tokens, inputs.now) if open_ahead else 0.0
    return PrefillPick(
        engine, ledger, own, backlog, open_ahead, ahead, through, load, ttft, step_delay, pace
    )


def kv_overflows(engine: Engine, ledger: EngineLedger, context: float, new_tokens: float) -> bool:
    """kv_usage · (context + remaining of its streams + new tokens) / context > 1."""
    if engine.kv_usage <= 0.0 or context <= 0.0:
        return False
    grown = context + ledger.stream_output_tokens * 0.5 + new_tokens
    return engine.kv_usage * grown > context


def slowed_by_prefills(step_s: float, share: float) -> float:
    """A decode step's time per output token on an engine that prefills `share` of its time:
    step / (1 - min(share, 0.7))."""
    return step_s / (1.0 - min(share, MAX_SHARE))


def stream_slack_s(output_tokens: float, tpot_target_s: float, step_s: float) -> float:
    """The prefill stall a stream of `output_tokens` can absorb over its life and still meet its
    TPOT target: max(L - 1, 1) · (T_tpot - δ), its time from first to last token at the target
    less the steps themselves (negative when even an undisturbed step misses the target)."""
    return max(output_tokens - 1.0, 1.0) * (tpot_target_s - step_s)
