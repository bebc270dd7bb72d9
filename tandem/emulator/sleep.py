"""vLLM's sleep mode for an emulated engine: /sleep, /wake_up, /is_sleeping with measured costs."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Literal

from tandem.emulator.request import EngineRequest, Status

if TYPE_CHECKING:
    from tandem.emulator.engine import EmulatedEngine

PauseMode = Literal["abort", "wait", "keep"]
MEMORY_TAGS = frozenset({"weights", "kv_cache"})
SCHEDULING = "scheduling"


class SleepMode:
    """One engine's sleep state, as vLLM 0.32 keeps it (`--enable-sleep-mode`).

    sleep(level, mode): new requests are held (answered after the wake); the engine's own
    requests are aborted (`abort`, vLLM's default), finished first (`wait`) or kept (`keep`:
    running ones are preempted and recomputed after the wake, since their KV is lost). Level 0
    only pauses scheduling; level 1 offloads the weights to CPU and discards the KV cache;
    level 2 discards both. Level >= 1 empties the prefix cache and takes the profile's
    `sleep.sleep_seconds`; the GPU's used memory drops to what lies outside PyTorch.

    wake_up(tags): brings back `weights` and/or `kv_cache` (all when no tags), costing
    `sleep.wake_weights_seconds` and `sleep.map_s`; scheduling resumes, and held requests enter,
    once both are resident. Waking from level 2 charges a reload of the weights, which a real
    vLLM needs as a separate call (its level-2 wake maps memory with no weights in it).
    Operations run one at a time, in the order they arrive.
    """

    def __init__(self, engine: EmulatedEngine) -> None:
        self.engine = engine
        self.asleep: set[str] = set()
        self.level = 0
        self.draining = False
        self.held: list[EngineRequest] = []
        self._lock = asyncio.Lock()

    @property
    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    @property
    def holds_new(self) -> bool:
        """New requests wait outside the scheduler (a sleep is draining, or the engine sleeps)."""
        return self.draining or bool(self.asleep)

    @property
    def can_schedule(self) -> bool:
        return SCHEDULING not in self.asleep

    def hold(self, request: EngineRequest) -> None:
        self.held.append(request)

    async def sleep(self, level: int, mode: PauseMode) -> None:
        async with self._lock:
            engine = self.engine
            scheduler = engine.scheduler
            self.draining = True
            try:
                if mode == "abort":
                    for request in [*scheduler.running, *scheduler.waiting]:
                        engine.abort(request)
                elif mode == "wait":
                    while scheduler.has_work():
                        engine.idle.clear()
                        await engine.idle.wait()
                elif level >= 1:
                    scheduler.preempt_all()
                self.asleep.add(SCHEDULING)
                if level >= 1:
                    weights = engine.profile.gpu_memory().weights_bytes
                    seconds = engine.profile.sleep.sleep_seconds(level, weights)
                    await asyncio.sleep(seconds / engine.speedup)
                    engine.reset_prefix_cache()
                    self.asleep |= MEMORY_TAGS
                    self.level = level
            finally:
                self.draining = False
            self._show()

    async def wake_up(self, tags: list[str] | None) -> bool:
        """Bring back the tagged memory (all when None); True when fully awake."""
        async with self._lock:
            engine = self.engine
            sleep = engine.profile.sleep
            memory = self.asleep & MEMORY_TAGS
            waking = memory if tags is None else memory & set(tags)
            seconds = 0.0
            if "weights" in waking:
                weights = engine.profile.gpu_memory().weights_bytes
                seconds += sleep.wake_weights_seconds(self.level, weights)
            if "kv_cache" in waking:
                seconds += sleep.map_s
            await asyncio.sleep(seconds / engine.speedup)
            self.asleep -= waking
            if not self.asleep & MEMORY_TAGS:
                self.asleep.discard(SCHEDULING)
                self.level = 0
                held, self.held = self.held, []
                for request in held:
                    if request.status is not Status.FINISHED:
                        engine.scheduler.add(request)
                engine.wake()
            self._show()
            return not self.asleep

    def _show(self) -> None:
        """vLLM's vllm:engine_sleep_state and the emulated GPU's resident weights."""
        metrics = self.engine.metrics
        sleeping = bool(self.asleep)
        metrics.sleep_state = {
            "awake": 0.0 if sleeping else 1.0,
            "weights_offloaded": 1.0 if sleeping and self.level == 1 else 0.0,
            "discard_all": 1.0 if sleeping and self.level == 2 else 0.0,
        }
        if metrics.gpu is not None:
            metrics.gpu.weights_resident = "weights" not in self.asleep
