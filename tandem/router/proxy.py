"""The P/D request flow: admission -> features -> decision -> prefill -> KV handoff -> decode stream."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from typing import Any

import msgspec

from tandem.router.admission import Admission, QueueFull, parse_priority
from tandem.router.auth import AUTHORIZATION, ClientAuth, EngineKey
from tandem.router.config import RouterConfig
from tandem.router.decision import Route, decide_route
from tandem.router.engines import Engine, EnginePool
from tandem.router.errors import error_body, sse_error_event
from tandem.router.features import featurizer_of
from tandem.router.httpserver import Request, Responder
from tandem.router.index import PrefixIndex
from tandem.router.kv_failure import failed_before_output
from tandem.router.metrics import RouterMetrics
from tandem.router.scoring import Choice, score_engines
from tandem.router.sessions import SessionTable
from tandem.router.upstream import Response, UpstreamError, Upstreams, UpstreamTimeout

log = logging.getLogger("tandem.router.proxy")

_decode_json = msgspec.json.Decoder().decode
_encode_json = msgspec.json.Encoder().encode
_JSON = [("content-type", "application/json")]
_RETRY_STATUSES = frozenset((502, 503, 504))
# What a prefill pod is asked for: produce the KV, hand it off (PROTOCOLS.md §1).
_PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class ClientError(Exception):
    """A response to send as is (an error decided before or during routing)."""

    def __init__(self, status: int, body: bytes, headers: list[tuple[str, str]] | None = None):
        super().__init__(status)
        self.status = status
        self.body = body
        self.headers = headers or []


class Timing:
    """One request's timing breakdown (perf_counter seconds).

    Each stage is measured once and goes two ways: into its Prometheus histogram and into an
    `x-tandem-<stage>-ms` response header (`add_headers`). The client's headers leave when the
    decode pod's first body byte arrives, so every stage up to that byte can be reported.
    """

    __slots__ = ("prefill_done", "prefill_s", "queue_s", "schedule_s", "start", "upstream_start")

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.queue_s = 0.0
        self.schedule_s = 0.0
        self.upstream_start: float | None = None  # the first upstream request (prefill or decode)
        self.prefill_s: float | None = None
        self.prefill_done: float | None = None

    def add_headers(self, headers: list[tuple[str, str]], first_byte: float) -> None:
        """Appends the breakdown up to the decode pod's first body byte, in milliseconds."""
        headers.append(("x-tandem-queue-ms", f"{self.queue_s * 1e3:.3f}"))
        headers.append(("x-tandem-schedule-ms", f"{self.schedule_s * 1e3:.3f}"))
        if self.prefill_done is not None and self.prefill_s is not None:
            headers.append(("x-tandem-prefill-ms", f"{self.prefill_s * 1e3:.3f}"))
            headers.append(
                ("x-tandem-kv-handoff-ms", f"{(first_byte - self.prefill_done) * 1e3:.3f}")
            )
        if self.upstream_start is not None:
            headers.append(
                ("x-tandem-upstream-ms", f"{(first_byte - self.upstream_start) * 1e3:.3f}")
            )
        headers.append(("x-tandem-ttft-ms", f"{(first_byte - self.start) * 1e3:.3f}"))


