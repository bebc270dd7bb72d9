"""Engine monitor: scrapes each engine's /metrics at a short interval and checks /health."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from tandem.router.engine_metrics import parse_engine_load
from tandem.router.engines import Engine, EnginePool
from tandem.router.lora import adapters_of, parse_lora_slots
from tandem.router.lora_admin import (
    LOAD_PATH,
    RuntimeAdapters,
    parse_adapter_request,
    record_answers,
    send_to_engines,
)
from tandem.router.upstream import (
    AuthHeader,
    UpstreamError,
    UpstreamPool,
    Upstreams,
    UpstreamTimeout,
)

log = logging.getLogger("tandem.router.monitor")


class EngineMonitor:
    """One loop over all engines: load every `scrape_s`, health every `health_s`.

    An engine is healthy while /health answers 200; one failed check marks it unhealthy (the proxy
    also marks an engine unhealthy at once on a refused connection) and the next good one restores it.
    A /health that times out is no failure while a decode stream from the engine reached the
    router within the probe's bound (`Engine.heard_at`): an API server too busy streaming to
    answer its probe in time (seen for tens of seconds on a loaded CPU machine) would otherwise
    turn its new requests into 503s while it serves the old ones; a stream that stalls too ends
    this within the bound.
    A scrape whose connection is refused marks the engine unhealthy at once, as the proxy does.
    An engine the proxy saw draining stays out of the candidates until a health check fails or a
    scrape's connection is refused (it exited): a new process on its address is a candidate again.
    The loop's next pass comes `scrape_s` after the last one ended, a pass made before `start()`
    included (the relay checks its engine before it serves).
    """

    def __init__(
        self,
        pool: EnginePool,
        scrape_s: float,
        health_s: float,
        timeout_s: float = 2.0,
        auth: AuthHeader | None = None,
        runtime_adapters: RuntimeAdapters | None = None,
        load_timeout_s: float = 60.0,
    ):
        self.pool = pool
        self.scrape_s = scrape_s
        self.health_s = health_s
        self.timeout_s = timeout_s
        self.upstreams = Upstreams(connect_timeout=timeout_s, auth=auth)
        self.runtime_adapters = runtime_adapters
        self.load_timeout_s = load_timeout_s
        self._task: asyncio.Task[None] | None = None
        self._last_health = float("-inf")  # not 0.0: monotonic() starts near 0 at boot
        self._last_pass_end = float("-inf")  # a pass made before start() counts as the first
        self._suspect: set[str] = set()  # engines whose last /metrics failed: /health next pass

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.upstreams.close()

    async def check_all(self, health: bool) -> None:
        if health:
            self._last_health = time.monotonic()
        try:
            engines = list(self.pool.engines.values())
            await asyncio.gather(*(self._check(e, health) for e in engines))
            if health and self.runtime_adapters is not None:
                await self._replay_adapters(self.runtime_adapters, engines)
            known = set(self.pool.engines)
            self._suspect &= known
            for url in [u for u in list(self.upstreams.pools) if u not in known]:
                self.upstreams.drop(url)
        finally:
            self._last_pass_end = time.monotonic()

    async def _check(self, engine: Engine, health: bool) -> None:
        pool = self.upstreams.pool(engine.url)
        was_healthy = engine.healthy
        if health or not engine.healthy or engine.id in self._suspect:
            self._suspect.discard(engine.id)
            try:
                response = await pool.request("GET", "/health", idle_s=self.timeout_s)
                await response.read()
                ok = response.status == 200
                reason = f"/health answered {response.status}"
            except UpstreamTimeout as exc:
                # streamed to us within the probe's bound: busy, not down
                ok = time.perf_counter() - engine.heard_at <= self.timeout_s
                reason = str(exc)
                if ok:
                    log.debug("engine %s streams but its /health timed out: busy", engine.id)
            except UpstreamError as exc:
                ok, reason = False, str(exc)
            if ok != engine.healthy:
                log.info(
                    "engine %s is now %s", engine.id, "healthy" if ok else f"unhealthy: {reason}"
                )
            engine.healthy = ok
            engine.draining = engine.draining and ok  # a drained engine's exit ends its drain
            engine.consecutive_failures = 0 if ok else engine.consecutive_failures + 1
        if engine.healthy:
            await self._scrape_load(engine, pool)
            if health or not was_healthy:  # and at once when it (re)joins: its adapters
                await self._read_adapters(engine, pool)

    async def _scrape_load(self, engine: Engine, pool: UpstreamPool) -> None:
        """Queue depth and KV usage from /metrics. A slow or failed scrape keeps the last values:
        health is /health's to decide (a busy engine's /metrics can take seconds to render), and a
        dead engine fails its health check, which the next pass makes, or the proxy's next
        connection; a refused connection marks it down at once."""
        try:
            response = await pool.request("GET", "/metrics", idle_s=self.timeout_s)
            text = await response.read()
        except UpstreamError as exc:
            log.debug("engine %s: /metrics not read: %s", engine.id, exc)
            self._suspect.add(engine.id)
            if exc.connect and not isinstance(exc, UpstreamTimeout):
                # Refused: the process is gone (a drained one, too); down until /health answers.
                engine.healthy = engine.draining = False
            return
        if response.status == 200:
            load = parse_engine_load(text)
            engine.waiting = load["waiting"]
            engine.running = load["running"]
            engine.kv_usage = load["kv_usage"]
            if load["kv_capacity"] > 0.0:
                engine.kv_capacity = load["kv_capacity"]
            engine.lora = parse_lora_slots(text)
            engine.pending_at_scrape = engine.pending
            engine.decoding_at_scrape = engine.in_flight - engine.pending

    async def _read_adapters(self, engine: Engine, pool: UpstreamPool) -> None:
        """The LoRA adapters the engine serves, from its /v1/models (at health-check pace: they
        change only when loaded or unloaded). A failed read keeps the last list."""
        try:
            response = await pool.request("GET", "/v1/models", idle_s=self.timeout_s)
            text = await response.read()
        except UpstreamError as exc:
            log.debug("engine %s: /v1/models not read: %s", engine.id, exc)
            return
        if response.status == 200:
            try:
                engine.adapters = adapters_of(json.loads(text))
            except ValueError:
                log.debug("engine %s: /v1/models is not JSON", engine.id)

    async def _replay_adapters(self, adapters: RuntimeAdapters, engines: list[Engine]) -> None:
        """Loads runtime adapters on the engines that joined without them (`RuntimeAdapters`)."""

        async def replay(engine: Engine, name: str, raw: bytes) -> None:
            answers = await send_to_engines(
                [engine], self.upstreams, LOAD_PATH, raw, self.load_timeout_s
            )
            parsed = parse_adapter_request(raw)
            record_answers(answers, True, name, parsed[1] if parsed else None)
            adapters.record(answers, True, name, raw)
            if answers[0].status == 200:
                log.info(
                    "runtime adapter %s loaded on engine %s, which joined without it",
                    name,
                    engine.id,
                )

        await asyncio.gather(*(replay(*owed) for owed in adapters.replays(engines)))

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(max(self._last_pass_end + self.scrape_s - time.monotonic(), 0.0))
            health = time.monotonic() - self._last_health >= self.health_s
            try:
                await self.check_all(health)
            except Exception:
                log.exception("engine monitor pass failed")
