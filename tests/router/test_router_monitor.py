"""The engine monitor against a real HTTP server on 127.0.0.1: /health decides health, a slow
/metrics only keeps the last load figures."""

from __future__ import annotations

import asyncio
from collections import Counter

from aiohttp import web

from tandem.common.ports import free_port
from tandem.router.engines import Engine, EnginePool
from tandem.router.monitor import EngineMonitor

EXPOSITION = (
    b"vllm:num_requests_waiting 3\nvllm:num_requests_running 5\nvllm:kv_cache_usage_perc 0.5\n"
)


async def serve(
    health_status: list[int],
    metrics_delay_s: list[float],
    reads: Counter[str] | None = None,
    scraped: asyncio.Event | None = None,
) -> tuple[web.AppRunner, str]:
    """The fake engine; `reads` counts the requests per path, `scraped` is set at each /metrics."""
    reads = Counter() if reads is None else reads

    async def health(_: web.Request) -> web.Response:
        reads["/health"] += 1
        return web.Response(status=health_status[0])

    async def metrics(_: web.Request) -> web.Response:
        reads["/metrics"] += 1
        if scraped is not None:
            scraped.set()
        await asyncio.sleep(metrics_delay_s[0])
        return web.Response(body=EXPOSITION)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def test_slow_metrics_keep_the_engine_healthy_and_its_last_load() -> None:
    health_status, delay = [200], [0.0]
    runner, url = await serve(health_status, delay)
    pool = EnginePool()
    engine = pool.upsert(Engine(url=url, roles=frozenset({"decode"})))
    monitor = EngineMonitor(pool, scrape_s=0.05, health_s=60.0, timeout_s=0.3)
    try:
        await monitor.check_all(health=True)
        assert engine.healthy
        assert (engine.waiting, engine.running) == (3.0, 5.0)

        delay[0] = 1.0  # /metrics slower than the monitor's timeout; /health still answers
        await monitor.check_all(health=False)
        assert engine.healthy, "a slow /metrics is no reason to stop routing to an engine"
        assert (engine.waiting, engine.running) == (3.0, 5.0)

        health_status[0] = 503  # the failed scrape makes the next pass ask /health
        await monitor.check_all(health=False)
        assert not engine.healthy

        health_status[0], delay[0] = 200, 0.0
        await monitor.check_all(health=False)
        assert engine.healthy
    finally:
        await monitor.stop()
        await runner.cleanup()


async def test_a_pass_made_before_start_is_the_loops_first() -> None:
    """`tandem relay` checks its engine before it serves, then starts the loop: the loop waits a
    scrape interval for its first pass (load only) and the health interval for its next /health."""
    reads: Counter[str] = Counter()
    scraped = asyncio.Event()
    runner, url = await serve([200], [0.0], reads, scraped)
    pool = EnginePool()
    pool.upsert(Engine(url=url, roles=frozenset({"decode"})))
    monitor = EngineMonitor(pool, scrape_s=0.4, health_s=60.0, timeout_s=0.3)
    try:
        await monitor.check_all(health=True)
        scraped.clear()
        monitor.start()
        await asyncio.sleep(0.2)
        assert reads == Counter({"/health": 1, "/metrics": 1})
        await asyncio.wait_for(scraped.wait(), 5)
        assert reads == Counter({"/health": 1, "/metrics": 2})
    finally:
        await monitor.stop()
        await runner.cleanup()