def prefill_body(body: dict[str, Any]) -> bytes:
    """The client's body turned into a prefill-only request (max_tokens=1, non-streaming, KV kept)."""
    request = dict(body)
    request["stream"] = False
    request["max_tokens"] = 1
    if "max_completion_tokens" in request:
        request["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        request.pop(key, None)
    request["kv_transfer_params"] = _PREFILL_KV_PARAMS
    return _encode_json(request)


class Router:
    """Holds the routing state and serves the OpenAI endpoints."""

    def __init__(self, config: RouterConfig, pool: EnginePool, metrics: RouterMetrics):
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self.featurizer = featurizer_of(config, metrics)
        self.exact_index = PrefixIndex(config.index_max_blocks_per_engine, config.pending_ttl_s)
        self.approx_index = PrefixIndex(config.index_max_blocks_per_engine)
        # The exact index is consulted only when events can meet request keys (a tokenizer is set).
        self.use_exact = config.kv_events and self.featurizer.exact
        self.admission = Admission(
            config.admission.max_in_flight,
            config.admission.max_queue,
            config.admission.max_queue_per_priority,
        )
        self.sessions = SessionTable(config.admission.max_sessions)
        engine_key = EngineKey.from_config(config)
        self.upstreams = Upstreams(
            config.timeouts.connect_s, engine_key.header if engine_key else None
        )
        self.model_names = {config.served_model_name}
        self._priority_header = config.admission.priority_header.lower()
        self._session_header = config.admission.session_header.lower()
        self.auth = ClientAuth.from_config(config)
        self._id_prefix = f"tdm-{os.urandom(6).hex()}-"
        self._ids = itertools.count(1)

    # -- entry -------------------------------------------------------------------------------

    def authorized(self, request: Request) -> bool:
        return self.auth.allows(request.headers.get(AUTHORIZATION))

    async def generate(self, request: Request, responder: Responder, chat: bool) -> None:
        timing = Timing()
        try:
            body = self._parse(request)
        except ClientError as exc:
            self.metrics.child(self.metrics.rejected, "invalid").inc()
            responder.send(exc.status, exc.body, exc.headers)
            return
        priority = parse_priority(request.headers.get(self._priority_header))
        try:
            if not self.admission.try_acquire():
                async with asyncio.timeout(self.config.timeouts.request_s):
                    await self.admission.acquire(priority)
        except QueueFull as full:
            self.metrics.child(self.metrics.rejected, "queue_full").inc()
            responder.send(
                429,
                error_body(429, "The router's queue is full; retry later."),
                [("retry-after", str(full.retry_after_s))],
            )
            return
        except TimeoutError:
            self.metrics.child(self.metrics.rejected, "queue_timeout").inc()
            responder.send(
                503,
                error_body(503, "Timed out waiting in the router's queue."),
                [("retry-after", "5")],
            )
            return
        timing.queue_s = time.perf_counter() - timing.start
        self.metrics.child(self.metrics.queue, str(priority)).observe(timing.queue_s)
        # One timer per request that cancels it (cheaper than asyncio.timeout on the hot path).
        task = asyncio.current_task()
        assert task is not None
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            task.cancel()

        deadline = asyncio.get_running_loop().call_later(self.config.timeouts.request_s, expire)
        try:
            await self._serve(request, responder, body, chat, timing)
        except asyncio.CancelledError:
            if not expired:
                self.metrics.disconnects.inc()
                raise
            task.uncancel()
            message = f"request exceeded {self.config.timeouts.request_s}s"
            if responder.started:
                await responder.write(sse_error_event(504, message))
                responder.end()
            else:
                responder.send(504, error_body(504, message))
        finally:
            deadline.cancel()
            self.admission.release()
            self.admission.observe_service_time(time.perf_counter() - timing.start - timing.queue_s)

    def _parse(self, request: Request) -> dict[str, Any]:
        if request.too_large:
            raise ClientError(
                413,
                error_body(
                    413, f"request body exceeds {self.config.admission.max_body_bytes} bytes"
                ),
            )
        try:
            body = _decode_json(request.body)
        except msgspec.DecodeError as exc:
            raise ClientError(
                400, error_body(400, f"JSON decode error: {exc}", "body", "Bad Request")
            ) from None
        if not isinstance(body, dict):
            raise ClientError(
                400, error_body(400, "the request body must be a JSON object", "body")
            )
        model = body.get("model")
        if model is not None and model not in self.model_names:
            names = ", ".join(sorted(self.model_names))
            raise ClientError(
                404,
                error_body(
                    404, f"The model `{model}` does not exist. Valid aliases: {names}.", "model"
                ),
            )
        if request.path.endswith("/chat/completions"):
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ClientError(
                    400, error_body(400, "`messages` must be a non-empty list", "messages")
                )
        elif body.get("prompt") is None or body.get("prompt") in ("", []):
            raise ClientError(400, error_body(400, "`prompt` is required", "prompt"))
        if "kv_transfer_params" in body:
            # A client must never steer a decode pod to a host: only params from our prefill pods pass.
            del body["kv_transfer_params"]
            body["\x00stripped"] = True
            self.metrics.stripped.inc()
        return body

    # -- routing -----------------------------------------------------------------------------

    async def _serve(
        self,
        request: Request,
        responder: Responder,
        body: dict[str, Any],
        chat: bool,
        timing: Timing,
    ) -> None:
        stripped = body.pop("\x00stripped", False)
        t_route = time.perf_counter()
        features = await self.featurizer.features(body, chat)
        exact = self.use_exact and features.exact
        index = self.exact_index if exact else self.approx_index
        index_name = "exact" if exact else "approximate"
        total_blocks = len(features.keys)
        decoders = self.pool.candidates("decode")
        if not decoders:
            self.metrics.child(self.metrics.requests, "none", "503").inc()
            responder.send(503, error_body(503, "no healthy decode engine"), [("retry-after", "2")])
            return
        hits = index.match(features.keys, [e.id for e in decoders]) if total_blocks else {}
        sizes = {e.id: index.size(e.id) for e in decoders} if len(decoders) > 1 else None
        ranked = score_engines(decoders, hits, total_blocks, self.config.scoring, sizes)
        session = request.headers.get(self._session_header)
        if session:
            ranked = self._with_affinity(session, ranked)
        decode = ranked[0]
        block = self.config.block_size
        uncached = max(features.prompt_tokens - decode.hit_blocks * block, 0)
        prefillers = [e for e in self.pool.candidates("prefill") if not e.colocated]
        route = (
            Route.LOCAL
            if body.get("n", 1) not in (1, None)
            else decide_route(uncached, prefillers, decode.engine, self.config.disaggregation)
        )
        self.metrics.child(self.metrics.prefix_query_blocks, index_name).inc(total_blocks)
        if decode.hit_blocks:
            self.metrics.child(self.metrics.prefix_hit_blocks, index_name).inc(decode.hit_blocks)
            self.metrics.child(self.metrics.prefix_hits, index_name).inc()
        timing.schedule_s = time.perf_counter() - t_route
        self.metrics.routing.observe(timing.schedule_s)

        request_id = request.headers.get("x-request-id") or f"{self._id_prefix}{next(self._ids):x}"
        kv_params: dict[str, Any] | None = None
        prefill_engine: Engine | None = None
        if route is Route.DISAGGREGATED:
            p_hits = index.match(features.keys, [e.id for e in prefillers]) if total_blocks else {}
            p_sizes = {e.id: index.size(e.id) for e in prefillers} if len(prefillers) > 1 else None
            p_ranked = score_engines(prefillers, p_hits, total_blocks, self.config.scoring, p_sizes)
            kv_params, prefill_engine = await self._prefill(
                request.path, body, p_ranked, request_id, timing
            )
            if kv_params is None:
                route = Route.LOCAL
                self.metrics.child(self.metrics.decisions, "fallback").inc()
            else:
                self.metrics.child(self.metrics.decisions, "disaggregated").inc()
                if prefill_engine is not None and total_blocks:
                    self.approx_index.touch(prefill_engine.id, features.keys)
                    self.exact_index.add_pending(prefill_engine.id, features.keys if exact else ())
        elif (
            not prefillers
            and self.config.disaggregation.mode != "never"
            and any(not e.colocated for e in self.pool.all("prefill"))
        ):
            self.metrics.child(
                self.metrics.decisions, "fallback"
            ).inc()  # every prefill pod is down
        else:
            self.metrics.child(self.metrics.decisions, "local").inc()
        if total_blocks:
            self.approx_index.touch(decode.engine.id, features.keys)
            self.exact_index.add_pending(decode.engine.id, features.keys if exact else ())
        if session:
            self.sessions.put(session, decode.engine.id)

        if kv_params is not None:
            body["kv_transfer_params"] = kv_params
            payload = _encode_json(body)
        elif stripped:
            payload = _encode_json(body)
        else:
            payload = request.body  # untouched: no re-serialisation on the plain path
        headers = [
            ("x-tandem-route", route.value),
            ("x-tandem-decode-engine", decode.engine.id),
            ("x-tandem-prefix-hit", f"{decode.hit_blocks}/{total_blocks}"),
            ("x-request-id", request_id),
        ]
        if prefill_engine is not None and kv_params is not None:
            headers.append(("x-tandem-prefill-engine", prefill_engine.id))
        engines = [c.engine for c in ranked]
        args = (request_id, responder, headers, timing)
        if await self._decode(request.path, payload, engines, route, *args, kv_params is not None):
            # The decode engine could not use the prefill's KV: once more, prefilling it there.
            self.metrics.child(self.metrics.retries, "decode", "kv_transfer").inc()
            del body["kv_transfer_params"]
            headers[:] = [("x-tandem-route", Route.LOCAL.value)] + [
                h for h in headers[1:] if h[0] != "x-tandem-prefill-engine"
            ]
            await self._decode(request.path, _encode_json(body), engines, Route.LOCAL, *args)

    def _with_affinity(self, session: str, ranked: list[Choice]) -> list[Choice]:
        engine_id = self.sessions.get(session)
        if engine_id is None:
            return ranked
        for i, choice in enumerate(ranked):
            if choice.engine.id == engine_id:
                return [choice, *ranked[:i], *ranked[i + 1 :]]
        return ranked  # gone, unhealthy or over the load bound: pick afresh

    async def _prefill(
        self, path: str, body: dict[str, Any], ranked: list[Choice], request_id: str, timing: Timing
    ) -> tuple[dict[str, Any] | None, Engine | None]:
        """Ask prefill pods in score order; returns their kv_transfer_params, or None to prefill locally."""
        payload = prefill_body(body)
        headers = [("content-type", "application/json"), ("x-request-id", request_id)]
        t0 = timing.upstream_start = time.perf_counter()
        for attempt, choice in enumerate(ranked):
            engine = choice.engine
            if attempt:
                self.metrics.child(self.metrics.retries, "prefill", "upstream").inc()
            engine.in_flight += 1
            engine.pending += 1
            response: Response | None = None
            try:
                response = await self.upstreams.pool(engine.url).request(
                    "POST", path, payload, headers, self.config.timeouts.prefill_s
                )
                data = await response.read()
            except UpstreamError as exc:
                kind = (
                    "timeout"
                    if isinstance(exc, UpstreamTimeout)
                    else "connect"
                    if exc.connect
                    else "broken"
                )
                self.metrics.child(self.metrics.upstream_errors, "prefill", engine.id, kind).inc()
                if exc.connect and not isinstance(exc, UpstreamTimeout):
                    engine.healthy = False  # the monitor brings it back when /health answers
                log.warning("prefill on %s failed: %s", engine.id, exc)
                continue
            finally:
                engine.in_flight -= 1
                engine.pending -= 1
                if response is not None:
                    response.release()
            if response.status in _RETRY_STATUSES:
                self.metrics.child(
                    self.metrics.upstream_errors, "prefill", engine.id, str(response.status)
                ).inc()
                continue
            if response.status != 200:
                if 400 <= response.status < 500:
                    raise ClientError(response.status, data, [])  # the request itself is wrong
                self.metrics.child(
                    self.metrics.upstream_errors, "prefill", engine.id, str(response.status)
                ).inc()
                return None, None
            now = time.perf_counter()
            self.metrics.child(self.metrics.prefill, engine.id).observe(now - t0)
            try:
                params = _decode_json(data).get("kv_transfer_params")
            except (msgspec.DecodeError, AttributeError):
                params = None
            if not isinstance(params, dict):
                log.warning(
                    "prefill engine %s returned no kv_transfer_params (is it a kv_producer?)",
                    engine.id,
                )
                return None, None
            timing.prefill_s = now - t0  # only a prefill whose KV is handed off is a P/D stage
            timing.prefill_done = now
            return params, engine
        return None, None

    async def _decode(
        self,
        path: str,
        payload: bytes,
        ranked: list[Engine],
        route: Route,
        request_id: str,
        responder: Responder,
        headers: list[tuple[str, str]],
        timing: Timing,
        relayed_kv: bool = False,
    ) -> bool:
        """Streams the decode engine's answer to the client. With `relayed_kv`, an answer that
        failed before any output (`failed_before_output`) is not sent: returns True instead."""
        timeouts = self.config.timeouts
        up_headers = [("content-type", "application/json"), ("x-request-id", request_id)]
        response: Response | None = None
        engine = ranked[0]
        if timing.upstream_start is None:
            timing.upstream_start = time.perf_counter()
        for attempt, engine in enumerate(ranked[:3]):
            if attempt:
                self.metrics.child(self.metrics.retries, "decode", "connect").inc()
                headers[1] = ("x-tandem-decode-engine", engine.id)
            engine.in_flight += 1
            engine.pending += 1
            try:
                response = await self.upstreams.pool(engine.url).request(
                    "POST", path, payload, up_headers, timeouts.decode_idle_s
                )
                break
            except BaseException as exc:
                engine.in_flight -= 1
                engine.pending -= 1
                if not isinstance(exc, UpstreamError):
                    raise
                kind = "timeout" if isinstance(exc, UpstreamTimeout) else "connect"
                self.metrics.child(self.metrics.upstream_errors, "decode", engine.id, kind).inc()
                if exc.connect and not isinstance(exc, UpstreamTimeout):
                    engine.healthy = False
                    continue
                break
        pool = route.value
        if response is None:
            self.metrics.child(self.metrics.requests, pool, "502").inc()
            responder.send(502, error_body(502, "no decode engine could be reached"), headers)
            return False
        status = response.status
        content_type = response.header("content-type") or "application/json"
        metrics = self.metrics
        pending = True
        try:
            if not content_type.startswith("text/event-stream"):
                data = await response.read()
                engine.pending -= 1
                pending = False
                if relayed_kv and failed_before_output(status, False, data):
                    metrics.child(metrics.upstream_errors, "decode", engine.id, "kv_transfer").inc()
                    return True
                self._first_byte(timing, engine, pool, headers)
                responder.send(status, data, headers, content_type)
                metrics.child(metrics.e2e, pool, engine.id).observe(
                    time.perf_counter() - timing.start
                )
                metrics.child(metrics.requests, pool, str(status)).inc()
                return False
            # The client's headers wait for the first body byte: by then the KV handoff and the
            # first step are done and can be reported in them, and a silent engine still gets a
            # plain 504 instead of a broken stream.
            last = 0.0
            itl = metrics.child(metrics.itl, engine.id)
            try:
                async for chunk in response.chunks():
                    if pending:
                        engine.pending -= 1
                        pending = False
                        if relayed_kv and failed_before_output(status, True, chunk):
                            metrics.child(
                                metrics.upstream_errors, "decode", engine.id, "kv_transfer"
                            ).inc()
                            return True
                        last = self._first_byte(timing, engine, pool, headers)
                        responder.start(status, headers, content_type)
                    else:
                        now = time.perf_counter()
                        itl.observe(now - last)
                        last = now
                    await responder.write(chunk)
            except UpstreamError as exc:
                timeout = isinstance(exc, UpstreamTimeout)
                metrics.child(
                    metrics.upstream_errors, "decode", engine.id, "timeout" if timeout else "broken"
                ).inc()
                log.warning("decode stream from %s broke: %s", engine.id, exc)
                status = 504 if timeout else 502
                message = f"decode engine failed mid-stream: {exc}"
                if not responder.started:
                    metrics.child(metrics.requests, pool, str(status)).inc()
                    responder.send(status, error_body(status, message), headers)
                    return False
                await responder.write(sse_error_event(status, message))
            if not responder.started:  # an empty stream
                responder.start(status, headers, content_type)
            responder.end()
            metrics.child(metrics.e2e, pool, engine.id).observe(time.perf_counter() - timing.start)
            metrics.child(metrics.requests, pool, str(status)).inc()
        except UpstreamError as exc:
            metrics.child(metrics.upstream_errors, "decode", engine.id, "broken").inc()
            metrics.child(metrics.requests, pool, "502").inc()
            responder.send(502, error_body(502, f"decode engine failed: {exc}"), headers)
        finally:
            engine.in_flight -= 1
            if pending:
                engine.pending -= 1
            response.release()  # closes the socket if incomplete: the engine aborts the request
        return False

    def _first_byte(
        self, timing: Timing, engine: Engine, pool: str, headers: list[tuple[str, str]]
    ) -> float:
        """Records the stages that end at the decode pod's first body byte; returns its time."""
        now = time.perf_counter()
        metrics = self.metrics
        if timing.prefill_done is not None:
            metrics.child(metrics.kv_handoff, engine.id).observe(now - timing.prefill_done)
        metrics.child(metrics.ttft, pool, engine.id).observe(now - timing.start)
        timing.add_headers(headers, now)
        return now
