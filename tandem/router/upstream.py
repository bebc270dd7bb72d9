"""Pooled HTTP/1.1 client to engines on asyncio protocols and httptools, with streamed bodies.

Cancelling a caller closes its socket, so the engine sees the disconnect and aborts the request
(vLLM does). A connection goes back to the pool only after a complete keep-alive response.
Silence limits use one watchdog timer per connection rather than a timeout per wait, which keeps
per-chunk cost on long streams to a deque append and a future; the timer outlives the response it
was armed for and re-arms itself for the next one, so a pooled request costs no timer calls in
the steady state.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import cast
from urllib.parse import urlsplit

import httptools


class UpstreamError(Exception):
    """The engine could not be reached, or the connection broke before the response completed."""

    def __init__(self, message: str, connect: bool = False, delivered: bool = False):
        super().__init__(message)
        # True when no response head arrived: retrying an idempotent request elsewhere is safe.
        self.connect = connect
        # True when the request had been written: the engine may have acted on it (a KV pull
        # consumes the prefill engine's lease, so the same handoff cannot go to another engine).
        self.delivered = delivered


class UpstreamTimeout(UpstreamError):
    pass


# A header to add to every request, or None (e.g. `Authorization: Bearer <engine key>`).
AuthHeader = Callable[[], tuple[str, str] | None]

_HIGH_WATER = 64
_LOW_WATER = 8


class _Conn(asyncio.Protocol):
    def __init__(self, pool: UpstreamPool):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.reused = False
        self.response: Response | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._watchdog_at = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(
            asyncio.Transport, transport
        )  # uvloop's transports are not subclasses

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is not None:
            response.last_activity = response.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._broken(UpstreamError(f"malformed response from {self.pool.base}: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_watchdog()
        self._broken(UpstreamError(f"connection to {self.pool.base} lost"))

    def watch(self, deadline: float) -> None:
        """Have the watchdog look at the response by `deadline` (loop time) at the latest."""
        if self._watchdog is not None:
            if self._watchdog_at <= deadline:
                return  # it fires first and re-arms for what is left
            self._watchdog.cancel()
        self._watchdog_at = deadline
        self._watchdog = asyncio.get_running_loop().call_at(deadline, self._check_idle)

    def _stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def _check_idle(self) -> None:
        """Fails the response that has been silent for its `idle_s`; re-arms while it has not."""
        self._watchdog = None
        response = self.response
        if response is None or response.complete or response.released:
            return
        idle_s = response.idle_s
        if idle_s is None:
            return
        deadline = response.last_activity + idle_s
        if deadline > response.loop.time():
            self.watch(deadline)
            return
        response.fail(
            UpstreamTimeout(
                f"{self.pool.base} sent nothing for {idle_s}s", connect=not response.head.done()
            )
        )
        self.close()

    def _broken(self, error: UpstreamError) -> None:
        response = self.response
        if response is not None and not response.complete:
            response.fail(error)

    def close(self) -> None:
        self.closed = True
        self._stop_watchdog()
        if self.transport is not None:
            self.transport.close()

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if self.response is not None:
            self.response.headers.append((name.decode("latin-1").lower(), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        response = self.response
        if response is not None:
            response.status = self.parser.get_status_code()
            response.keep_alive = self.parser.should_keep_alive()
            if not response.head.done():
                response.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response.feed(body)

    def on_message_complete(self) -> None:
        if self.response is not None:
            self.response.finish()


class Response:
    """Status and headers once the head arrived; the body via `read()` or `chunks()`."""

    def __init__(self, conn: _Conn, idle_s: float | None):
        self.conn = conn
        self.loop = asyncio.get_running_loop()
        self.status = 0
        self._body: bytes | None = None  # once read whole
        self.headers: list[tuple[str, str]] = []
        self.keep_alive = True
        self.complete = False
        self.released = False
        self.head: asyncio.Future[None] = self.loop.create_future()
        self.last_activity = self.loop.time()
        self._chunks: deque[bytes] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._error: UpstreamError | None = None
        self._paused = False
        self.idle_s = idle_s  # the longest silence allowed (None: no limit)
        if idle_s is not None:
            conn.watch(self.last_activity + idle_s)

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def feed(self, body: bytes) -> None:
        self._chunks.append(body)
        if len(self._chunks) > _HIGH_WATER and not self._paused and self.conn.transport is not None:
            self._paused = True
            self.conn.transport.pause_reading()  # the client reads slower than the engine writes
        self._wake()

    def finish(self) -> None:
        self.complete = True
        self._wake()

    def fail(self, error: UpstreamError) -> None:
        if self._error is None:
            self._error = error
        if not self.head.done():
            self.head.set_exception(error)
            self.head.exception()  # retrieved: the caller may be gone already
        self._wake()

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body pieces as they arrive; raises UpstreamError if the engine goes away mid-body.

        The caller must `release()` (a `finally` does): an unfinished body closes the socket.
        """
        while True:
            while self._chunks:
                chunk = self._chunks.popleft()
                if self._paused and len(self._chunks) < _LOW_WATER:
                    self._resume()
                yield chunk
            if not await self._arrival():
                return

    def _resume(self) -> None:
        """Read from the engine again after back-pressure paused the socket."""
        transport = self.conn.transport
        if transport is not None:
            self._paused = False
            transport.resume_reading()

    async def _arrival(self) -> bool:
        """Waits for more of the body; False once it is complete, UpstreamError if it broke."""
        if self.complete:
            return False
        if self._error is not None:
            raise self._error
        self._waiter = self.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        return True

    async def read(self) -> bytes:
        """The whole body, then `release()`. No async generator on this path: a whole answer
        usually arrives with its head, and then nothing here waits at all. A second call
        returns the same body."""
        if self._body is not None:
            return self._body
        parts: list[bytes] = []
        try:
            while True:
                if self._chunks:
                    parts.extend(self._chunks)
                    self._chunks.clear()
                    if self._paused:
                        self._resume()
                if not await self._arrival():
                    break
        finally:
            self.release()
        self._body = parts[0] if len(parts) == 1 else b"".join(parts)
        return self._body

    def release(self) -> None:
        """Return the connection to the pool if the response completed cleanly, else close it."""
        if self.released:
            return
        self.released = True
        conn = self.conn
        conn.response = None
        if self.complete and self.keep_alive and self._error is None and not conn.closed:
            conn.pool.put(conn)
        else:
            conn.close()


