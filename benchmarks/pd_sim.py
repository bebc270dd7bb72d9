"""A discrete-event simulation of a P/D cluster on the emulator's timing profile, for replaying a
day of traffic against an autoscaling policy in seconds instead of hours.

What it models:
- Prefill engines: FIFO chunked prefill, each step filling up to max_num_batched_tokens with the
  queue's prompts; a step lasts TimingProfile.step_seconds(chunks, 0, 0) of the emulator's profile.
- The KV handoff: TimingProfile.transfer_seconds(prompt tokens) after the prefill.
- Decode engines: continuous batching, each step one token for every running sequence, lasting
  TimingProfile.step_seconds([], seqs, sum of their contexts); a sequence joins when a slot
  (max_num_seqs) and the KV cache (prompt + output tokens reserved) allow, and its first token
  comes out of its first step.
- Routing: a request goes to the ready prefill engine with the fewest queued tokens, then to the
  ready decode engine with the fewest sequences.
- Pods: a new pod serves after `startup_s`; a removed pod takes no new work and goes when
  empty (the drain of a graceful scale-down); GPU-seconds count every pod from its start order
  to its exit.
- Failure: a request not started on a prefill engine `queue_timeout_s` after it arrived is
  dropped (a 503 from the router's bounded queue).
- The metrics an autoscaler reads, over the last `metrics_window_s`: the prefill pod's TTFT
  (queue + prefill) and prefill time, the decode ITL (every step's duration, once per sequence),
  queues, running requests, KV usage, request and token rates.

What it does not: prefix caching (the Azure trace has no prefix information), preemption, KV
transfer contention, the router's own queue, histogram bucketing of the quantiles (they are
exact), and engine step jitter.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from tandem.emulator.profile import TimingProfile

Role = Literal["prefill", "decode"]


@dataclass(slots=True)
class Request:
    arrival: float
    prompt: int
    output: int
    computed: int = 0
    prefill_start: float = -1.0
    prefill_done: float = -1.0
    first_token: float = -1.0
    done: float = -1.0
    dropped: bool = False

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        return (self.done - self.first_token) / (self.output - 1) if self.output > 1 else 0.0


@dataclass(slots=True)
class Engine:
    pool: Role
    ordered_at: float
    ready_at: float
    draining: bool = False
    gone_at: float = math.inf
    stepping: bool = False
    # prefill
    queue: deque[Request] = field(default_factory=deque)
    queued_tokens: int = 0
    batch: list[tuple[Request, int]] = field(default_factory=list)  # the step in flight
    # decode
    waiting: deque[Request] = field(default_factory=deque)
    step: int = 0
    seqs: int = 0
    prompt_sum: int = 0  # sum of the running sequences' prompt tokens
    join_sum: int = 0  # sum of the steps at which they joined
    reserved: int = 0  # KV tokens reserved for them
    finishing: list[tuple[int, int, Request]] = field(default_factory=list)
    joined: list[Request] = field(default_factory=list)
    step_s: float = 0.0

    def ready(self, now: float) -> bool:
        return self.ready_at <= now and not self.draining

    def empty(self) -> bool:
        return not self.queue and not self.waiting and self.seqs == 0 and not self.stepping

    def context_tokens(self) -> int:
        """Sum of the running sequences' contexts: prompt + tokens generated so far."""
        return self.prompt_sum + self.seqs * self.step - self.join_sum


@dataclass(frozen=True, slots=True)
class SimConfig:
    profile: TimingProfile
    startup_s: float = 30.0
    interval_s: float = 15.0
    metrics_window_s: float = 30.0
    queue_timeout_s: float = 60.0
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    kv_tokens: int = 816_000
    drain_limit_s: float = 600.0  # after the last arrival, stop waiting for stragglers


