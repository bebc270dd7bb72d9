"""What the router knows of one engine for prediction: its learned costs and its own open work.

`queue` is this router's unfinished prefill work there (the uncached prompt tokens of its requests
whose prefill has not finished: first byte for a local route, the prefill answer for P/D), replayed
in the engine's order at its learned pace (`prefill_queue.py`); the work still ahead at time t is

    backlog(t) = max(drain(t), overdue(t))

at the decode load of this router's streams there (their count and `stream_tokens`): the part of
a request already computed no longer counts, and each first token observed corrects the replay.
`prefills_open` counts this router's requests prefilled there whose prefill has not taught its
model yet (a P/D prefill's answer teaches when it comes; a local prefill's first byte, when the
request ends).
`streams`, `stream_tokens` and `stream_output_tokens` describe this router's requests decoding
there (count, prompt plus half their predicted output, and predicted output); `claimed_tokens`
the KV its requests sent there to decode still need before their first token (each one's
uncached prompt tokens there, local prefill or handoff, until its first byte); `handoffs_due`
counts those of them prefilled elsewhere (P/D), whose handoff will join the engine's queue and
wait behind any prefill placed there before it; `handoffs_pulling` those of them already sent to
the engine (pulling their prompt's KV, or waiting for a step to compute its last token), and
`pulls_landed` is set while there are none. `handoff_deadlines` holds, of those still prefilling
elsewhere, the ones predicted to meet their TTFT target: each one's deadline (its placement time
plus its target), so that a local prefill can count the targets it would take them past.
`prefill_share` is the part of the engine's time that the prefills this router placed there take,
an exponentially decayed sum of their predicted compute seconds s_i over a window w:

    share(t) = Σ s_i · exp(-(t - t_i) / w) / w

(a steady rate of r prefill seconds per second gives share → r). On a decode engine it is the
interference its running streams suffer: a step of δ seconds becomes δ / (1 - share) per token.
`arrival_rate` is the same sum over the requests that joined the engine's queue (a prefill placed
there, or a handoff to decode there), each counting 1: the requests per second that come to wait
behind what is placed there now.

Every stream also counts the prefills that land on its engine while it runs. The engine keeps a
stall clock S(t) = Σ s_i over every prefill placed there so far; a stream that starts at t0 with
a slack b0 (`candidate.stream_slack_s`: the stall its TPOT target can absorb over its life) has

    slack(t) = b0 - (S(t) - S(t0)) = key - S(t),    key = b0 + S(t0)

left, so the tightest stream's slack is min(key) - S(t): a heap of the keys, O(log streams) per
stream and O(1) per read (ended streams leave the heap lazily).
The squared log errors are exponentially weighted means of ln(observed / predicted)², the sigma of
`slo.meet_probability`.
"""

from __future__ import annotations

import asyncio
import heapq
import math

from tandem.router.predict.cost_model import DecodeLoad, EngineCosts
from tandem.router.predict.prefill_queue import PrefillQueue, QueuedPrefill

ERROR_WEIGHT = 0.05  # per observation: a window of about 20 requests
INITIAL_SQUARED_LOG_ERROR = 0.25  # sigma = 0.5 until the engine has been observed
MIN_SIGMA = 0.05


class DecayedRate:
    """Σ x_i · exp(-(t - t_i) / w) / w over amounts x_i added at t_i: their rate per second over
    a window of w seconds (a steady r per second gives r)."""

    __slots__ = ("_at", "_sum", "window_s")

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._sum = 0.0  # Σ x_i · exp(-(t - t_i) / w) at time _at
        self._at = 0.0

    def rate(self, now: float) -> float:
        if self._sum <= 0.0:
            return 0.0
        window = self.window_s
        return self._sum * math.exp((self._at - now) / window) / window

    def add(self, now: float, amount: float) -> None:
        self._sum = self.rate(now) * self.window_s + amount
        self._at = now


