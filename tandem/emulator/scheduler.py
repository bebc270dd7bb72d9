"""Continuous batching as vLLM v1 does it: running first, then waiting; a token budget with
chunked prefill; preemption of the newest running request when KV blocks run out.

Two variations for experiments: speculative decoding (every decode verifies k drafted tokens and
keeps the accepted ones plus one), and static batching (waiting requests are admitted only when
the running batch has drained, up to max_num_seqs of them: no joining mid-flight)."""

from __future__ import annotations

import contextlib
import random
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain

from tandem.common.metrics import Histogram
from tandem.emulator.kv_cache import KVCacheManager
from tandem.emulator.request import EngineRequest, FinishReason, Status

# LCG constants (Numerical Recipes) for the deterministic output token stream.
_LCG_A = 1664525
_LCG_C = 1013904223
_LCG_MASK = 0xFFFFFFFF


@dataclass(slots=True)
class Batch:
    """What one engine step computes: decodes (one token that completes the sequence, so one is
    sampled) and chunks (any other number of tokens: prefill chunks, recomputation)."""

    decodes: list[EngineRequest] = field(default_factory=list)
    chunks: list[EngineRequest] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    prefill_chunks: list[tuple[int, int]] = field(default_factory=list)  # (chunk_len, cached_ctx)
    decode_seqs: int = 0
    decode_context_tokens: int = 0
    total_tokens: int = 0
    preempted: list[EngineRequest] = field(default_factory=list)

    @property
    def requests(self) -> list[EngineRequest]:
        return [*self.decodes, *self.chunks]

    @property
    def num_tokens(self) -> list[int]:
        return [1] * len(self.decodes) + self.chunk_tokens

    @property
    def size(self) -> int:
        return len(self.decodes) + len(self.chunks)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.chunks)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        output_ids: list[int],
        enable_chunked_prefill: bool = True,
        num_speculative_tokens: int = 0,
        static_batching: bool = False,
        seed: int = 0,
        max_loras: int | None = None,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        self.kv = kv
        # --long-prefill-token-threshold: the most prompt tokens of one request per step (0: off)
        self.long_prefill_token_threshold = long_prefill_token_threshold
        # --max-loras: adapters one step may run (None: LoRA off)
        self.max_loras = max_loras
        self.lora_waited = 0  # requests that waited for an adapter slot at least once
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.output_ids = output_ids
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.num_preemptions = 0
        self.num_speculative_tokens = num_speculative_tokens
        self.static_batching = static_batching
        self._cohort_left = 0  # static batching: requests of the current batch not yet admitted
        self._spec_rng = random.Random(seed)
        # speculative decoding: verify steps, drafted tokens, accepted tokens (vLLM's counters)
        self.spec_drafts = 0
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        self.spec_accepted_per_pos = [0] * num_speculative_tokens
        # called when a remote-prefill request got its blocks: (request, local hit tokens)
        self.on_remote_kv: Callable[[EngineRequest, int], None] | None = None
        # called for every request that is scheduled for the first time
        self.on_first_scheduled: Callable[[EngineRequest, int], None] | None = None
        # inter-token latency histogram (bounds, counts, total) filled by update()
        self.itl: Histogram | None = None

    # ------------------------------------------------------------------ queue management
    def add(self, request: EngineRequest) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    def num_waiting_for_kv(self) -> int:
        return sum(1 for r in self.waiting if r.status is Status.WAITING_FOR_REMOTE_KVS)

    def finish(self, request: EngineRequest, reason: FinishReason, free: bool = True) -> None:
        """Take a request out of the engine (finished, aborted or failed) and release its blocks."""
        if request.status is Status.FINISHED:
            return
        if request.status is Status.RUNNING:
            with contextlib.suppress(ValueError):
                self.running.remove(request)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(request)
        request.status = Status.FINISHED
        request.finish_reason = reason
        if free:
            self.kv.free(request)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> Batch:
        batch = Batch()
        kv = self.kv
        budget = self.max_num_batched_tokens
        max_len = self.max_model_len
        running = self.running
        caching = kv.enable_caching
        bs = kv.block_size
        decodes = batch.decodes
        decode_seqs = 0
        decode_context = 0
        lookahead = self.num_speculative_tokens  # KV slots and budget for the drafted tokens
        req_index = 0
        while req_index < len(running) and budget > 0:
            request = running[req_index]
            req_index += 1
            if request.stall:
                continue
            computed = request.num_computed_tokens
            num_new = len(request.token_ids) - computed
            if (
                num_new == 1
                and computed < max_len - 1
                and computed + lookahead < request.kv_capacity
            ):
                # decode fast path: the slot exists; register the block if this token fills it
                if caching and (computed + 1) // bs > request.num_cached_blocks:
                    kv.cache_blocks(request, computed + 1)
                decodes.append(request)
                decode_seqs += 1
                decode_context += computed
                budget -= 1 + lookahead
                continue
            num_new = self._capped(num_new)
            if num_new > budget:
                num_new = budget
            if num_new > max_len - 1 - computed:
                num_new = max_len - 1 - computed
            if num_new <= 0:
                continue
            scheduled = True
            slots = num_new + lookahead if num_new == 1 else num_new
            while not kv.allocate_slots(request, slots):
                victim = running.pop()
                self._preempt(victim, batch)
                if victim is request:
                    scheduled = False
                    break
            if not scheduled:
                break
            self._add_to_batch(batch, request, num_new)
            budget -= slots  # a decode's drafted tokens count against the budget too
        batch.decode_seqs += decode_seqs
        batch.decode_context_tokens += decode_context
        batch.total_tokens = self.max_num_batched_tokens - budget

        if not batch.preempted:
            limit = self.max_num_seqs
            if self.static_batching:
                if not self.running and not self._cohort_left:
                    self._cohort_left = min(len(self.waiting), self.max_num_seqs)
                limit = len(self.running) + self._cohort_left
            admitted = self._schedule_waiting(batch, budget, limit)
            if self.static_batching:
                self._cohort_left -= admitted
        return batch

    def _schedule_waiting(self, batch: Batch, budget: int, max_running: int) -> int:
        """Admit waiting requests while the budget, the KV pool and `max_running` allow; returns
        how many became running."""
        kv = self.kv
        waiting = self.waiting
        skipped: list[EngineRequest] = []
        admitted = 0
        # vLLM: a waiting request whose adapter is not among the step's adapters is skipped
        # (deferred) while the step already runs --max-loras adapters
        loras = {r.lora[0] for r in batch.requests if r.lora} if self.max_loras else set()
        while waiting and budget > 0 and len(self.running) < max_running:
            request = waiting[0]
            if (
                request.lora
                and self.max_loras
                and len(loras) >= self.max_loras
                and request.lora[0] not in loras
            ):
                if not request.extra.get("lora_waited"):
                    request.extra["lora_waited"] = True
                    self.lora_waited += 1
                skipped.append(waiting.popleft())
                continue
            if request.status is Status.WAITING_FOR_REMOTE_KVS:
                if not request.kv_ready:
                    skipped.append(waiting.popleft())
                    continue
                self._finish_remote_kv(request)
            if request.remote_prefill is not None and request.status is Status.WAITING:
                # decode side of P/D: reserve blocks for the whole prompt, then pull the KV
                hits, num_hit = kv.get_computed_blocks(request)
                if not kv.allocate_slots(
                    request, request.num_prompt_tokens - num_hit, num_hit, hits, cache=False
                ):
                    break
                request.num_cached_tokens = num_hit
                request.status = Status.WAITING_FOR_REMOTE_KVS
                skipped.append(waiting.popleft())
                if self.on_remote_kv is not None:
                    self.on_remote_kv(request, num_hit)
                continue
            first = request.scheduled_time == 0.0
            if request.num_computed_tokens == 0:
                hits, num_hit = kv.get_computed_blocks(request)
            else:
                hits, num_hit = [], 0
            num_new = self._capped(request.num_tokens - request.num_computed_tokens - num_hit)
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            if not kv.allocate_slots(request, num_new, num_hit, hits):
                break
            waiting.popleft()
            request.num_computed_tokens += num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            if first and self.on_first_scheduled is not None:
                self.on_first_scheduled(request, num_hit)
            request.status = Status.RUNNING
            self.running.append(request)
            self._add_to_batch(batch, request, num_new)
            budget -= num_new
            admitted += 1
            if request.lora and self.max_loras:
                loras.add(request.lora[0])
        if skipped:
            waiting.extendleft(reversed(skipped))
        return admitted

    def _capped(self, num_new: int) -> int:
        """vLLM's long-prefill bound: at most --long-prefill-token-threshold prompt tokens of one
        request in a step, when it is set and another request (running or waiting) could use the
        rest of the budget."""
        threshold = self.long_prefill_token_threshold
        if not 0 < threshold < num_new or len(self.running) + len(self.waiting) <= 1:
            return num_new
        return threshold

    def _finish_remote_kv(self, request: EngineRequest) -> None:
        """The pulled prompt KV is in place: cache its full blocks and recompute only the last token.
        After a failed pull (policy recompute) the request starts afresh as a local prefill: its
        reserved blocks go back and it is scheduled like a new request (prefix hits included)."""
        request.status = Status.WAITING
        if request.kv_failed:
            self.kv.free(request)
            request.remote_prefill = None
            request.num_cached_tokens = -1
            return
        if self.kv.enable_caching:
            self.kv.cache_blocks(request, request.num_prompt_tokens)
        request.num_computed_tokens = request.num_prompt_tokens - 1
        request.remote_prefill = None

    def _add_to_batch(self, batch: Batch, request: EngineRequest, num_new: int) -> None:
        """Add a request found by the slow path (the running loop's fast path appends decodes)."""
        computed = request.num_computed_tokens
        if num_new == 1 and computed + 1 == len(request.token_ids):
            batch.decodes.append(request)
        else:
            batch.chunks.append(request)
            batch.chunk_tokens.append(num_new)
        batch.total_tokens += num_new
        if num_new == 1:
            batch.decode_seqs += 1
            batch.decode_context_tokens += computed
        else:
            batch.prefill_chunks.append((num_new, computed))

    def preempt_all(self) -> None:
        """Give back every running request's blocks; they are recomputed when next scheduled."""
        batch = Batch()
        for request in reversed(self.running):
            self._preempt(request, batch)
        self.running.clear()

    def _preempt(self, request: EngineRequest, batch: Batch) -> None:
        self.kv.free(request)
        request.status = Status.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        if self.static_batching:
            self._cohort_left += 1  # it stays in its batch
        self.waiting.appendleft(request)
        batch.preempted.append(request)

    def _accepted_drafts(self, request: EngineRequest) -> int:
        """Drafted tokens accepted in one verify step: each of the k is accepted with the
        request's rate until the first rejection (the verified model's token replaces it)."""
        k = self.num_speculative_tokens
        if not k:
            return 0
        accepted = 0
        rate = request.acceptance_rate
        rng = self._spec_rng.random
        while accepted < k and rng() < rate:
            self.spec_accepted_per_pos[accepted] += 1
            accepted += 1
        self.spec_drafts += 1
        self.spec_draft_tokens += k
        self.spec_accepted_tokens += accepted
        return accepted

    # ------------------------------------------------------------------ after the step
    def update(
        self, batch: Batch, now: float = 0.0
    ) -> tuple[list[EngineRequest], list[EngineRequest], list[EngineRequest]]:
        """Advance computed tokens and sample one token per request that reached its end.

        Stamps token times (`now`) and records inter-token gaps into `self.itl` (a histogram
        with `bounds`, `counts`, `sum`) in the same pass, to keep the per-step cost low.
        Returns (requests that got a token, those that got their first one, those that finished).
        """
        produced: list[EngineRequest] = []
        first_tokens: list[EngineRequest] = []
        finished: list[EngineRequest] = []
        output_ids = self.output_ids
        n_out = len(output_ids)
        max_len = self.max_model_len
        running_status = Status.RUNNING
        itl = self.itl
        bounds, counts = (itl.bounds, itl.counts) if itl is not None else ((), [0])
        gaps = 0.0
        ready: list[EngineRequest] = []
        for request, num_new in zip(batch.chunks, batch.chunk_tokens, strict=True):
            if request.status is running_status:
                request.num_computed_tokens += num_new
                if request.num_computed_tokens >= len(request.token_ids):
                    ready.append(request)  # the last chunk of a prompt: sample a token
        num_decodes = len(batch.decodes)
        for index, request in enumerate(chain(batch.decodes, ready)):
            if request.status is not running_status:
                continue  # aborted during the step
            tokens = request.token_ids
            emit = 1 + self._accepted_drafts(request) if index < num_decodes else 1
            for _ in range(emit):
                state = (request.rng_state * _LCG_A + _LCG_C) & _LCG_MASK
                request.rng_state = state
                token = output_ids[(state >> 8) % n_out]
                if request.token_rule is not None:
                    token = request.token_rule.choose(
                        token, len(tokens) - request.num_prompt_tokens, output_ids
                    )
                tokens.append(token)
                num_output = len(tokens) - request.num_prompt_tokens
                if num_output >= request.max_tokens or len(tokens) >= max_len:
                    request.finish_reason = FinishReason.LENGTH
                elif (
                    request.stop_token_ids
                    and token in request.stop_token_ids
                    and num_output >= request.min_tokens
                ):
                    request.finish_reason = FinishReason.STOP
                    request.stop_reason = token
                else:
                    continue
                break  # tokens drafted past the end are dropped, as vLLM drops them
            # the last token's KV is computed by the next step
            request.num_computed_tokens = len(tokens) - 1
            produced.append(request)
            last = request.last_token_time
            request.last_token_time = now
            if last == 0.0:
                first_tokens.append(request)
            else:
                counts[bisect_left(bounds, now - last)] += 1
                gaps += now - last
            if (
                request.stall_after
                and len(tokens) - request.num_prompt_tokens >= request.stall_after
            ):
                request.stall = True  # failure injection: this stream stops producing tokens
            if request.finish_reason is None:
                continue
            request.status = Status.FINISHED
            finished.append(request)
        if itl is not None:
            itl.sum += gaps
        if finished:
            self.running = [r for r in self.running if r.status is Status.RUNNING]
        return produced, first_tokens, finished