@dataclass(frozen=True, slots=True)
class PoolWindow:
    """One pool's metrics over the window (what Prometheus would answer)."""

    engines: int  # engines scraped (ready, including draining ones)
    ready: int  # ready and not draining
    current: int  # ordered, not draining (a Deployment's spec.replicas)
    latency_quantile_s: float | None  # TTFT (prefill) / ITL (decode) at the quantile
    latency_mean_s: float | None  # prefill time per request (prefill) / ITL (decode)
    queue_mean_s: float | None  # time before the first step (prefill)
    waiting: int
    running: int
    kv_usage: float | None
    request_rate: float
    tokens_per_s: float  # prompt tokens prefilled (prefill) / output tokens (decode)
    tokens_per_request: float | None  # mean prompt (prefill) / output (decode) tokens


Policy = Callable[[float, dict[Role, PoolWindow]], dict[Role, int]]


@dataclass
class Result:
    requests: list[Request]
    gpu_seconds: float
    end_s: float
    sizes: list[tuple[float, int, int]]  # (time, prefill pods, decode pods) at each evaluation

    def attainment(self, ttft_s: float, tpot_s: float) -> float:
        ok = sum(
            1
            for r in self.requests
            if not r.dropped and r.done >= 0 and r.ttft <= ttft_s and r.tpot <= tpot_s
        )
        return ok / len(self.requests)

    @property
    def failed(self) -> int:
        return sum(1 for r in self.requests if r.dropped or r.done < 0)


def _quantile(values: list[tuple[float, int]], q: float) -> float | None:
    """Weighted quantile of (value, weight) pairs."""
    total = sum(w for _, w in values)
    if total == 0:
        return None
    target = q * total
    seen = 0
    for value, weight in sorted(values):
        seen += weight
        if seen >= target:
            return value
    return values[-1][0]