class UpstreamPool:
    """Keep-alive connections to one engine (`http://host:port`)."""

    def __init__(
        self,
        base_url: str,
        connect_timeout: float = 2.0,
        max_idle: int = 256,
        auth: AuthHeader | None = None,
    ):
        parts = urlsplit(base_url)
        self.auth = auth
        self.base = base_url.rstrip("/")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.host_header = parts.netloc
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self._idle: deque[_Conn] = deque()

    def put(self, conn: _Conn) -> None:
        if len(self._idle) < self.max_idle:
            conn.reused = True
            self._idle.append(conn)
        else:
            conn.close()

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(lambda: _Conn(self), self.host, self.port)
        except TimeoutError:
            raise UpstreamTimeout(f"connect to {self.base} timed out", connect=True) from None
        except OSError as exc:
            raise UpstreamError(
                f"cannot connect to {self.base}: {exc.strerror or exc}", connect=True
            ) from None
        return conn

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: list[tuple[str, str]] | None = None,
        idle_s: float | None = None,
    ) -> Response:
        """Send a request; returns once the response head arrived (the body streams after).

        `idle_s` bounds every silence of the engine, head included.
        """
        head = [f"{method} {self.prefix}{path} HTTP/1.1\r\nhost: {self.host_header}\r\n"]
        head.extend(f"{k}: {v}\r\n" for k, v in headers or ())
        credentials = self.auth() if self.auth is not None else None
        if credentials is not None:
            head.append(f"{credentials[0]}: {credentials[1]}\r\n")
        head.append(f"content-length: {len(body)}\r\n\r\n")
        data = "".join(head).encode("latin-1") + body
        for attempt in range(2):
            conn = None
            while self._idle:
                candidate = self._idle.pop()
                if not candidate.closed:
                    conn = candidate
                    break
            if conn is None:
                try:
                    conn = await self._connect()
                except UpstreamError as exc:
                    # After a pooled connection broke, the engine may still have read the request.
                    exc.delivered = attempt > 0
                    raise
            response = Response(conn, idle_s)
            conn.response = response
            assert conn.transport is not None
            conn.transport.write(data)
            try:
                await response.head
                return response
            except UpstreamError as exc:
                response.release()
                if conn.reused and attempt == 0 and not isinstance(exc, UpstreamTimeout):
                    continue  # a pooled connection the engine had closed: retry on a fresh one
                if isinstance(exc, UpstreamTimeout):
                    exc.delivered = True
                    raise
                raise UpstreamError(str(exc), connect=True, delivered=True) from None
            except BaseException:
                response.release()
                raise
        raise UpstreamError(f"cannot reach {self.base}", connect=True, delivered=True)

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()


class Upstreams:
    """One pool per engine URL; `auth` gives a header sent on every request (the engine key)."""

    def __init__(self, connect_timeout: float = 2.0, auth: AuthHeader | None = None):
        self.connect_timeout = connect_timeout
        self.auth = auth
        self.pools: dict[str, UpstreamPool] = {}

    def pool(self, base_url: str) -> UpstreamPool:
        pool = self.pools.get(base_url)
        if pool is None:
            pool = self.pools[base_url] = UpstreamPool(
                base_url, self.connect_timeout, auth=self.auth
            )
        return pool

    def drop(self, base_url: str) -> None:
        pool = self.pools.pop(base_url, None)
        if pool is not None:
            pool.close()

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()
