"""`tandem emulate`: run one vLLM-compatible engine emulator process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys

import zmq
from aiohttp import web

from tandem.emulator.api import OpenAIServer
from tandem.emulator.args import parse_args
from tandem.emulator.config import EngineConfig
from tandem.emulator.engine import EmulatedEngine
from tandem.emulator.profile import load_profile
from tandem.emulator.shutdown import shut_down
from tandem.emulator.tokenizer import PromptTokenizer

log = logging.getLogger("tandem.emulator")


def build_engine(config: EngineConfig) -> EmulatedEngine:
    profile = load_profile(config.timing_profile)
    tokenizer_dir = config.tokenizer_dir
    tokenizer = PromptTokenizer(str(tokenizer_dir) if tokenizer_dir else None)
    return EmulatedEngine(config, profile, tokenizer)


async def serve(
    config: EngineConfig, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None
) -> None:
    """Start the engine and the HTTP server; run until `stop` is set or SIGTERM/SIGINT."""
    if config.faults.startup_delay_s:
        log.info("failure injection: start-up delay %.1f s", config.faults.startup_delay_s)
        await asyncio.sleep(config.faults.startup_delay_s)
    engine = build_engine(config)
    await engine.start()
    server = OpenAIServer(engine)
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    host = config.host or "0.0.0.0"
    site = web.TCPSite(runner, host, config.port, reuse_address=True, backlog=4096)
    await site.start()
    log.info(
        "engine %s serving %s on http://%s:%d (profile %s, speed-up %g, %d KV blocks of %d tokens)",
        engine.engine_id,
        config.served_model_name,
        host,
        config.port,
        engine.profile.name,
        config.speedup,
        engine.num_gpu_blocks,
        config.block_size,
    )
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
        await shut_down(engine, config.shutdown_timeout_s, site.stop, lambda: server.in_flight)
    finally:
        await runner.cleanup()
        await engine.stop()


def main(argv: list[str]) -> int:
    try:
        config, ignored, level = parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if ignored:
        log.warning("ignoring vLLM flags the emulator does not model: %s", " ".join(ignored))
    import uvloop

    try:
        uvloop.run(serve(config))
    except KeyboardInterrupt:
        pass
    except (ValueError, OSError, zmq.ZMQError) as error:  # a bad option, a port in use: one line
        log.error("cannot start the engine: %s", error)
        return 1
    return 0
