"""An engine's prefill queue as the router sees it: this router's open prefills there, in the order
the engine takes them, replayed step by step at the engine's learned pace.

vLLM's scheduler fills each step with the running requests first and then admits waiting ones in
arrival order, within a token budget of C (`max_num_batched_tokens`) less one token per decoding
stream: a long prompt is split into chunks over several steps, and a request's first token comes
at the end of the step that computes its last prompt token. A step of n prefill tokens with p
attention pairs (a chunk of m tokens after c computed ones has m · (c + m / 2)), beside D streams
holding X context tokens, takes

    step(n, p) = κ_q · seed(n, p),
    seed(n, p) = s0 + s1 · n / 1000 + s2 · p / 10⁶ + d1 · D + d2 · X / 1000

in seed seconds (the timing profile's seeds, `cost_model.py`) scaled by the queue's pace κ_q.
`advance(t)` completes every step that ends by t; the step in flight runs from `step_start` to
`step_end`. Prefill work that comes to an engine with none of it finds a decode step in flight
when D > 0, half done on average: its first step starts κ_q · (s0 + d1 · D + d2 · X / 1000) / 2
later (`in_flight_s`), and every prefill placed before then joins that step (the scheduler
forms a step from all that waits when it starts). The engine time until the work still queued
is done, at the decode load of the moment, is

    drain(t) = max(step_end - t, 0) + κ_q · (k · (s0 + d1 · D + d2 · X / 1000) + s1 · T / 1000
                                            + s2 · P / 10⁶),    k = ⌈T / max(C - D, 1)⌉

with T and P the tokens and pairs left after the step in flight (drain 0 when nothing is queued).
The replay can run ahead of the engine: the oldest open entry h may be one it has ended whose
first token has not come. The engine takes prefills in order and has not ended h, so every entry
behind h that the replay did not end in h's last step is still to compute, whole:

    overdue(t) = κ_q · seed over the steps of those entries' tokens (0 unless the replay has
                 ended h)

and the engine time left, until a first token corrects the replay, is max(drain(t), overdue(t)).

A prefill placed at t joins, with its first chunk, the first step not yet started that has
room left in its budget: the last of the steps the queued work will take (the step in flight,
if it has not started). The entries whose last chunk is in that step take their first token at
its end, so the new chunk delays each of them by its compute (`sharers`: their number, and the
room, the tokens of the budget they leave; none when that step is full and the prefill would
start one of its own).

What the router observes corrects the replay. A first token (a P/D prefill's answer) of entry x
means that x's prefill is over, and, as the engine takes prefills in order, so is every entry
ahead of x: they all leave the queue (`complete`). The step that computed x's last chunk ends
then, and the replay's next step starts. What that step computed beside x is known when x's
L_x tokens left started a step of their own: x was placed with nothing open, or was first in
line when the entry before it completed. Its last step left room ⌈L_x / B⌉ · B - L_x of the
budget B = max(C - D, 1), which the scheduler filled in order with the entries behind x placed
before that step started (before the first token less the step's time at κ_q): those tokens,
T_b with P_b pairs, count as computed (`_fill_last_step`). Otherwise, if the replay had not
finished x, the chunks it had put beside x in its step in flight count as computed; if it had
(it ran ahead of the engine), nothing behind x does: the engine computes prefills in order. An
entry the replay has finished stays, with nothing left to compute, until its first token comes
(`open`). A request that fails or is abandoned leaves alone (`withdraw`).

The pace is learned from consecutive completions: when x completes at t1 and y is then first in
the queue, the engine spends the time until y's first token, t2, on y's remaining work, seed_y seed
seconds by the drain formula over y alone at t1, and on the work behind y that y's last step
computed (T_b and P_b above: y's L_y tokens started a step of their own at t1). With a
forgetting factor λ per sample,

    κ_q = (N + W · κ) / (S + W),   N ← λ · N + (t2 - t1),
                                   S ← λ · S + seed_y + s1 · T_b / 1000 + s2 · P_b / 10⁶

where κ is the prefill cost model's scale (learned from requests that met an idle engine, 1 at
the seed) weighing as W = PRIOR_SEED_SECONDS seed seconds. Each sample times work whose start the
router knows (y is first in line once x's step has ended), so it holds whether the replay ran
ahead or lagged. The work other routers send to the engine lengthens t2 - t1 too: the pace is
this router's share of the engine. Without T_b (in the time of y's sample, in the seed of no
sample, as the next one starts from what is left of them), a replay of an engine that takes
prefills in order in chunked steps at exactly twice its seeds learned κ_q = 2.2-2.6; with it,
1.99 at every load (`tests/router/test_router_prefill_queue.py`).

A first token that comes within half a step of the last completion t1, sooner than
κ_q · (s0 + d1 · max(D, 1) + d2 · X / 1000) / 2 after it, was computed in the step that ended at
t1: vLLM fills a step's budget from everything waiting when the step starts, which the replay
did not foresee for a prefill placed after it had planned that step. It ends no sample and
starts none (the next one still starts at t1), leaves the entries behind it as the end of that
step left them, and the seed of its tokens and of those ahead of
it left in the replay, s1 · T / 1000 + s2 · P / 10⁶, joins the sample that ended at t1, whose
time included them: S ← S + that seed. Taken as samples of their own, such first tokens
(2 ms for 2,000 tokens) pulled the pace down; left out, the sample they shared a step with
pushed it up.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

PRIOR_SEED_SECONDS = 0.2  # how much seed work the cost model's scale weighs as in the pace
PACE_FORGET = 0.98  # per pace sample: a window of about 50 completions
MIN_PACE = 0.05


@dataclass(slots=True, eq=False)
class QueuedPrefill:
    """One open prefill: `left` of its `tokens` still to compute after `cached` prompt tokens."""

    tokens: float
    cached: float
    left: float
    in_step: float = 0.0  # tokens of it in the step in flight
    placed: float = 0.0  # when it was sent to the engine (after its hold: `held_until`)
    done_at: float = 0.0  # when the replay ended its last chunk (once left is 0)

    def end_step(self, at: float) -> None:
        """The step in flight ended at `at` and computed its tokens of this entry there."""
        if self.in_step:
            self.left -= self.in_step
            self.in_step = 0.0
            if self.left <= 0.0:
                self.done_at = at

    def pairs(self, tokens: float, computed: float) -> float:
        """Attention pairs of a chunk of `tokens` after `computed` of its own tokens."""
        return tokens * (self.cached + computed + tokens * 0.5)


@dataclass(frozen=True, slots=True)
class StepSeeds:
    """seed's coefficients (module docstring), seconds: s0 per step, s1 per 1000 prefill tokens,
    s2 per 10⁶ pairs, d1 per decoding stream, d2 per 1000 context tokens of the streams."""

    s0: float
    s1: float
    s2: float
    d1: float
    d2: float
    chunk_tokens: int

    def fixed(self, streams: float, context: float) -> float:
        """The seed seconds of a step before its prefill: s0 + d1 · D + d2 · X / 1000."""
        return self.s0 + self.d1 * streams + self.d2 * context * 1e-3

    def work(self, tokens: float, pairs: float) -> float:
        """The seed seconds of prefill tokens and their pairs: s1 · T / 1000 + s2 · P / 10⁶."""
        return self.s1 * tokens * 1e-3 + self.s2 * pairs * 1e-6

    def in_flight(self, streams: float, context: float) -> float:
        """Half a decode step when D > 0, else 0: the expected rest of the step in flight."""
        return self.fixed(streams, context) * 0.5 if streams > 0.0 else 0.0

    def budget(self, streams: float) -> float:
        """max(C - D, 1): the prefill tokens one step takes beside D streams."""
        return max(self.chunk_tokens - streams, 1.0)


class PrefillQueue:
    """The replay (module docstring). `scale` reads the cost model's κ, the pace's prior."""

    __slots__ = ("_fresh", "_pending", "_sample_seconds", "_sample_seeds", "_sampled",
                 "_step_ended", "entries", "scale", "seeds", "step_end", "step_start")  # fmt: skip

    def __init__(self, seeds: StepSeeds, scale: Callable[[], float]) -> None:
        self.seeds = seeds
        self.scale = scale
        self.entries: deque[QueuedPrefill] = deque()
        self.step_start = 0.0  # monotonic seconds: when the step in flight starts
        self.step_end = 0.0  # and when it ends
        self._sample_seconds = 0.0  # N
        self._sample_seeds = 0.0  # S
        self._pending: tuple[QueuedPrefill, float, float] | None = None  # (y, t1, seed_y)
        # the first entry in line and its L tokens left when they started a step of their own
        self._fresh: tuple[QueuedPrefill, float] | None = None
        self._step_ended = -math.inf  # the last completion not in the step before it
        self._sampled = False  # whether that completion ended a pace sample

    @property
    def pace(self) -> float:
        """κ_q (module docstring)."""
        prior = PRIOR_SEED_SECONDS
        pace = (self._sample_seconds + prior * self.scale()) / (self._sample_seeds + prior)
        return max(pace, MIN_PACE)

    @property
    def tokens(self) -> float:
        """The tokens still to compute of this router's prefills there, as replayed."""
        return sum(entry.left for entry in self.entries)

    @property
    def open(self) -> int:
        """This router's prefills there whose first token has not come (replayed or not)."""
        return len(self.entries)

    def last(self, entry: QueuedPrefill) -> bool:
        """Whether `entry` is the last open one: nothing was placed behind it since."""
        return bool(self.entries) and self.entries[-1] is entry

    @property
    def busy(self) -> bool:
        """Whether the replay has work left (the last entry is the last to finish)."""
        return bool(self.entries) and self.entries[-1].left > 0.0

    def add(
        self,
        now: float,
        tokens: float,
        cached: float,
        streams: float,
        context: float,
        sent: float | None = None,
    ) -> QueuedPrefill:
        """A prefill of `tokens` after `cached` placed at `now` and sent to the engine at `sent`
        (`now` unless held in the router: `held_until`); returns its entry."""
        self.advance(now, streams, context)
        placed = now if sent is None else max(sent, now)
        entry = QueuedPrefill(max(tokens, 1.0), max(cached, 0.0), max(tokens, 1.0), placed=placed)
        if not self.entries:
            self._fresh = (entry, entry.tokens)
        idle = not self.busy
        self.entries.append(entry)
        if idle:
            self.step_start = now + self.in_flight_s(streams, context)
        if idle or now < self.step_start:  # the step has not started: it joins it
            self.step_end = self.step_start + self._plan(streams, context)
        return entry

    def in_flight_s(self, streams: float, context: float) -> float:
        """κ_q · (s0 + d1 · D + d2 · X / 1000) / 2 when D > 0, else 0: the expected rest of the
        decode step in flight when prefill work comes to an engine with none of it."""
        return self.pace * self.seeds.in_flight(streams, context)

    def advance(self, now: float, streams: float, context: float) -> None:
        """Completes every step that ends by `now`, each next step planned at the decode load
        given (the streams decoding there now). Entries the replay has finished stay until their
        first token is observed (`open`), with nothing left to compute."""
        while self.step_end <= now and self.busy:
            for entry in self.entries:
                entry.end_step(self.step_end)
            if self.busy:
                self.step_start = self.step_end
                self.step_end += self._plan(streams, context)

    def _plan(self, streams: float, context: float) -> float:
        """Fills the next step in queue order with the entries sent by its start; returns its
        duration κ_q · seed, or, when the first entry with work left is still held, the time
        until it is sent (the engine has nothing of this router's to compute until then)."""
        seeds = self.seeds
        budget = seeds.budget(streams)
        tokens = pairs = 0.0
        for entry in self.entries:
            take = 0.0
            if budget > 0.0 and entry.left > 0.0:
                if entry.placed > self.step_start:  # held: neither it nor anything behind it
                    if tokens <= 0.0:
                        return max(entry.placed - self.step_start, 0.0)
                    budget = 0.0
                else:
                    take = min(entry.left, budget)
                    pairs += entry.pairs(take, entry.tokens - entry.left)
                    tokens += take
                    budget -= take
            # a step planned again before it starts may reach fewer entries than the plan before
            entry.in_step = take
        seed = seeds.fixed(streams, context) + seeds.work(tokens, pairs)
        return self.pace * seed

    def drain_s(self, now: float, streams: float, context: float) -> float:
        """max(drain(now), overdue(now)) (module docstring), after advancing the replay to `now`."""
        self.advance(now, streams, context)
        overdue = self._overdue_s(streams, context)
        if not self.busy:
            return overdue
        tokens, pairs = self._work_left(past_step=True)
        replayed = max(self.step_end - now, 0.0) + self.pace * self._seed_s(
            tokens, pairs, streams, context
        )
        return max(replayed, overdue)

    def _work_left(self, *, past_step: bool) -> tuple[float, float]:
        """The tokens left to compute of every entry and their attention pairs, beyond the step
        in flight when `past_step`, else with it."""
        tokens = pairs = 0.0
        for entry in self.entries:
            left = entry.left - (entry.in_step if past_step else 0.0)
            if left > 0.0:
                tokens += left
                pairs += entry.pairs(left, entry.tokens - left)
        return tokens, pairs

    def held_until(self, now: float) -> float | None:
        """When the last entry is sent, if it is still held at `now`: a prefill placed now is
        held as long (the engine takes prefills in the order they come)."""
        entries = self.entries
        return entries[-1].placed if entries and entries[-1].placed > now else None

    def last_step(self, now: float, streams: float, context: float) -> tuple[float, float] | None:
        """(t0, δ) of the step in which this router's prefills queued here end, when a prefill
        placed at `now` (after `drain_s`, which advances) would join it and it is the next one:
        t0 > now its start (the end of the step in flight, or the start of the step planned and
        not started) and δ = κ_q · seed of their rest R ≤ B; None otherwise (the replay idle,
        the step in flight ending them all, or their rest needing more than one step)."""
        if not self.busy:
            return None
        started = now >= self.step_start
        tokens, pairs = self._work_left(past_step=started)
        if tokens <= 0.0 or tokens > self.seeds.budget(streams):
            return None
        if not started:
            return self.step_start, self.step_end - self.step_start
        return self.step_end, self.pace * self._seed_s(tokens, pairs, streams, context)

    def sharers(self, now: float, streams: float) -> tuple[int, float]:
        """(n, room): the entries whose last chunk is in the step a prefill placed at `now`
        would start in, and the tokens of that step's budget they leave it (module docstring);
        (0, 0) when it would start a step of its own. Call after `drain_s` (it advances)."""
        if not self.busy:
            return 0, 0.0
        started = now >= self.step_start
        rest = [entry.left - (entry.in_step if started else 0.0) for entry in self.entries]
        total = sum(rest)
        if total <= 0.0:  # the step in flight has it all: a prefill placed now starts the next
            return 0, 0.0
        budget = self.seeds.budget(streams)
        steps = math.ceil(total / budget)
        room = steps * budget - total
        if room <= 0.0:
            return 0, 0.0
        last_starts = (steps - 1) * budget
        ending, end = 0, 0.0
        for left in rest:
            end += left
            if left > 0.0 and end > last_starts:
                ending += 1
        return ending, room

    def _overdue_s(self, streams: float, context: float) -> float:
        """overdue (module docstring)."""
        entries = self.entries
        if not entries or entries[0].left > 0.0:
            return 0.0
        ended = entries[0].done_at
        tokens = pairs = 0.0
        for entry in entries:
            if entry.left > 0.0 or entry.done_at != ended:
                tokens += entry.tokens
                pairs += entry.pairs(entry.tokens, 0.0)
        return self.pace * self._seed_s(tokens, pairs, streams, context)

    def _seed_s(self, tokens: float, pairs: float, streams: float, context: float) -> float:
        """seed over ⌈T / max(C - D, 1)⌉ steps of T tokens and P pairs (0 when T = 0)."""
        if tokens <= 0.0:
            return 0.0
        seeds = self.seeds
        steps = math.ceil(tokens / seeds.budget(streams))
        return steps * seeds.fixed(streams, context) + seeds.work(tokens, pairs)

    def complete(self, entry: QueuedPrefill, now: float, streams: float, context: float) -> None:
        """`entry`'s prefill is over at `now` (its first token, or its P/D prefill's answer): it
        and every entry ahead of it leave; a pace sample ends or starts (module docstring)."""
        self.advance(now, streams, context)
        entries = self.entries
        shared = now - self._step_ended < self.in_flight_s(max(streams, 1.0), context)
        pending, fresh = self._pending, self._fresh
        self._pending = self._fresh = None
        if shared:  # computed in the step that ended then: its work was in that sample's time
            if self._sampled and entry in entries:
                self._sample_seeds += self._work_up_to(entry)
            start = self._step_ended
        else:
            self._sampled = pending is not None and pending[0] is entry
            if pending is not None and self._sampled:
                forget = PACE_FORGET
                self._sample_seconds = forget * self._sample_seconds + (now - pending[1])
                self._sample_seeds = forget * self._sample_seeds + pending[2]
            self._step_ended = start = now
        if entry in entries:
            lagging = entry.left > 0.0
            while entries.popleft() is not entry:
                pass
            # the engine's step ended now with the entry's last chunk, and the next one starts
            if shared:  # what that step computed beside it was settled when it ended
                pass
            elif fresh is not None and fresh[0] is entry:
                beside = self._fill_last_step(fresh[1], streams, context, now)
                if self._sampled:
                    self._sample_seeds += beside
            else:
                for waiting in entries:
                    if lagging:  # the chunks the replay put beside it are computed too
                        waiting.end_step(now)
                    else:  # the replay ran ahead: nothing behind it is known computed
                        waiting.left = waiting.tokens
                        waiting.in_step = 0.0
            self.step_start = now
            self.step_end = now + self._plan(streams, context) if self.busy else now
        first = next((waiting for waiting in entries if waiting.left > 0.0), None)
        if first is not None:
            left = first.left
            seed_y = self._seed_s(left, first.pairs(left, first.tokens - left), streams, context)
            self._pending = (first, start, seed_y)
            self._fresh = (first, left)

    def _fill_last_step(
        self, sampled_tokens: float, streams: float, context: float, now: float
    ) -> float:
        """The entries behind a sample's y, whose L_y tokens started a step of their own at t1,
        computed in order in the room its last step left, ⌈L_y / B⌉ · B - L_y (B the budget),
        each placed before that step started (`now` less its time at the pace): marks them so
        and returns their seed, s1 · T / 1000 + s2 · P / 10⁶, which the sample's time included."""
        seeds = self.seeds
        budget = seeds.budget(streams)
        steps = math.ceil(sampled_tokens / budget)
        last = sampled_tokens - (steps - 1) * budget
        room = budget - last
        step_seed = seeds.fixed(streams, context) + seeds.work(last, 0.0)
        pace = self.pace
        seed = 0.0
        for waiting in self.entries:
            waiting.in_step = 0.0
            computed = min(waiting.tokens, room)
            work = seeds.work(computed, waiting.pairs(computed, 0.0))
            if computed <= 0.0 or waiting.placed > now - pace * (step_seed + seed + work):
                waiting.left = waiting.tokens
                room = 0.0
                continue
            room -= computed
            seed += work
            waiting.left = waiting.tokens - computed
            if waiting.left <= 0.0:
                waiting.done_at = now
        return seed

    def _work_up_to(self, entry: QueuedPrefill) -> float:
        """s1 · T / 1000 + s2 · P / 10⁶ over the tokens left of `entry` and the entries ahead of
        it: what a step that computed them with its own work took on top of that work."""
        seeds = self.seeds
        seed = 0.0
        for queued in self.entries:
            left = queued.left
            if left > 0.0:
                seed += seeds.work(left, queued.pairs(left, queued.tokens - left))
            if queued is entry:
                break
        return seed

    def withdraw(self, entry: QueuedPrefill) -> None:
        """`entry` failed or was abandoned: it leaves alone, and is no pace sample."""
        if self._pending is not None and self._pending[0] is entry:
            self._pending = None
        if self._fresh is not None and self._fresh[0] is entry:
            self._fresh = None
        with contextlib.suppress(ValueError):
            self.entries.remove(entry)