class Simulation:
    """Replays `requests` (sorted by arrival) against pools sized by `policy` every interval."""

    def __init__(
        self,
        config: SimConfig,
        requests: list[Request],
        initial: dict[Role, int],
        policy: Policy | None,
        quantile: float = 0.9,
    ) -> None:
        self.config = config
        self.requests = requests
        self.policy = policy
        self.quantile = quantile
        self.engines: dict[Role, list[Engine]] = {
            pool: [Engine(pool, 0.0, 0.0) for _ in range(n)] for pool, n in initial.items()
        }
        self.events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self.pending: deque[Request] = deque()  # arrived while no prefill engine was ready
        # metrics records, time-ordered
        # t, ttft, prefill time, prompt tokens, queue time
        self.prefill_done: list[tuple[float, float, float, int, float]] = []
        self.decode_steps: list[tuple[float, float, int]] = []  # t, duration, seqs
        self.decode_done: list[tuple[float, int]] = []  # t, output tokens
        self.sizes: list[tuple[float, int, int]] = []

    # ------------------------------------------------------------------ events
    def _at(self, t: float, kind: int, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, payload))

    ARRIVE, PSTEP, XFER, DSTEP, TICK, READY = range(6)

    def run(self) -> Result:
        for request in self.requests:
            self._at(request.arrival, self.ARRIVE, request)
        last = self.requests[-1].arrival if self.requests else 0.0
        if self.policy is not None:
            self._at(self.config.interval_s, self.TICK, None)
        stop = last + self.config.drain_limit_s
        now = 0.0
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            if now > stop:
                break
            if kind == self.ARRIVE:
                assert isinstance(payload, Request)
                self._route_prefill(payload, now)
            elif kind == self.PSTEP:
                assert isinstance(payload, Engine)
                self._prefill_step_done(payload, now)
            elif kind == self.XFER:
                assert isinstance(payload, Request)
                self._route_decode(payload, now)
            elif kind == self.DSTEP:
                assert isinstance(payload, Engine)
                self._decode_step_done(payload, now)
            elif kind == self.TICK:
                if now <= last:
                    self._tick(now)
                    self._at(now + self.config.interval_s, self.TICK, None)
            elif kind == self.READY:
                assert isinstance(payload, Engine)
                self._on_ready(payload, now)
        return Result(self.requests, self._gpu_seconds(last), now, self.sizes)

    def _gpu_seconds(self, until: float) -> float:
        total = 0.0
        for engines in self.engines.values():
            for engine in engines:
                total += max(0.0, min(engine.gone_at, until) - engine.ordered_at)
        return total

    # ------------------------------------------------------------------ prefill
    def _route_prefill(self, request: Request, now: float) -> None:
        ready = [e for e in self.engines["prefill"] if e.ready(now)]
        if not ready:
            self.pending.append(request)
            return
        engine = min(ready, key=lambda e: e.queued_tokens)
        engine.queue.append(request)
        engine.queued_tokens += request.prompt
        if not engine.stepping:
            self._prefill_step(engine, now)

    def _prefill_step(self, engine: Engine, now: float) -> None:
        budget = self.config.max_num_batched_tokens
        engine.batch = []
        timeout = self.config.queue_timeout_s
        for request in list(engine.queue):
            if budget <= 0:
                break
            if request.computed == 0 and now - request.arrival > timeout:
                engine.queue.remove(request)
                engine.queued_tokens -= request.prompt
                request.dropped = True
                continue
            take = min(request.prompt - request.computed, budget)
            if request.prefill_start < 0:
                request.prefill_start = now
            engine.batch.append((request, take))
            budget -= take
        if not engine.batch:
            engine.stepping = False
            self._retire_if_drained(engine, now)
            return
        engine.stepping = True
        chunks = [(take, request.computed) for request, take in engine.batch]
        duration = self.config.profile.step_seconds(chunks, 0, 0)
        self._at(now + duration, self.PSTEP, engine)

    def _prefill_step_done(self, engine: Engine, now: float) -> None:
        for request, take in engine.batch:
            request.computed += take
            engine.queued_tokens -= take
            if request.computed < request.prompt:
                continue
            engine.queue.remove(request)
            request.prefill_done = now
            self.prefill_done.append(
                (
                    now,
                    now - request.arrival,
                    now - request.prefill_start,
                    request.prompt,
                    request.prefill_start - request.arrival,
                )
            )
            self._at(now + self.config.profile.transfer_seconds(request.prompt), self.XFER, request)
        self._prefill_step(engine, now)

    # ------------------------------------------------------------------ decode
    def _route_decode(self, request: Request, now: float) -> None:
        ready = [e for e in self.engines["decode"] if e.ready(now)]
        if not ready:  # every decode pod is starting: the first one to be ready takes it
            ready = [e for e in self.engines["decode"] if not e.draining]
        engine = min(ready, key=lambda e: (e.ready_at > now, e.seqs + len(e.waiting)))
        engine.waiting.append(request)
        if not engine.stepping and engine.ready_at <= now:
            self._decode_step(engine, now)

    def _decode_step(self, engine: Engine, now: float) -> None:
        config = self.config
        engine.joined = []
        while engine.waiting and engine.seqs < config.max_num_seqs:
            request = engine.waiting[0]
            need = request.prompt + request.output
            if engine.reserved + need > config.kv_tokens and engine.seqs > 0:
                break
            engine.waiting.popleft()
            engine.seqs += 1
            engine.prompt_sum += request.prompt
            engine.join_sum += engine.step
            engine.reserved += need
            engine.joined.append(request)
            heapq.heappush(engine.finishing, (engine.step + request.output, id(request), request))
        if engine.seqs == 0:
            engine.stepping = False
            self._retire_if_drained(engine, now)
            return
        engine.stepping = True
        engine.step_s = config.profile.step_seconds([], engine.seqs, engine.context_tokens())
        self._at(now + engine.step_s, self.DSTEP, engine)

    def _decode_step_done(self, engine: Engine, now: float) -> None:
        engine.step += 1
        self.decode_steps.append((now, engine.step_s, engine.seqs))
        for request in engine.joined:
            request.first_token = now
        while engine.finishing and engine.finishing[0][0] <= engine.step:
            _, _, request = heapq.heappop(engine.finishing)
            request.done = now
            engine.seqs -= 1
            engine.prompt_sum -= request.prompt
            engine.join_sum -= engine.step - request.output
            engine.reserved -= request.prompt + request.output
            self.decode_done.append((now, request.output))
        self._decode_step(engine, now)

    # ------------------------------------------------------------------ pods
    def _on_ready(self, engine: Engine, now: float) -> None:
        if engine.draining:
            return
        if engine.pool == "prefill":
            while self.pending:
                self._route_prefill(self.pending.popleft(), now)
        elif engine.waiting and not engine.stepping:
            self._decode_step(engine, now)

    def _retire_if_drained(self, engine: Engine, now: float) -> None:
        if engine.draining and engine.empty() and engine.gone_at == math.inf:
            engine.gone_at = now

    def _resize(self, pool: Role, desired: int, now: float) -> None:
        live = [e for e in self.engines[pool] if not e.draining]
        if desired > len(live):
            for _ in range(desired - len(live)):
                engine = Engine(pool, now, now + self.config.startup_s)
                self.engines[pool].append(engine)
                self._at(engine.ready_at, self.READY, engine)
            return
        # Remove pods not yet serving first, then the least loaded: they drain, then go.
        order = sorted(
            live,
            key=lambda e: (e.ready_at <= now, e.queued_tokens + e.seqs + len(e.waiting)),
        )
        for engine in order[: len(live) - desired]:
            engine.draining = True
            if engine.ready_at > now:
                engine.gone_at = now
            elif engine.pool == "decode" and engine.waiting:
                moved = list(engine.waiting)
                engine.waiting.clear()
                for request in moved:
                    self._route_decode(request, now)
            self._retire_if_drained(engine, now)

    # ------------------------------------------------------------------ the autoscaler
    def window(self, now: float) -> dict[Role, PoolWindow]:
        w = self.config.metrics_window_s
        since = now - w
        windows: dict[Role, PoolWindow] = {}
        for pool, engines in self.engines.items():
            serving = [e for e in engines if e.ready_at <= now and e.gone_at > now]
            ready = [e for e in serving if not e.draining]
            current = sum(1 for e in engines if not e.draining)
            if pool == "prefill":
                start = bisect_left(self.prefill_done, (since,))
                done = self.prefill_done[start:]
                # vLLM's running: the requests in the step in flight; waiting: the rest queued.
                running = sum(len(e.batch) for e in serving if e.stepping)
                waiting = sum(len(e.queue) for e in serving) - running + len(self.pending)
                windows[pool] = PoolWindow(
                    engines=len(serving),
                    ready=len(ready),
                    current=current,
                    latency_quantile_s=_quantile([(d[1], 1) for d in done], self.quantile),
                    latency_mean_s=sum(d[2] for d in done) / len(done) if done else None,
                    queue_mean_s=sum(d[4] for d in done) / len(done) if done else None,
                    waiting=waiting,
                    running=running,
                    kv_usage=None,
                    request_rate=len(done) / w,
                    tokens_per_s=sum(d[3] for d in done) / w,
                    tokens_per_request=sum(d[3] for d in done) / len(done) if done else None,
                )
            else:
                steps = self.decode_steps[bisect_left(self.decode_steps, (since,)) :]
                finished = self.decode_done[bisect_left(self.decode_done, (since,)) :]
                tokens = sum(n for _, _, n in steps)
                kv = [e.context_tokens() / self.config.kv_tokens for e in serving]
                windows[pool] = PoolWindow(
                    engines=len(serving),
                    ready=len(ready),
                    current=current,
                    latency_quantile_s=_quantile([(d, n) for _, d, n in steps], self.quantile),
                    latency_mean_s=sum(d * n for _, d, n in steps) / tokens if tokens else None,
                    queue_mean_s=None,
                    waiting=sum(len(e.waiting) for e in serving),
                    running=sum(e.seqs for e in serving),
                    kv_usage=min(1.0, sum(kv) / len(kv)) if kv else None,
                    request_rate=len(finished) / w,
                    tokens_per_s=tokens / w,
                    tokens_per_request=(
                        sum(n for _, n in finished) / len(finished) if finished else None
                    ),
                )
        return windows

    def _tick(self, now: float) -> None:
        assert self.policy is not None
        windows = self.window(now)
        desired = self.policy(now, windows)
        for pool, n in desired.items():
            if n != windows[pool].current:
                self._resize(pool, n, now)
        live = {
            pool: sum(1 for e in engines if not e.draining)
            for pool, engines in self.engines.items()
        }
        self.sizes.append((now, live["prefill"], live["decode"]))
