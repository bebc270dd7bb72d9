"""The P/D prefill leg: a request's prefill asked of the prefill engines in rank order, and the KV
handoff of the one that answers, checked before the decode engine may pull from it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from tandem.router.call import Call, ClientError, Timing
from tandem.router.config import RouterConfig
from tandem.router.draining import refused_while_draining
from tandem.router.engines import Engine
from tandem.router.errors import error_body
from tandem.router.handoff import handoff_problem, prefill_body
from tandem.router.metrics import RouterMetrics
from tandem.router.upstream import UpstreamError, Upstreams

# the proxy's logger: the leg's warnings kept their name when it moved out of proxy.py
log = logging.getLogger("tandem.router.proxy")

_decode_json = msgspec.json.Decoder().decode
_RETRY_STATUSES = frozenset((502, 503, 504))


@dataclass(frozen=True, slots=True)
class Handoff:
    """A prefill engine's answer that the decode engine may pull from."""

    engine: Engine
    params: dict[str, Any]


class PrefillLeg:
    """`on_failure(pool, engine, error)` counts an upstream failure (the proxy's bookkeeping)."""

    def __init__(
        self,
        config: RouterConfig,
        upstreams: Upstreams,
        metrics: RouterMetrics,
        on_failure: Callable[[str, Engine, UpstreamError], None],
    ) -> None:
        self.config = config
        self.upstreams = upstreams
        self.metrics = metrics
        self.on_failure = on_failure

    async def prefill(self, call: Call, ranking: list[Any]) -> Handoff | None:
        """Asks prefill engines in rank order; None to prefill on the decode engine instead.

        An engine's 4xx is the client's mistake and goes back as sent (ClientError); a 5xx or a
        broken connection tries the next engine; an answer naming another host is a 502.
        """
        metrics = self.metrics
        timing = call.timing
        payload = prefill_body(call.body)
        headers = [("content-type", "application/json"), ("x-request-id", call.request_id)]
        t0 = timing.upstream_start = time.perf_counter()
        for attempt, choice in enumerate(ranking):
            engine: Engine = choice.engine
            if attempt:
                metrics.child(metrics.retries, "prefill", "upstream").inc()
            answer = await self._prefill_once(engine, call.request.path, payload, headers)
            if answer is None:
                continue
            status, data = answer
            if refused_while_draining(status, data):
                engine.draining = True
                metrics.child(metrics.upstream_errors, "prefill", engine.id, "draining").inc()
                continue
            if status in _RETRY_STATUSES:
                metrics.child(metrics.upstream_errors, "prefill", engine.id, str(status)).inc()
                continue
            if 400 <= status < 500:
                metrics.child(metrics.requests, "prefill", str(status)).inc()
                raise ClientError(status, data)  # the request itself is wrong: vLLM's own words
            if status != 200:
                metrics.child(metrics.upstream_errors, "prefill", engine.id, str(status)).inc()
                return None
            now = time.perf_counter()
            metrics.child(metrics.prefill, engine.id).observe(now - t0)
            return self._checked_handoff(engine, data, timing, t0, now)
        return None

    async def _prefill_once(
        self, engine: Engine, path: str, payload: bytes, headers: list[tuple[str, str]]
    ) -> tuple[int, bytes] | None:
        """One prefill request: (status, body), or None when the engine could not answer."""
        engine.in_flight += 1
        engine.pending += 1
        try:
            response = await self.upstreams.pool(engine.url).request(
                "POST", path, payload, headers, self.config.timeouts.prefill_s
            )
            return response.status, await response.read()
        except UpstreamError as exc:
            self.on_failure("prefill", engine, exc)
            return None
        finally:
            engine.in_flight -= 1
            engine.pending -= 1

    def _checked_handoff(
        self, engine: Engine, data: bytes, timing: Timing, sent: float, answered: float
    ) -> Handoff | None:
        """The answer's kv_transfer_params if they name `engine`; a 502 if they name another host."""
        try:
            answer = _decode_json(data)
        except msgspec.DecodeError:
            answer = None
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if params is None:
            log.warning("prefill engine %s returned no kv_transfer_params", engine.id)
            return None  # not a kv_producer: prefill on the decode engine
        problem = handoff_problem(params, engine)
        if problem is not None:
            self.metrics.child(self.metrics.handoff_rejected, engine.id).inc()
            log.warning("prefill engine %s: handoff refused: %s", engine.id, problem)
            raise ClientError(502, error_body(502, "the prefill engine's KV handoff was refused"))
        timing.prefill_s = answered - sent  # only a prefill whose KV is handed off is a P/D stage
        timing.prefill_done = answered
        return Handoff(engine, params)