class EngineLedger:
    __slots__ = (
        "_arrivals",
        "_share",
        "_slack_ended",
        "_slack_keys",
        "claimed_tokens",
        "costs",
        "handoff_deadlines",
        "handoffs_due",
        "handoffs_pulling",
        "last_placed",
        "prefills_open",
        "pulls_landed",
        "queue",
        "share_window_s",
        "stall_clock",
        "stream_output_tokens",
        "stream_tokens",
        "streams",
        "tpot_squared_log_error",
        "ttft_squared_log_error",
    )

    def __init__(self, costs: EngineCosts, share_window_s: float) -> None:
        self.costs = costs
        self.share_window_s = share_window_s
        self._share = DecayedRate(share_window_s)  # prefill seconds placed here per second
        self._arrivals = DecayedRate(share_window_s)  # requests that joined its queue per second
        self.queue = PrefillQueue(costs.seeds, lambda: costs.prefill.theta[1])
        self.prefills_open = 0  # this router's prefills here not observed yet (module docstring)
        self.streams = 0
        self.stream_tokens = 0.0
        self.stream_output_tokens = 0.0
        self.claimed_tokens = 0.0
        self.handoffs_due = 0  # P/D requests to decode here, no first byte yet
        self.handoffs_pulling = 0  # of them, those sent here
        self.handoff_deadlines: dict[int, float] = {}  # (module docstring), by request
        self.pulls_landed = asyncio.Event()
        self.pulls_landed.set()
        self.stall_clock = 0.0  # S(t): every prefill's predicted stall placed here, summed
        self._slack_keys: list[float] = []  # a min-heap of the streams' keys b0 + S(t0)
        self._slack_ended: dict[float, int] = {}  # keys of ended streams still in the heap
        self.last_placed: float | None = None  # when this router last sent a prefill here
        self.ttft_squared_log_error = INITIAL_SQUARED_LOG_ERROR
        self.tpot_squared_log_error = INITIAL_SQUARED_LOG_ERROR

    def prefill_share(self, now: float) -> float:
        """share(now) (module docstring)."""
        return self._share.rate(now)

    def arrival_rate(self, now: float) -> float:
        """arrivals(now) (module docstring)."""
        return self._arrivals.rate(now)

    def joined(self, now: float) -> None:
        """A request joined the engine's queue at `now` (a prefill, or a handoff to decode)."""
        self._arrivals.add(now, 1.0)

    def backlog_s(self, now: float) -> float:
        """backlog(now) (module docstring)."""
        return self.queue.drain_s(now, self.streams, self.stream_tokens)

    def pace(self, *, alone: bool) -> float:
        """The scale of a prefill's seed (`cost_model.py`): the queue's pace κ_q
        (`prefill_queue.py`, whose prior is the model's κ); the model's κ for a prefill `alone`
        on the engine (nothing ahead of it) once the engine has been observed so: κ is learned
        from exactly such prefills, the pace from prefills that waited in line."""
        prefill = self.costs.prefill
        return prefill.theta[1] if alone and prefill.samples > 0 else self.queue.pace

    def prefill_s(self, tokens: float, pairs: float, load: DecodeLoad) -> float:
        """The prefill model's a + κ_q · seed (`cost_model.py`) of work behind others: its fixed
        part at the queue's pace."""
        return self.costs.prefill_s(tokens, pairs, load, pace=self.queue.pace)

    def queue_work(
        self, now: float, tokens: float, pairs: float, sent: float | None = None
    ) -> QueuedPrefill:
        """A prefill of `tokens` with `pairs` attention pairs placed at `now` and sent at `sent`
        (`now` unless held); returns its entry."""
        cached = pairs / tokens - tokens * 0.5 if tokens > 0.0 else 0.0
        return self.queue.add(now, tokens, cached, self.streams, self.stream_tokens, sent)

    def work_done(self, now: float, entry: QueuedPrefill, *, computed: bool) -> None:
        """A prefill placed here has ended at `now`: `computed` (its first token or P/D answer
        came), or failed or was abandoned."""
        if computed:
            self.queue.complete(entry, now, self.streams, self.stream_tokens)
        else:
            self.queue.withdraw(entry)

    def add_prefill(self, now: float, compute_s: float) -> None:
        """A prefill of `compute_s` predicted seconds placed on the engine at `now`: it adds to the
        share and stalls every stream decoding there (the stall clock)."""
        self._share.add(now, compute_s)
        self.stall_clock += compute_s

    def tightest_slack_s(self) -> float | None:
        """min(key) - S(now) over the streams decoding here (module docstring); None without any."""
        keys, ended = self._slack_keys, self._slack_ended
        while keys and keys[0] in ended:
            key = heapq.heappop(keys)
            left = ended[key] - 1
            if left:
                ended[key] = left
            else:
                del ended[key]
        return keys[0] - self.stall_clock if keys else None

    def learn_ttft(self, log_ratio: float) -> None:
        """One first token's ln(observed / predicted): its squared log error's mean moves by
        w · (r² - mean)."""
        self.ttft_squared_log_error += ERROR_WEIGHT * (log_ratio**2 - self.ttft_squared_log_error)

    def learn_tpot(self, log_ratio: float) -> None:
        """One stream's ln(observed / predicted) TPOT: its squared log error's mean moves by
        w · (r² - mean)."""
        self.tpot_squared_log_error += ERROR_WEIGHT * (log_ratio**2 - self.tpot_squared_log_error)

    def ttft_sigma(self) -> float:
        return max(math.sqrt(self.ttft_squared_log_error), MIN_SIGMA)

    def tpot_sigma(self) -> float:
        return max(math.sqrt(self.tpot_squared_log_error), MIN_SIGMA)

    def handoffs_missed(self, until: float) -> int:
        """The handoffs due here, still prefilling elsewhere and predicted to meet their TTFT
        target, whose deadline comes before `until`: those a prefill holding the engine's step
        budget until then takes past their target (`disaggregation.handoffs_missed`)."""
        return sum(1 for deadline in self.handoff_deadlines.values() if deadline < until)

    def pull_started(self) -> None:
        """A handoff was sent here: the engine pulls its prompt's KV."""
        self.handoffs_pulling += 1
        self.pulls_landed.clear()

    def pull_landed(self) -> None:
        """That handoff's first token came, or it ended without one."""
        self.handoffs_pulling -= 1
        if not self.handoffs_pulling:
            self.pulls_landed.set()

    def claim(self, tokens: float) -> None:
        """A request sent here to decode will need `tokens` of KV before its first token."""
        self.claimed_tokens += tokens

    def unclaim(self, tokens: float) -> None:
        """Its first byte came (its KV is now a stream's), or it ended without one."""
        self.claimed_tokens = max(self.claimed_tokens - tokens, 0.0)

    def add_stream(self, tokens: float, output_tokens: float, slack_s: float) -> float:
        """A stream starts with `slack_s` of stall it can absorb; returns its key for `end_stream`."""
        self.streams += 1
        self.stream_tokens += tokens
        self.stream_output_tokens += output_tokens
        key = slack_s + self.stall_clock
        heapq.heappush(self._slack_keys, key)
        return key

    def end_stream(self, tokens: float, output_tokens: float, key: float) -> None:
        self.streams -= 1
        self.stream_tokens -= tokens
        self.stream_output_tokens -= output_tokens
        if not self.streams:  # no drift of float sums across an idle moment
            self.stream_tokens = self.stream_output_tokens = 0.0
            self._slack_keys.clear()
            self._slack_ended.clear()
        else:
            self._slack_ended[key] = self._slack_ended.get(key, 0) + 1
