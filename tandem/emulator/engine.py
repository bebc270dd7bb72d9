"""The engine loop: steps the scheduler, spends each step's simulated time, delivers tokens."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
import zlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from tandem.common.block_hash import hash_function, none_hash
from tandem.emulator.config import EngineConfig
from tandem.emulator.gpu_share import SharedGPU
from tandem.emulator.kv_cache import KVCacheManager
from tandem.emulator.kv_events import KVEventPublisher
from tandem.emulator.lora import Adapter, LoraAdapters
from tandem.emulator.metrics import EmulatedGPU, EngineMetrics, SpecDecodeCounters
from tandem.emulator.profile import TimingProfile
from tandem.emulator.request import EngineRequest, FinishReason, Status
from tandem.emulator.sampling import TokenRule
from tandem.emulator.scheduler import Batch, Scheduler
from tandem.emulator.sleep import SleepMode
from tandem.emulator.tokenizer import PromptTokenizer

if TYPE_CHECKING:
    from tandem.emulator.pd import PDConnector

log = logging.getLogger("tandem.emulator.engine")


@dataclass
class StepStats:
    """Cumulative engine-loop accounting (exposed at /emulator/stats)."""

    steps: int = 0
    scheduler_cpu_s: float = 0.0  # schedule() + update() + KV/metrics bookkeeping, CPU time
    handoff_cpu_s: float = 0.0  # waking the HTTP handlers of the requests with new tokens
    simulated_s: float = 0.0  # sum of profile step times (before the speed-up)
    tokens: int = 0
    max_batch: int = 0
    shared_gpu_wait_s: float = 0.0  # waiting for other engines' steps on a shared GPU

    def as_dict(self) -> dict[str, Any]:
        ratio = self.scheduler_cpu_s / self.simulated_s if self.simulated_s else 0.0
        return {**asdict(self), "overhead_ratio": ratio}


class EmulatedEngine:
    """One emulated vLLM engine: its scheduler, KV cache, metrics and the loop that steps them."""

    def __init__(
        self,
        config: EngineConfig,
        profile: TimingProfile,
        tokenizer: PromptTokenizer,
        engine_id: str | None = None,
    ) -> None:
        self.config = config
        self.profile = profile
        self.tokenizer = tokenizer
        self.engine_id = engine_id or (
            (config.kv_transfer_config.engine_id if config.kv_transfer_config else None)
            or str(uuid.uuid4())
        )
        self.max_model_len = config.resolved_max_model_len()
        self.num_gpu_blocks = config.num_gpu_blocks_override or profile.num_gpu_blocks(
            config.block_size, config.gpu_memory_utilization, config.max_num_batched_tokens
        )
        events_cfg = config.kv_events_config
        self.events_enabled = bool(
            events_cfg and events_cfg.enable_kv_cache_events and events_cfg.publisher == "zmq"
        )
        self.spec = config.speculative_config
        self.kv = KVCacheManager(
            num_blocks=self.num_gpu_blocks,
            block_size=config.block_size,
            max_model_len=self.max_model_len,
            enable_caching=config.enable_prefix_caching,
            hash_fn=hash_function(config.prefix_caching_hash_algo),
            root_digest=none_hash(config.prefix_caching_hash_algo),
            events=self.events_enabled,
        )
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            output_ids=tokenizer.output_ids,
            enable_chunked_prefill=config.enable_chunked_prefill,
            num_speculative_tokens=self.spec.num_speculative_tokens if self.spec else 0,
            static_batching=config.batching == "static",
            seed=config.seed,
            max_loras=config.lora.max_loras if config.lora else None,
        )
        self.lora = LoraAdapters(config.lora, config.served_model_name) if config.lora else None
        self.scheduler.on_first_scheduled = self._on_first_scheduled
        self.scheduler.on_remote_kv = self._on_remote_kv
        self.metrics = EngineMetrics(
            config.served_model_name,
            engine=str(config.data_parallel_rank),
            kv_connector=config.kv_transfer_config is not None
            and bool(config.kv_transfer_config.kv_connector),
        )
        self.metrics.cache_config_info = self._cache_config_info()
        self.metrics.gpu = EmulatedGPU(
            profile.gpu_memory(),
            kv_block_bytes=profile.model.kv_bytes_per_token * config.block_size,
            engine_id=self.engine_id,
        )
        if self.spec is not None:
            self.metrics.spec = SpecDecodeCounters(self.spec.num_speculative_tokens)
        self.metrics.read_gauges = self._refresh_gauges
        self.scheduler.itl = self.metrics.itl
        self.publisher: KVEventPublisher | None = None
        self.connector: PDConnector | None = None
        self.stats = StepStats()
        self.speedup = config.speedup
        self.faults = config.faults
        self._fault_rng = random.Random(config.faults.seed)
        self.sleep_mode = SleepMode(self)
        self.shared_gpu = SharedGPU(config.shared_gpu) if config.shared_gpu else None
        self._wake = asyncio.Event()
        self.idle = asyncio.Event()  # set each time the loop runs out of work
        self._task: asyncio.Task[None] | None = None
        self.dead = False
        self.shutting_down = False  # SIGTERM came: new requests are refused (shutdown.py)
        self.stopped = False
        self.num_finished = 0

    # ------------------------------------------------------------------ lifecycle
    def _cache_config_info(self) -> dict[str, str]:
        cfg = self.config
        return {
            "block_size": str(cfg.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(cfg.enable_prefix_caching),
            "gpu_memory_utilization": str(cfg.gpu_memory_utilization),
            "is_attention_free": "False",
            "kv_cache_size_tokens": str(self.num_gpu_blocks * cfg.block_size),
            "kv_cache_max_concurrency": str(
                round(self.num_gpu_blocks * cfg.block_size / self.max_model_len, 2)
            ),
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(self.num_gpu_blocks),
            "num_gpu_blocks_override": str(cfg.num_gpu_blocks_override),
            "prefix_caching_hash_algo": cfg.prefix_caching_hash_algo,
            "sliding_window": "None",
            "user_specified_block_size": "True",
        }

    async def start(self) -> None:
        events_cfg = self.config.kv_events_config
        if self.events_enabled and events_cfg is not None:
            self.publisher = KVEventPublisher(
                events_cfg, self.config.kv_events_bind_host, self.config.data_parallel_rank
            )
            self.publisher.start()
        if (
            self.config.kv_transfer_config is not None
            and self.config.kv_transfer_config.kv_connector
        ):
            from tandem.emulator.pd import PDConnector

            self.connector = PDConnector(self)
            await self.connector.start()
        self._task = asyncio.get_running_loop().create_task(self._guarded_run(), name="engine-loop")

    async def stop(self) -> None:
        """Stops the loop, the KV connector and the event publisher; a second call does nothing."""
        if self.stopped:
            return
        self.stopped = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.connector is not None:
            await self.connector.stop()
        if self.publisher is not None:
            await self.publisher.close()
        if self.shared_gpu is not None:
            self.shared_gpu.close()

    # ------------------------------------------------------------------ requests
    def new_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        *,
        seed: int | None = None,
        min_tokens: int = 0,
        stop_token_ids: tuple[int, ...] = (),
        logit_bias: Mapping[int, float] | None = None,
        ignore_eos: bool = False,
        cache_salt: str | None = None,
        acceptance_rate: float | None = None,
        adapter: Adapter | None = None,
    ) -> EngineRequest:
        """A request for this engine; `acceptance_rate` (speculative decoding) defaults to
        --spec-acceptance-rate."""
        now = asyncio.get_running_loop().time()
        base = seed if seed is not None else zlib.crc32(repr(prompt_token_ids[-64:]).encode())
        request = EngineRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            max_tokens=max_tokens,
            arrival_time=now,
            rng_state=(base ^ self.config.seed) & 0xFFFFFFFF,
            min_tokens=min_tokens,
            stop_token_ids=stop_token_ids,
            token_rule=TokenRule.of(logit_bias or {}, stop_token_ids, min_tokens),
            ignore_eos=ignore_eos,
            cache_salt=cache_salt,
            lora=(adapter.name, adapter.path) if adapter else None,
            lora_id=adapter.lora_id if adapter else None,
            acceptance_rate=self.config.spec_acceptance_rate
            if acceptance_rate is None
            else min(max(acceptance_rate, 0.0), 1.0),
        )
        faults = self.faults
        if faults.stall_after_tokens and self._fault_rng.random() < faults.stall_rate:
            request.stall_after = faults.stall_after_tokens
        return request

    def add_request(self, request: EngineRequest) -> None:
        if self.sleep_mode.holds_new:
            self.sleep_mode.hold(request)
        else:
            self.scheduler.add(request)
        m = self.metrics
        m.request_params_n.observe(1)
        m.request_params_max_tokens.observe(request.max_tokens)
        m.request_max_num_generation_tokens.observe(request.max_tokens)
        self._wake.set()

    def abort(self, request: EngineRequest, reason: FinishReason = FinishReason.ABORT) -> None:
        """Stop a request (client gone, stop string, KV load failure); releases its blocks."""
        if request.status is Status.FINISHED:
            return
        self.scheduler.finish(request, reason, free=True)
        self._record_finished(request, asyncio.get_running_loop().time())
        request.wake()
        self._wake.set()

    def fail(self, request: EngineRequest, message: str) -> None:
        request.error = message
        self.abort(request, FinishReason.ERROR)

    def wake(self) -> None:
        self._wake.set()

    # ------------------------------------------------------------------ callbacks
    def _on_first_scheduled(self, request: EngineRequest, num_hit: int) -> None:
        request.scheduled_time = asyncio.get_running_loop().time()

    def _on_remote_kv(self, request: EngineRequest, num_hit: int) -> None:
        assert self.connector is not None
        self.connector.start_pull(request, num_hit)

    # ------------------------------------------------------------------ the loop
    async def _guarded_run(self) -> None:
        """Run the loop; if it dies, fail every request and report unhealthy (/health 503)."""
        try:
            await self._run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("engine loop failed; the engine is dead")
            self.dead = True
            for request in [*self.scheduler.running, *self.scheduler.waiting]:
                self.fail(request, "Internal server error")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        scheduler = self.scheduler
        stats = self.stats
        profile = self.profile
        speedup = self.speedup
        faults = self.faults
        spec = self.spec
        gpu = self.metrics.gpu
        assert gpu is not None
        gpu.clock = loop.time
        next_start = 0.0
        cpu = time.thread_time
        while True:
            if not scheduler.has_work() or not self._can_step():
                await self._idle()
                next_start = 0.0
                continue
            now = loop.time()
            window = self._batch_window(now)
            if window > 0:
                await asyncio.sleep(window)
                continue
            # back-to-back steps start at the previous deadline, so the CPU spent between steps
            # is part of the simulated step time instead of being added on top of it
            start = next_start if now - next_start < 0.05 else now
            cpu0 = cpu()
            batch = scheduler.schedule()
            cpu_schedule = cpu() - cpu0
            if not batch:
                await self._idle()
                next_start = 0.0
                continue
            step_s = profile.step_seconds(
                batch.prefill_chunks, batch.decode_seqs, batch.decode_context_tokens
            )
            if spec is not None:
                step_s += profile.speculative.seconds(
                    spec.proposer,
                    spec.num_speculative_tokens,
                    batch.decode_seqs,
                    batch.decode_context_tokens,
                )
            if self.lora is not None:
                step_s += self.lora.swap_in_seconds(
                    dict.fromkeys(r.lora[0] for r in batch.requests if r.lora)
                )
            simulated = step_s
            if (
                faults.slow_token_probability
                and self._fault_rng.random() < faults.slow_token_probability
            ):
                step_s += faults.slow_token_delay_s
            if self.shared_gpu is not None:
                waited = loop.time()
                await self.shared_gpu.acquire()
                stats.shared_gpu_wait_s += loop.time() - waited
                start = max(start, loop.time())
            deadline = start + step_s / speedup
            gpu.step(start, deadline, self.kv.num_used_blocks(), batch.total_tokens)
            delay = deadline - loop.time()
            try:
                await asyncio.sleep(delay if delay > 0 else 0)
            finally:
                if self.shared_gpu is not None:
                    self.shared_gpu.release()
            cpu1 = cpu()
            produced = self._finish_step(batch, max(deadline, start))
            cpu2 = cpu()
            self._hand_off(produced)
            stats.scheduler_cpu_s += cpu_schedule + cpu2 - cpu1
            stats.handoff_cpu_s += cpu() - cpu2
            stats.simulated_s += simulated
            stats.steps += 1
            stats.tokens += batch.total_tokens
            if batch.size > stats.max_batch:
                stats.max_batch = batch.size
            next_start = deadline

    def _batch_window(self, now: float) -> float:
        """Static batching: seconds to wait for a fuller batch before forming one (an idle
        engine, fewer than max_num_seqs waiting, the oldest waiting less than the window)."""
        scheduler = self.scheduler
        if not scheduler.static_batching or scheduler.running or not scheduler.waiting:
            return 0.0
        if len(scheduler.waiting) >= scheduler.max_num_seqs:
            return 0.0
        oldest = scheduler.waiting[0].arrival_time
        return oldest + self.config.static_batch_wait_s / self.speedup - now

    async def _idle(self) -> None:
        """Nothing to compute: flush events and gauges, then sleep until a request arrives."""
        self._publish_events()
        self._refresh_gauges()
        self.idle.set()
        self._wake.clear()
        await self._wake.wait()

    def _can_step(self) -> bool:
        scheduler = self.scheduler
        if not self.sleep_mode.can_schedule:
            return False
        if scheduler.running:
            return True
        return any(
            r.status is not Status.WAITING_FOR_REMOTE_KVS or r.kv_ready for r in scheduler.waiting
        )

    def _finish_step(self, batch: Batch, now: float) -> list[EngineRequest]:
        """Account one computed step; returns the requests whose streams have news."""
        produced, first_tokens, finished = self.scheduler.update(batch, now)
        m = self.metrics
        # vLLM's iteration tokens: prompt tokens computed plus tokens generated in the step
        m.iteration_tokens.observe(batch.total_tokens - batch.decode_seqs + len(produced))
        if batch.preempted:
            m.num_preemptions.inc(len(batch.preempted))
        for request in first_tokens:
            self._on_first_token(request, now)
        m.generation_tokens.value += len(produced)
        for request in finished:
            self._on_finished(request, now)
        self._publish_events()
        self._refresh_gauges()
        return produced

    @staticmethod
    def _hand_off(produced: list[EngineRequest]) -> None:
        """Wake the HTTP handlers of requests that got tokens (vLLM's engine-to-frontend output)."""
        for request in produced:
            waiter = request.waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def _on_first_token(self, request: EngineRequest, now: float) -> None:
        m = self.metrics
        request.first_token_time = now
        m.ttft.observe(now - request.arrival_time)
        cached = max(request.num_cached_tokens, 0)
        external = request.num_external_tokens
        prompt = request.num_prompt_tokens
        computed = max(prompt - cached - external, 0)
        m.prompt_tokens.inc(prompt)
        m.prompt_tokens_by_source["local_compute"].inc(computed)
        m.prompt_tokens_by_source["local_cache_hit"].inc(cached)
        m.prompt_tokens_by_source["external_kv_transfer"].inc(external)
        m.prompt_tokens_cached.inc(cached + external)
        m.prompt_tokens_cached_by_source["device"].inc(cached)
        m.prompt_tokens_cached_by_source["p2p"].inc(external)
        # vLLM counts pulled tokens as computed here: only the local prefix cache is excluded
        m.prefill_kv_computed.observe(prompt - cached)
        if self.connector is not None:  # every request asks the connector for external tokens
            m.external_prefix_cache_queries.inc(prompt)
            m.external_prefix_cache_hits.inc(external)

    def _on_finished(self, request: EngineRequest, now: float) -> None:
        if request.do_remote_decode and self.connector is not None:
            self.connector.hold_blocks(request)
        else:
            self.kv.free(request)
        self._record_finished(request, now)

    def _record_finished(self, request: EngineRequest, now: float) -> None:
        m = self.metrics
        reason = request.finish_reason.value if request.finish_reason else "abort"
        m.request_success[reason].inc()
        scheduled = request.scheduled_time or now
        first = request.first_token_time or now
        last = request.last_token_time or now
        m.e2e.observe(now - request.arrival_time)
        m.queue_time.observe(max(scheduled - request.arrival_time, 0.0))
        m.prefill_time.observe(max(first - scheduled, 0.0))
        m.decode_time.observe(max(last - first, 0.0))
        m.inference_time.observe(max(last - scheduled, 0.0))
        n_out = request.num_output_tokens
        if n_out > 1:
            m.tpot.observe((last - first) / (n_out - 1))
        m.request_prompt_tokens.observe(request.num_prompt_tokens)
        m.request_generation_tokens.observe(n_out)
        m.request_num_preemptions.observe(request.num_preemptions)
        self.num_finished += 1
        request.wake()

    def _publish_events(self) -> None:
        events = self.kv.pool.take_events() if self.events_enabled else None
        if events and self.publisher is not None:
            self.publisher.publish(events)

    def _refresh_gauges(self) -> None:
        m = self.metrics
        scheduler = self.scheduler
        m.num_running = len(scheduler.running)
        m.num_waiting = len(scheduler.waiting)
        m.num_waiting_deferred = 0
        if self.connector is not None:
            deferred = [r for r in scheduler.waiting if r.status is Status.WAITING_FOR_REMOTE_KVS]
            m.num_waiting_deferred = len(deferred)
            m.kv_fetch_in_progress = sum(1 for r in deferred if not r.kv_ready)
            m.kv_fetch_completed_waiting = len(deferred) - m.kv_fetch_in_progress
        m.kv_cache_usage = self.kv.usage()
        if self.lora is not None:
            running = {r.lora[0] for r in scheduler.running if r.lora}
            self.lora.record(running, (r.lora[0] for r in scheduler.waiting if r.lora))
            m.lora = self.lora
            if len(running) >= self.lora.config.max_loras:  # held back by the LoRA budget
                m.num_waiting_deferred += sum(
                    1 for r in scheduler.waiting if r.lora and r.lora[0] not in running
                )
        if m.gpu is not None:
            m.gpu.kv_blocks_in_use = self.kv.num_used_blocks()
        if m.spec is not None:
            m.spec.read(scheduler)
        m.prefix_cache_queries.value = self.kv.queries
        m.prefix_cache_hits.value = self.kv.hits

    def reset_prefix_cache(self) -> bool:
        ok = self.kv.reset_prefix_cache()
        # vLLM publishes AllBlocksCleared with the next engine step's events
        return ok

    def load(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)
