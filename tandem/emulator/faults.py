"""Failure injection at the HTTP edge: random 500s and a crash after N requests."""

from __future__ import annotations

import asyncio
import logging
import os
import random

from tandem.emulator.config import Faults

log = logging.getLogger("tandem.emulator.faults")


class FaultInjector:
    """Decides, per request, whether to fail it; ends the process after `crash_after_requests`.

    Engine-side faults (slow steps, stalled streams) live in the engine loop; the start-up delay
    in `main`.
    """

    def __init__(self, faults: Faults) -> None:
        self.faults = faults
        self.rng = random.Random(faults.seed + 1)
        self.completed = 0

    def should_fail(self) -> bool:
        return self.faults.error_rate > 0 and self.rng.random() < self.faults.error_rate

    def request_done(self) -> None:
        self.completed += 1
        limit = self.faults.crash_after_requests
        if limit and self.completed >= limit:
            log.error("failure injection: crashing after %d requests", self.completed)
            # let the last response leave the socket, then die without cleanup like a killed engine
            asyncio.get_running_loop().call_later(0.05, os._exit, 1)
