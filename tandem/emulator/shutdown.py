"""SIGTERM as vLLM 0.32 handles it (docs/protocols.md §9), by `--shutdown-timeout`.

N > 0 ("drain"): the port stays open and /health keeps answering 200; a new completion is
refused with a 500 (`cannot schedule new futures after shutdown`); the requests the engine holds
run to their end, and a prefill engine's KV leases stay until the decode engines have pulled them
(or the leases expire), for at most N seconds, after which what is left is aborted; then the port
closes and the process exits.

0 (vLLM's default, "abort"): vLLM kills its engine core at once and closes its port; no request
in flight finishes. Racing the engine core's own abort against its SIGKILL, vLLM either ends
them aborted (a stream's `finish_reason: abort`, a plain request's connection reset as it
exits), or leaves them with nothing more while its HTTP server waits for their handlers, which
never end, so that the process exits only when every client has given up or on SIGKILL (a
kubelet's grace period). The emulator does the latter, the worse of the two.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from tandem.emulator.engine import EmulatedEngine
from tandem.emulator.errors import APIError

log = logging.getLogger("tandem.emulator.shutdown")

POLL_S = 0.05
REFUSAL = "cannot schedule new futures after shutdown"  # vLLM 0.32's words, status 500


def refusal() -> APIError:
    """What a completion that arrives after SIGTERM gets."""
    return APIError(500, REFUSAL, "InternalServerError")


def has_work(engine: EmulatedEngine) -> bool:
    """vLLM's EngineCore.has_work in drain mode: requests running or waiting, or finished ones
    whose blocks the KV connector still holds for a pull."""
    leases = engine.connector.leases if engine.connector is not None else {}
    return engine.scheduler.has_work() or bool(leases)


def abort_all(engine: EmulatedEngine) -> int:
    """Ends every request the engine holds with finish_reason `abort`; returns how many."""
    held = [*engine.scheduler.running, *engine.scheduler.waiting]
    for request in held:
        engine.abort(request)
    return len(held)


async def shut_down(
    engine: EmulatedEngine,
    timeout_s: float,
    close_port: Callable[[], Awaitable[None]],
    in_flight: Callable[[], int],
) -> None:
    """What the engine does between SIGTERM and the process exit; returns when it may exit."""
    engine.shutting_down = True
    started = time.monotonic()
    # Polled below: requests and leases end in many places (steps, aborts, NIXL notifications),
    # and clients leave when they choose.
    if timeout_s <= 0:
        held = len(engine.scheduler.running) + len(engine.scheduler.waiting)
        log.info("[shutdown] mode=abort: engine stopped with %d requests unanswered", held)
        await engine.stop()
        await close_port()
        while in_flight():  # noqa: ASYNC110
            await asyncio.sleep(POLL_S)
        return
    log.info("[shutdown] mode=drain timeout=%ss", timeout_s)
    deadline = started + timeout_s
    while has_work(engine) and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(POLL_S)
    if has_work(engine):
        log.info("[shutdown] drain timed out: aborting %d requests", abort_all(engine))
    while in_flight() and time.monotonic() < deadline + 1:  # noqa: ASYNC110
        await asyncio.sleep(POLL_S)  # the last chunks reach their clients
    log.info("[shutdown] drained in %.2f s", time.monotonic() - started)
    await close_port()
