"""SIGTERM as vLLM 0.32 handles it (docs/protocols.md §8), for `--shutdown-timeout`.

0 (vLLM's default, "abort"): every request the engine holds ends at once with finish_reason
`abort`, and the process exits. N > 0 ("drain"): the engine refuses new requests, keeps running
the ones it holds and keeps a prefill's KV leases until the decode engines have pulled them (or
the leases expire), for at most N seconds; whatever is left then is aborted. The HTTP port stays
open throughout and closes when the process exits.
"""

from __future__ import annotations

import asyncio
import logging
import time

from tandem.emulator.engine import EmulatedEngine

log = logging.getLogger("tandem.emulator.shutdown")

POLL_S = 0.05


def has_work(engine: EmulatedEngine) -> bool:
    """vLLM's EngineCore.has_work in drain mode: requests running or waiting, or finished ones
    whose blocks a KV connector still holds for a pull."""
    leases = engine.connector.leases if engine.connector is not None else {}
    return engine.scheduler.has_work() or bool(leases)


def abort_all(engine: EmulatedEngine) -> int:
    """Ends every request the engine holds with finish_reason `abort`; returns how many."""
    held = [*engine.scheduler.running, *engine.scheduler.waiting]
    for request in held:
        engine.abort(request)
    return len(held)


async def shut_down(engine: EmulatedEngine, timeout_s: float) -> None:
    """What the engine does between SIGTERM and the process exit."""
    engine.shutting_down = True
    started = time.monotonic()
    if timeout_s <= 0:
        log.info("[shutdown] mode=abort: aborting %d in-flight requests", abort_all(engine))
    else:
        log.info("[shutdown] mode=drain timeout=%ss", timeout_s)
        deadline = started + timeout_s
        # Polled: requests and leases end in several places (steps, aborts, NIXL notifications).
        while has_work(engine) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(POLL_S)
        if has_work(engine):
            log.info("[shutdown] drain timed out: aborting %d requests", abort_all(engine))
    # The aborted requests' last chunks reach their clients before the port closes.
    await asyncio.sleep(POLL_S)
    log.info("[shutdown] requests done after %.2f s", time.monotonic() - started)
