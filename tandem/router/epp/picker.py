"""The endpoint picker: Envoy's ext_proc stream per request, placed by the router's own plan.

One `Process` stream is one HTTP request through the gateway. The picker reads the request's
headers and body, runs the router's admission and `CompletionProxy.plan` (the same features,
index and scorers as `tandem router`, so both place a request alike), then answers the headers
with the destination and passes the body on (FULL_DUPLEX_STREAMED), or names the destination in
its answer to the held body (BUFFERED, the gateway's choice: protocol.py); the response's
headers and body chunks pass through it untouched, and their end closes the request's bookkeeping (engine in-flight and
pending counts, the admission slot).

    destination = relay of the decode engine   when it has one (P/D: the relay prefills on the
                                                prefill engine named in x-tandem-prefill-endpoint)
                = the decode engine itself      otherwise (local prefill only)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

import grpc
import msgspec
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

from tandem.router.admission import QueueFull, parse_priority
from tandem.router.call import ClientError
from tandem.router.config import RouterConfig
from tandem.router.decision import Reason, RoutePlan
from tandem.router.engines import Engine
from tandem.router.epp import protocol
from tandem.router.errors import error_body
from tandem.router.httpserver import Request
from tandem.router.predict.predictor import Ticket
from tandem.router.proxy import CompletionProxy
from tandem.router.relay import completion_tokens, output_events
from tandem.router.trust import ClientTrust
from tandem.router.validation import InvalidRequest, parse_body

log = logging.getLogger("tandem.router.epp")
_encode_json = msgspec.json.Encoder().encode
_GENERATE = {"/v1/completions": False, "/v1/chat/completions": True}
_CLIENT_SET_HEADERS = (
    protocol.PREFILL_HEADER,
    protocol.SIDE_CHANNEL_HEADER,
)  # only the picker may set these


def address(url: str) -> str:
    """host:port of an engine URL (the form the protocol's endpoints take)."""
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


@dataclass(slots=True, frozen=True)
class Pick:
    """Where a request goes and what the picker changes on it."""

    endpoint: str  # ip:port
    set_headers: tuple[tuple[str, str], ...] = ()
    remove: tuple[str, ...] = ()
    body: bytes | None = None  # the request body when the picker changed it


def answers(
    pick: Pick | ext_proc.ProcessingResponse, raw: bytes, buffered: bool
) -> list[ext_proc.ProcessingResponse]:
    """The answers to a request body in the gateway's body mode (protocol.py): an immediate
    response as it is; a pick in the body's answer (BUFFERED), or in the headers' answer followed
    by the body streamed back (FULL_DUPLEX_STREAMED)."""
    if isinstance(pick, ext_proc.ProcessingResponse):
        return [pick]
    if buffered:
        return [
            protocol.destination_body_response(
                pick.endpoint, pick.set_headers, pick.remove, pick.body
            )
        ]
    body = raw if pick.body is None else pick.body
    return [
        protocol.destination_response(pick.endpoint, pick.set_headers, pick.remove),
        protocol.body_chunk(body, True, request=True),
    ]


@dataclass(slots=True)
class Placed:
    """The engines one request holds until its response ends."""

    endpoint: str  # ip:port the gateway sends it to
    decode: Engine
    prefill: Engine | None
    # the `predictive` policy's record of the request, and what its answer shows
    ticket: Ticket | None = None
    chat: bool = False
    body: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    first_byte: float | None = None
    last_event: float | None = None
    events: int = 0  # stream events of the answer
    tail: bytes = b""  # its last chunk (a whole answer's usage)
    tenant: str = ""  # whose admission slot it holds


class EndpointPicker(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """The ext_proc service over the router's state (`proxy.state`)."""

    def __init__(self, config: RouterConfig, proxy: CompletionProxy, trust: ClientTrust):
        assert config.epp is not None
        self.config = config
        self.epp = config.epp
        self.proxy = proxy
        self.state = proxy.state
        self.metrics = proxy.metrics
        self.trust = trust
        self._priority_header = config.admission.priority_header.lower()

    def destination(self, engine: Engine) -> tuple[str, bool]:
        """Where the gateway sends a request decoded on `engine`, and whether a relay is there."""
        relay = self.epp.relays.get(engine.url)
        if relay is not None:
            return relay, True
        if self.epp.relay_port is not None and not engine.colocated:
            return f"{urlsplit(engine.url).hostname}:{self.epp.relay_port}", True
        return address(engine.url), False

    async def Process(
        self, requests: AsyncIterator[ext_proc.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> None:
        """Reads and answers on `context`: an answer can be written while the request waits in
        admission (a BUFFERED request's timeout extended, see `_admit`)."""
        write = context.write
        headers: dict[str, str] = {}
        subset: frozenset[str] | None = None
        buffered = False
        chunks: list[bytes] = []
        size = 0
        placed: Placed | None = None
        try:
            while (message := await context.read()) is not grpc.aio.EOF:
                kind = message.WhichOneof("request")
                if kind == "request_headers":
                    headers = protocol.header_map(message.request_headers)
                    subset = protocol.subset_of(message.metadata_context)
                    buffered = protocol.buffered(message)
                    if message.request_headers.end_of_stream:
                        pick = self._plain(subset)
                        if isinstance(pick, Pick):
                            pick = protocol.destination_response(pick.endpoint, (), pick.remove)
                        await write(pick)
                    elif buffered:
                        await write(protocol.proceed())
                elif kind == "request_body":
                    chunks.append(message.request_body.body)
                    size += len(message.request_body.body)
                    if size > self.config.admission.max_body_bytes:
                        self.metrics.child(self.metrics.rejected, "too_large").inc()
                        await write(
                            protocol.immediate(413, error_body(413, "request body too large"))
                        )
                        return
                    if message.request_body.end_of_stream:
                        body = b"".join(chunks)
                        extend = self._extension(write) if buffered else None
                        pick, placed = await self._pick(headers, subset, body, extend)
                        for answer in answers(pick, body, buffered):
                            await write(answer)
                elif kind == "request_trailers":
                    await write(protocol.trailers(request=True))
                elif kind == "response_headers":
                    await write(protocol.response_headers())
                    if message.response_headers.end_of_stream and placed is not None:
                        self._finish(placed)
                        placed = None
                elif kind == "response_body":
                    part = message.response_body
                    await write(protocol.body_chunk(part.body, part.end_of_stream, request=False))
                    if placed is not None and part.body:
                        self._answered(placed, part.body)
                    if part.end_of_stream and placed is not None:
                        self._finish(placed)
                        placed = None
                elif kind == "response_trailers":
                    await write(protocol.trailers(request=False))
                    if placed is not None:
                        self._finish(placed)
                        placed = None
        finally:
            if placed is not None:
                self._finish(placed)  # the client or the gateway went away mid-request

    # -- picking -----------------------------------------------------------------------------

    def _plain(self, subset: frozenset[str] | None) -> Pick | ext_proc.ProcessingResponse:
        """Anything but a completion (GET /v1/models, /health): the least loaded decode engine."""
        engines = self._allowed(self.state.pool.candidates("decode"), subset)
        if not engines:
            return self._unavailable()
        running = self.config.scoring.running_weight
        engine = min(engines, key=lambda e: e.load(running))
        endpoint, _ = self.destination(engine)
        return Pick(endpoint, remove=_CLIENT_SET_HEADERS)

    def _allowed(self, engines: list[Engine], subset: frozenset[str] | None) -> list[Engine]:
        if subset is None:
            return engines
        return [e for e in engines if self.destination(e)[0] in subset]

    def _unavailable(self) -> ext_proc.ProcessingResponse:
        self.metrics.child(self.metrics.requests, "none", "503").inc()
        return protocol.immediate(
            503, error_body(503, "no healthy decode engine"), {"retry-after": "2"}
        )

    def _extension(
        self, write: Callable[[ext_proc.ProcessingResponse], Awaitable[None]]
    ) -> Callable[[], Awaitable[None]]:
        """Asks Envoy, once, to wait for the pick as long as the router's admission queue (or its
        wait for a decode engine, which stays under it) may hold the request, and 5 s more, so
        that its `message_timeout` does not send a waiting request on unplaced under FailOpen
        (Envoy caps it at its `max_message_timeout`)."""
        answer = protocol.extend_timeout(self.config.timeouts.request_s + 5.0)
        sent = False

        async def extend() -> None:
            nonlocal sent
            if not sent:
                sent = True
                await write(answer)

        return extend

    async def _pick(
        self,
        headers: dict[str, str],
        subset: frozenset[str] | None,
        raw: bytes,
        extend: Callable[[], Awaitable[None]] | None = None,
    ) -> tuple[Pick | ext_proc.ProcessingResponse, Placed | None]:
        """A request with a body: where it goes (and the engines it holds), or an immediate
        error; `extend` is called before the request waits in admission."""
        path = headers.get(":path", "").split("?", 1)[0]
        chat = _GENERATE.get(path)
        if chat is None or headers.get(":method") != "POST":
            return self._plain(subset), None
        request = Request("POST", path, "", headers, raw, "")
        if not self.trust.authorized(request):
            return protocol.immediate(401, error_body(401, "Unauthorized")), None
        self.metrics.arrivals.inc()  # the demand that keeps a cluster with scale-to-zero awake
        try:
            body = parse_body(raw, chat, self.proxy.accepted_model_names())
        except InvalidRequest as exc:
            self.metrics.child(self.metrics.rejected, "invalid").inc()
            return protocol.immediate(exc.status, exc.body), None
        changed = None
        if "kv_transfer_params" in body:
            # A client must never steer a decode engine to a host (as in the router).
            del body["kv_transfer_params"]
            self.metrics.stripped.inc()
            raw = changed = _encode_json(body)
        trusted = self.trust.trusted(request)
        priority = parse_priority(headers.get(self._priority_header)) if trusted else 0
        tenant = self.state.tenants.identify(headers, trusted)
        refused = await self._admit(priority, tenant, extend)
        if refused is not None:
            return refused, None
        try:
            placed = await self._place(
                request, body, chat, subset, (trusted, priority, tenant), extend
            )
        except ClientError as exc:
            placed = protocol.immediate(exc.status, exc.body, dict(exc.headers))
        except BaseException:
            self.state.admission.release(tenant)
            raise
        if not isinstance(placed, Placed):
            self.state.admission.release(tenant)
            return placed, None
        headers_set = [("content-length", str(len(raw)))]
        if placed.prefill is not None:
            headers_set.append((protocol.PREFILL_HEADER, address(placed.prefill.url)))
            headers_set.append(
                (protocol.SIDE_CHANNEL_HEADER, str(placed.prefill.side_channel_port))
            )
        remove = () if placed.prefill is not None else _CLIENT_SET_HEADERS
        return Pick(placed.endpoint, tuple(headers_set), remove, changed), placed

    async def _admit(
        self, priority: int, tenant: str, extend: Callable[[], Awaitable[None]] | None
    ) -> ext_proc.ProcessingResponse | None:
        """The router's admission (in-flight cap, priority bands, tenants' fair shares): None
        once a slot is held."""
        admission = self.state.admission
        arrived = time.perf_counter()
        try:
            if not admission.try_acquire(tenant):
                if extend is not None:
                    await extend()
                async with asyncio.timeout(self.config.timeouts.request_s):
                    await admission.acquire(priority, tenant=tenant)
            self.state.count_admission(tenant, time.perf_counter() - arrived)
            return None
        except QueueFull as full:
            reason = "shed" if full.dropped else "queue_full"
            self.state.count_refusal(reason, tenant)
            return protocol.immediate(
                429,
                error_body(429, "The router's queue is full; retry later."),
                {"retry-after": str(full.retry_after_s)},
            )
        except TimeoutError:
            self.state.count_refusal("queue_timeout", tenant)
            return protocol.immediate(
                503,
                error_body(503, "Timed out waiting in the router's queue."),
                {"retry-after": "5"},
            )

    async def _place(
        self,
        request: Request,
        body: dict[str, Any],
        chat: bool,
        subset: frozenset[str] | None,
        client: tuple[bool, int, str],
        extend: Callable[[], Awaitable[None]] | None = None,
    ) -> Placed | ext_proc.ProcessingResponse:
        """The router's plan for the request as a destination (and a prefill engine), or the
        error to answer with. `client` is (trusted, priority, tenant); `extend` is called before
        the request waits for a decode engine (scale from zero)."""
        trusted, priority, tenant = client
        started = time.perf_counter()
        proxy = self.proxy
        target = proxy.slo_target(request, priority, trusted)
        features = await proxy.features(body, chat)
        retry_after = self.state.tenants.charge(tenant, features.prompt_tokens, body)
        if retry_after:
            self.state.count_refusal("rate_limit", tenant)
            return protocol.immediate(
                429,
                error_body(429, f"Tenant {tenant} is over its token rate; retry later."),
                {"retry-after": str(retry_after)},
            )
        plan, index_name, predictive = proxy.plan(body, chat, request.headers, features, target)
        if plan is None and self.config.admission.engine_wait_s:  # scale from zero
            if extend is not None:
                await extend()
            if await proxy.scale_from_zero.wait_for_engine():
                plan, index_name, predictive = proxy.plan(
                    body, chat, request.headers, features, target
                )
        if plan is None:
            raise proxy.scale_from_zero.no_engine()
        if subset is not None:
            plan = self._within(plan, subset)
        if plan is None:
            return self._unavailable()
        if plan.placement is not None and plan.placement.shed:
            self.metrics.child(self.metrics.rejected, "slo").inc()
            return protocol.immediate(
                429, error_body(429, "The request's SLO targets cannot be met now; retry later.")
            )
        decode = plan.decode.engine
        endpoint, relayed = self.destination(decode)
        # P/D needs the relay beside the decode engine; without one the engine prefills itself.
        prefill = plan.prefill_ranking[0].engine if plan.prefill_ranking and relayed else None
        reason = plan.reason if prefill is not None or not plan.prefill_ranking else Reason.LOCAL
        metrics = self.metrics
        metrics.child(metrics.prefix_query_blocks, index_name).inc(len(features.keys))
        if plan.decode.hit_blocks:
            metrics.child(metrics.prefix_hit_blocks, index_name).inc(plan.decode.hit_blocks)
            metrics.child(metrics.prefix_hits, index_name).inc()
        proxy.scale_from_zero.count_prefill_wanted(
            plan, features, body.get("n") or 1, prefill is not None
        )
        metrics.child(metrics.decisions, reason.value).inc()
        metrics.routing.observe(time.perf_counter() - started)
        proxy.remember(features, plan.decode.engine, prefill)
        for engine in (decode, prefill):
            if engine is not None:
                engine.in_flight += 1
                engine.pending += 1
        ticket = None
        placed = plan.placement or plan.place_later
        if placed is not None and predictive is not None:
            streaming = body.get("stream") is True
            ticket = predictive.predictor.ticket(placed, predictive.keys, streaming)
            # its share (and a placement made later) taken once this answer to Envoy is on its
            # way, before the engine's first byte changes what the plan read
            asyncio.get_running_loop().call_soon(predictive.predictor.settle)
        return Placed(endpoint, decode, prefill, ticket, chat, body, tenant=tenant)

    def _within(self, plan: RoutePlan, subset: frozenset[str]) -> RoutePlan | None:
        """The plan with its decode ranking cut to the data plane's subset; None if none is left."""
        ranking = [c for c in plan.decode_ranking if self.destination(c.engine)[0] in subset]
        if not ranking:
            return None
        return replace(plan, decode_ranking=ranking)

    # -- bookkeeping -------------------------------------------------------------------------

    @staticmethod
    def _answered(placed: Placed, chunk: bytes) -> None:
        """A body chunk of the answer: the first is the decode engine's first byte (the prefill
        is over, as the router counts it); stream events are counted for the predictor."""
        now = time.perf_counter()
        if placed.first_byte is None:
            placed.first_byte = now
            EndpointPicker._release_prefill(placed)
            if placed.ticket is not None:
                placed.ticket.prefilled(placed.prefill is not None, None)
                placed.ticket.first_byte(placed.decode, now, placed.started, None)
        placed.last_event = now
        placed.events += chunk.count(b"data:")
        placed.tail = chunk

    @staticmethod
    def _release_prefill(placed: Placed) -> None:
        placed.decode.pending -= 1
        if placed.prefill is not None:
            placed.prefill.pending -= 1
            placed.prefill.in_flight -= 1

    def _finish(self, placed: Placed) -> None:
        """The request ended (its response, or its stream): its engines and slot are free."""
        if placed.first_byte is None:
            self._release_prefill(placed)
        if placed.ticket is not None:
            placed.ticket.finished(_output_tokens(placed), placed.last_event)
        placed.decode.in_flight -= 1
        admission = self.state.admission
        admission.release(placed.tenant)
        admission.observe_service_time(time.perf_counter() - placed.started)


def _output_tokens(placed: Placed) -> int | None:
    """The answer's output tokens as the router reads them: stream events, or a whole answer's
    usage; None when nothing came back."""
    if placed.first_byte is None:
        return None
    if placed.body.get("stream") is True:
        return output_events(placed.chat, placed.body, placed.events)
    return completion_tokens(placed.tail)
