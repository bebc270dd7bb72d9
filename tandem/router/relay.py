"""Relaying a decode engine's answer to the client: whole, or as a stream, with the metrics of
the stages that end there."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.router.call import Call, ClientError
from tandem.router.decision import Route
from tandem.router.engines import Engine
from tandem.router.errors import error_body, sse_error_event
from tandem.router.kv_failure import failed_before_output
from tandem.router.metrics import RouterMetrics
from tandem.router.upstream import Response, UpstreamError, UpstreamTimeout


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs a call per field
class DecodeAnswer:
    """A decode engine's response head, and where its body goes."""

    call: Call
    engine: Engine
    response: Response
    route: Route
    headers: list[tuple[str, str]]  # the client's response headers
    handed_off: bool  # the request carried a prefill engine's kv_transfer_params


class Relay:
    """`on_failure(pool, engine, error)` counts an upstream failure (the proxy's bookkeeping)."""

    def __init__(
        self, metrics: RouterMetrics, on_failure: Callable[[str, Engine, UpstreamError], None]
    ):
        self.metrics = metrics
        self.on_failure = on_failure

    def _kv_failed(self, answer: DecodeAnswer, status: int, streaming: bool, first: bytes) -> bool:
        """After a handoff, the answer failed before any output (a failed KV pull): counted, and
        not relayed, so the request can go again without the handoff."""
        if not answer.handed_off or not failed_before_output(status, streaming, first):
            return False
        self.metrics.child(
            self.metrics.upstream_errors, "decode", answer.engine.id, "kv_transfer"
        ).inc()
        return True

    async def body(self, answer: DecodeAnswer) -> bool:
        """A whole (non-streamed) answer, the engine's status and body as sent; True instead
        when it is a failed KV pull (`_kv_failed`)."""
        call, engine, response = answer.call, answer.engine, answer.response
        route, headers = answer.route, answer.headers
        metrics = self.metrics
        try:
            data = await response.read()
        except UpstreamError as exc:
            self.on_failure("decode", engine, exc)
            metrics.child(metrics.requests, route.value, "502").inc()
            raise ClientError(
                502, error_body(502, f"decode engine failed: {exc}"), headers
            ) from None
        finally:
            engine.pending -= 1
        if self._kv_failed(answer, response.status, False, data):
            return True
        first_byte = self.first_byte(call, engine, route, headers)
        content_type = response.header("content-type") or "application/json"
        call.responder.send(response.status, data, headers, content_type)
        ticket_first_byte(call, engine, first_byte)
        if call.ticket is not None:
            call.output_tokens = completion_tokens(data)
        metrics.child(metrics.e2e, route.value, engine.id).observe(
            time.perf_counter() - call.timing.start
        )
        metrics.child(metrics.requests, route.value, str(response.status)).inc()
        return False

    async def stream(self, answer: DecodeAnswer) -> bool:
        """An SSE stream, chunk by chunk; a broken stream ends with an error event. True instead
        when it opens with a failed KV pull (`_kv_failed`).

        The client's headers wait for the first body byte: by then the KV handoff and the first
        step are done and can be reported in them, and a silent engine still gets a plain 504
        instead of a broken stream.
        """
        call, engine, response = answer.call, answer.engine, answer.response
        route, headers = answer.route, answer.headers
        metrics = self.metrics
        responder = call.responder
        status = response.status
        content_type = response.header("content-type") or "text/event-stream"
        itl = metrics.child(metrics.itl, engine.id)
        pending = True
        last = 0.0
        ticket = call.ticket
        events = 0
        try:
            async for chunk in response.chunks():
                if pending:
                    engine.pending -= 1
                    pending = False
                    if self._kv_failed(answer, status, True, chunk):
                        return True
                    last = self.first_byte(call, engine, route, headers)
                    responder.start(status, headers, content_type)
                    await responder.write(chunk)
                    ticket_first_byte(call, engine, last)
                else:
                    now = time.perf_counter()
                    itl.observe(now - last)
                    last = now
                    await responder.write(chunk)
                engine.heard_at = last
                if ticket is not None:
                    events += chunk.count(b"data:")
        except UpstreamError as exc:
            self.on_failure("decode", engine, exc)
            status = 504 if isinstance(exc, UpstreamTimeout) else 502
            message = f"decode engine failed mid-stream: {exc}"
            if not responder.started:
                metrics.child(metrics.requests, route.value, str(status)).inc()
                raise ClientError(status, error_body(status, message), headers) from None
            await responder.write(sse_error_event(status, message))
        finally:
            if pending:
                engine.pending -= 1
        if not responder.started:  # an empty stream
            responder.start(status, headers, content_type)
        responder.end()
        if ticket is not None and status == 200:
            call.output_tokens = output_events(call.chat, call.body, events)
            call.last_event = last
        metrics.child(metrics.e2e, route.value, engine.id).observe(
            time.perf_counter() - call.timing.start
        )
        metrics.child(metrics.requests, route.value, str(status)).inc()
        return False

    def first_byte(
        self, call: Call, engine: Engine, route: Route, headers: list[tuple[str, str]]
    ) -> float:
        """Records the stages that end at the decode pod's first body byte; returns its time."""
        now = time.perf_counter()
        timing = call.timing
        metrics = self.metrics
        if timing.prefill_done is not None:
            metrics.child(metrics.kv_handoff, engine.id).observe(now - timing.prefill_done)
        metrics.child(metrics.ttft, route.value, engine.id).observe(now - timing.start)
        timing.add_headers(headers, now)
        return now


def ticket_first_byte(call: Call, engine: Engine, at: float) -> None:
    """The predictive ticket's first byte (`Ticket.first_byte`) at `at`, called once the client
    has been sent that byte: its bookkeeping is not on the client's way to its first token."""
    if call.ticket is not None:
        timing = call.timing
        call.ticket.first_byte(engine, at, timing.upstream_start, timing.prefill_done)


def output_events(chat: bool, body: dict[str, Any], events: int) -> int:
    """A stream's output tokens as its events show them: every `data:` event but `[DONE]`, chat's
    opening role event and the usage event when asked for (an engine that sends several tokens
    per event makes this an undercount)."""
    extra = 1 + chat
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        extra += 1
    return max(events - extra, 0)


def completion_tokens(data: bytes) -> int | None:
    """`usage.completion_tokens` of a whole answer, found without parsing the body."""
    at = data.rfind(b'"completion_tokens":')
    if at < 0:
        return None
    digits = data[at + 20 : at + 32].lstrip(b" ")
    end = 0
    while end < len(digits) and 48 <= digits[end] <= 57:
        end += 1
    return int(digits[:end]) if end else None
