"""A small HTTP/1.1 server on asyncio protocols and httptools: keep-alive, chunked streaming,
limits on connections, heads, bodies and slow clients, and cancellation of the handler when the
client goes away.

Measured on the target machine against aiohttp's server+client as a proxy (uvloop both): aiohttp
added ~650 us p50 per proxied request, this server with `upstream.py` ~100-170 us (see
docs/router.md); the router's hot path is all protocol code, so it pays for itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import cast

import httptools

from tandem.router.config import HttpLimits
from tandem.router.errors import error_body

log = logging.getLogger("tandem.router.http")

_REASONS = {s.value: s.phrase for s in HTTPStatus}
LINGER_S = 2.0


class Request:
    __slots__ = ("body", "headers", "method", "path", "peer", "query")

    def __init__(
        self, method: str, path: str, query: str, headers: dict[str, str], body: bytes, peer: str
    ):
        self.peer = peer  # the client's IP address
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.body = body


class ClientGone(Exception):
    """The client closed its connection; nothing more can be written."""


def status_line(status: int) -> bytes:
    return f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n".encode("latin-1")


def encode_headers(headers: list[tuple[str, str]]) -> bytes:
    return "".join(f"{k}: {v}\r\n" for k, v in headers).encode("latin-1")


class Responder:
    """Writes one response: either `send()` whole, or `start()`, `write()`..., `end()` chunked."""

    __slots__ = ("_conn", "keep_alive", "started", "status")

    def __init__(self, conn: HttpConnection, keep_alive: bool):
        self._conn = conn
        self.keep_alive = keep_alive
        self.started = False
        self.status = 0

    def send(
        self,
        status: int,
        body: bytes,
        headers: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> None:
        if self.started:
            return
        self.started = True
        self.status = status
        head = [
            status_line(status),
            b"content-type: ",
            content_type.encode("latin-1"),
            b"\r\ncontent-length: ",
            str(len(body)).encode(),
            b"\r\n",
        ]
        if headers:
            head.append(encode_headers(headers))
        if not self.keep_alive:
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        head.append(body)
        self._conn.write(b"".join(head))

    def start(self, status: int, headers: list[tuple[str, str]], content_type: str) -> None:
        self.started = True
        self.status = status
        extra = b"" if self.keep_alive else b"connection: close\r\n"
        self._conn.write(
            status_line(status)
            + b"content-type: "
            + content_type.encode("latin-1")
            + b"\r\ntransfer-encoding: chunked\r\n"
            + encode_headers(headers)
            + extra
            + b"\r\n"
        )

    async def write(self, chunk: bytes) -> None:
        if chunk:
            self._conn.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
            await self._conn.drain()

    def end(self) -> None:
        self._conn.write(b"0\r\n\r\n")


Handler = Callable[[Request, Responder], Awaitable[None]]


class _Reject(Exception):
    """Raised inside a parser callback: answer `status` and close the connection."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class HttpConnection(asyncio.Protocol):
    """One client connection; requests on it are handled one after another.

    One timer guards each phase a client controls: the idle wait for a request, the request head
    (`header_timeout_s` from its first byte), the body (`body_timeout_s` from the end of the head).
    While a request is being served the connection stops reading as soon as a pipelined request
    begins, so further requests wait in the kernel's buffers instead of the router's memory.
    """

    def __init__(
        self, handler: Handler, limits: HttpLimits, max_body_bytes: int, server: HttpServer
    ):
        self.handler = handler
        self.limits = limits
        self.max_body_bytes = max_body_bytes
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.closed = False
        self.peer = ""
        self._loop = asyncio.get_running_loop()
        # The phase's deadline (loop time; 0: none) and the one timer that enforces it, armed for
        # `_timer_at`: a later deadline leaves it armed (it re-arms itself when it fires early), so
        # a keep-alive request costs no timer calls at all in the steady state.
        self._phase = "idle"
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._linger: asyncio.TimerHandle | None = None
        self._url = b""
        self._headers: dict[str, str] = {}
        self._header_count = 0
        self._header_bytes = 0
        self._body: list[bytes] = []
        self._body_len = 0
        self._pending: deque[tuple[Request, bool]] = deque()
        self._task: asyncio.Task[None] | None = None
        self._reading_paused = False
        self._lingering = False
        self._paused = False
        self._drain_waiter: asyncio.Future[None] | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(
            asyncio.Transport, transport
        )  # uvloop's transports are not subclasses
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        if len(self.server.connections) >= self.limits.max_connections:
            self.server.count("connections_refused")
            self._fail(503, "too many connections")
            return
        self.server.connections.add(self)
        self._arm(self.limits.idle_timeout_s, "idle")

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # an error was answered: what the client still sends is dropped unread
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(400, "upgrade is not supported")
        except httptools.HttpParserCallbackError as exc:
            reject = exc.__context__
            if isinstance(reject, _Reject):
                self._fail(reject.status, reject.message)
            else:
                self._fail(400, "malformed HTTP request")
        except httptools.HttpParserError:
            self._fail(400, "malformed HTTP request")

    def eof_received(self) -> bool:
        return False  # close: a half-closed client is a client that went away

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._disarm()
        for timer in (self._timer, self._linger):
            if timer is not None:
                timer.cancel()
        self._timer = self._linger = None
        self.server.connections.discard(self)
        self._pending.clear()
        if self._task is not None and not self._task.done():
            self._task.cancel()  # propagates to upstream requests: they close their sockets
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_exception(ClientGone())

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)

    # timers
    def _arm(self, seconds: float, phase: str) -> None:
        deadline = self._loop.time() + seconds
        self._phase = phase
        self._deadline = deadline
        if self._timer is not None:
            if self._timer_at <= deadline:
                return
            self._timer.cancel()
        self._timer_at = deadline
        self._timer = self._loop.call_at(deadline, self._expired)

    def _disarm(self) -> None:
        self._deadline = 0.0  # an armed timer finds no deadline and lapses

    def _expired(self) -> None:
        self._timer = None
        if self.closed or not self._deadline:
            return
        if self._deadline > self._loop.time():
            self._timer_at = self._deadline
            self._timer = self._loop.call_at(self._deadline, self._expired)
            return
        phase = self._phase
        self.server.count(f"{phase}_timeouts")
        if phase != "idle":
            # A slow client has little unread input: answer and close at once, no lingering
            # (cheap when hundreds of slowloris connections time out together).
            with contextlib.suppress(ClientGone):
                message = f"request {phase} not received in time"
                Responder(self, keep_alive=False).send(408, error_body(408, message))
        if self.transport is not None:
            self.transport.close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._header_count = 0
        self._header_bytes = 0
        self._body = []
        self._body_len = 0
        if self._busy():
            self._pause_reading()  # a pipelined request: let it wait in the kernel
        else:
            self._arm(self.limits.header_timeout_s, "header")

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_header_bytes(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.max_header_count:
            self.server.count("headers_too_many")
            raise _Reject(431, f"more than {self.limits.max_header_count} headers")
        self._count_header_bytes(len(name) + len(value))
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        self._headers[key] = f"{self._headers[key]}, {text}" if key in self._headers else text

    def _count_header_bytes(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > self.limits.max_header_bytes:
            self.server.count("headers_too_large")
            raise _Reject(431, f"request head exceeds {self.limits.max_header_bytes} bytes")

    def on_headers_complete(self) -> None:
        length = self._headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            self.server.count("bodies_too_large")
            raise _Reject(413, f"request body exceeds {self.max_body_bytes} bytes")
        if not self._busy():
            self._arm(self.limits.body_timeout_s, "body")
        if self._headers.get("expect", "").lower() == "100-continue" and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # curl waits 1 s otherwise

    def on_body(self, body: bytes) -> None:
        self._body_len += len(body)
        if self._body_len > self.max_body_bytes:
            self.server.count("bodies_too_large")
            raise _Reject(413, f"request body exceeds {self.max_body_bytes} bytes")
        self._body.append(body)

    def on_message_complete(self) -> None:
        url = self._url.decode("latin-1")
        path, _, query = url.partition("?")
        method = self.parser.get_method().decode("latin-1")
        keep_alive = self.parser.should_keep_alive()
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body = []
        self._pending.append(
            (Request(method, path, query, self._headers, body, self.peer), keep_alive)
        )
        if not self._busy():
            self._disarm()  # the handler's own timeouts take over
            self._task = self._loop.create_task(self._serve())

    # internals
    def _busy(self) -> bool:
        return self._task is not None and not self._task.done()

    def serving(self) -> bool:
        """A request is being served (or waits its turn) on this connection."""
        return bool(self._pending) or self._busy()

    def _pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None and not self.closed:
            self._reading_paused = False
            self.transport.resume_reading()

    def write(self, data: bytes) -> None:
        if self.closed or self.transport is None:
            raise ClientGone()
        self.transport.write(data)

    async def drain(self) -> None:
        if self.closed:
            raise ClientGone()
        if self._paused:
            self._drain_waiter = self._loop.create_future()
            await self._drain_waiter

    def _fail(self, status: int, message: str) -> None:
        """Answers an error and closes, lingering: closing with unread input would reset the
        connection and could destroy the answer before the client reads it (nginx's
        lingering_close), so input is read and dropped for up to LINGER_S after a half-close."""
        with contextlib.suppress(ClientGone):
            Responder(self, keep_alive=False).send(status, error_body(status, message))
        self._disarm()
        transport = self.transport
        if transport is None or self.closed:
            return
        self._lingering = True
        self._resume_reading()
        if transport.can_write_eof():
            transport.write_eof()
        self._linger = self._loop.call_later(LINGER_S, transport.close)

    async def _serve(self) -> None:
        while self._pending and not self.closed:
            request, keep_alive = self._pending.popleft()
            responder = Responder(self, keep_alive and not self.server.closing)
            try:
                await self.handler(request, responder)
            except (ClientGone, ConnectionError):
                break
            except asyncio.CancelledError:
                break
            except Exception:
                log.exception("unhandled error serving %s %s", request.method, request.path)
                if not responder.started:
                    with contextlib.suppress(ClientGone):
                        responder.send(500, error_body(500, "Internal server error"))
                else:
                    keep_alive = False
            if not keep_alive or not responder.keep_alive:
                if self.transport is not None:
                    self.transport.close()
                return
        if not self.closed:
            self._arm(self.limits.idle_timeout_s, "idle")
            self._resume_reading()


class HttpServer:
    """Accepts connections for one handler; `counts` tallies what the limits turned away."""

    def __init__(self, handler: Handler, max_body_bytes: int, limits: HttpLimits | None = None):
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        self.limits = limits or HttpLimits()
        self.connections: set[HttpConnection] = set()
        self.counts: dict[str, int] = {}
        self.closing = False  # close() began: no response keeps its connection alive
        self._server: asyncio.base_events.Server | None = None

    def count(self, event: str) -> None:
        self.counts[event] = self.counts.get(event, 0) + 1

    async def start(self, host: str, port: int, reuse_port: bool = False) -> int:
        """Listen on host:port (`reuse_port`: beside the other router processes of one port)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: HttpConnection(self.handler, self.limits, self.max_body_bytes, self),
            host,
            port,
            reuse_address=True,
            reuse_port=reuse_port,
            backlog=2048,
        )
        sock = self._server.sockets[0]
        return int(sock.getsockname()[1])

    async def close(self, grace_s: float = 0.0) -> None:
        """Stops listening; requests being served get up to `grace_s` to finish, their responses
        saying `Connection: close`. Idle connections close at once (nginx's graceful shutdown)."""
        if self._server is None:
            return
        self.closing = True
        self._server.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while True:
            for conn in list(self.connections):
                if not conn.serving() and conn.transport is not None:
                    conn.transport.close()
            if not self.connections or loop.time() >= deadline:
                break
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        await self._server.wait_closed()
