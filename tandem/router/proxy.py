"""The request path: admission -> features -> plan (`decision.plan_route`) -> prefill -> decode stream.

`CompletionProxy` serves /v1/completions and /v1/chat/completions. Deciding is pure and lives in
`decision.py`; this module only carries a plan out (upstream I/O, metrics, the client's response).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import time
from typing import Any

import msgspec

from tandem.router.admission import QueueFull, parse_priority
from tandem.router.call import Call, ClientError, Timing
from tandem.router.config import RouterConfig
from tandem.router.decision import (
    PredictiveInputs,
    Reason,
    Route,
    RouteInputs,
    RoutePlan,
    plan_route,
)
from tandem.router.decode_retry import (
    decode_attempts,
    may_resend_without_handoff,
    may_try_another_engine,
)
from tandem.router.draining import refused_while_draining
from tandem.router.engines import Engine
from tandem.router.errors import error_body, sse_error_event
from tandem.router.features import Features
from tandem.router.httpserver import Request, Responder
from tandem.router.lora import adapter_stream
from tandem.router.predict.output_length import length_keys
from tandem.router.predict.placement import chosen_first, retry_after_s
from tandem.router.predict.slo import TPOT_HEADER, TTFT_HEADER, SloTarget, slo_target
from tandem.router.prefill_leg import Handoff, PrefillLeg
from tandem.router.relay import DecodeAnswer, Relay
from tandem.router.state import RouterState
from tandem.router.trust import ClientTrust
from tandem.router.upstream import Response, UpstreamError, UpstreamTimeout
from tandem.router.validation import InvalidRequest, parse_body
from tandem.router.wake import ScaleFromZero

log = logging.getLogger("tandem.router.proxy")

_encode_json = msgspec.json.Encoder().encode
_DECODE_ENGINES = 3  # engines of the ranking tried; decode_attempts may add one more try
_QUEUE_FULL = {
    False: "The router's queue is full; retry later.",
    True: "The router's queue is full and requests ranked above this one took its place; "
    "retry later.",
}


class CompletionProxy:
    """Serves the OpenAI completion endpoints over the engines in `state`."""

    def __init__(self, config: RouterConfig, state: RouterState, trust: ClientTrust):
        self.config = config
        self.state = state
        self.metrics = state.metrics
        self.trust = trust
        self.model_names = {config.served_model_name}
        self._priority_header = config.admission.priority_header.lower()
        self._session_header = config.admission.session_header.lower()
        self._class_targets: dict[int, SloTarget] = {}  # by priority, for requests without headers
        self._id_prefix = f"tdm-{os.urandom(6).hex()}-"
        self._ids = itertools.count(1)
        self.relay = Relay(self.metrics, self._upstream_failed)
        self.prefill_leg = PrefillLeg(config, state.upstreams, self.metrics, self._upstream_failed)
        self.predictor = state.predictor
        self.scale_from_zero = ScaleFromZero(config, state.pool, self.metrics)

    # -- entry -------------------------------------------------------------------------------

    def accepted_model_names(self) -> set[str]:
        """The base model and every LoRA adapter an engine lists."""
        names = set(self.model_names)
        for engine in self.state.pool.engines.values():
            if engine.adapters:
                names.update(engine.adapters)
        return names

    async def generate(self, request: Request, responder: Responder, chat: bool) -> None:
        timing = Timing()
        self.metrics.arrivals.inc()
        try:
            body = parse_body(request.body, chat, self.accepted_model_names())
        except InvalidRequest as exc:
            self.metrics.child(self.metrics.rejected, "invalid").inc()
            responder.send(exc.status, exc.body)
            return
        stripped = "kv_transfer_params" in body
        if stripped:
            del body["kv_transfer_params"]
            # A client must never steer a decode pod to a host: only params from our prefill pods pass.
            self.metrics.stripped.inc()
        trusted = self.trust.trusted(request)
        priority = parse_priority(request.headers.get(self._priority_header)) if trusted else 0
        call = Call(
            request,
            responder,
            body,
            chat,
            stripped,
            trusted and self.trust.wants_engines(request),
            request.headers.get("x-request-id") or f"{self._id_prefix}{next(self._ids):x}",
            timing,
            self.state.tenants.identify(request.headers, trusted),
        )
        target = self.slo_target(request, priority, trusted)
        deadline = 0.0 if target is None else timing.start + target.ttft_s
        if not await self._admit(call, priority, deadline):
            return
        timing.queue_s = time.perf_counter() - timing.start
        self.metrics.child(self.metrics.queue, str(priority)).observe(timing.queue_s)
        self.state.count_admission(call.tenant, timing.queue_s)
        try:
            await self._within_deadline(call, target)
        finally:
            admission = self.state.admission
            admission.release(call.tenant)
            admission.observe_service_time(time.perf_counter() - timing.start - timing.queue_s)

    def slo_target(self, request: Request, priority: int, trusted: bool) -> SloTarget | None:
        """The request's SLO targets under the `predictive` policy (headers only when trusted)."""
        if self.predictor is None:
            return None
        classes = self.config.scoring.predictive.slo_classes
        headers = request.headers
        ttft = headers.get(TTFT_HEADER) if trusted else None
        tpot = headers.get(TPOT_HEADER) if trusted else None
        if ttft is not None or tpot is not None:
            return slo_target(classes, priority, ttft, tpot)
        target = self._class_targets.get(priority)
        if target is None:
            target = self._class_targets[priority] = slo_target(classes, priority)
        return target

    async def _admit(self, call: Call, priority: int, deadline: float) -> bool:
        """Waits for an admission slot; answers 429/503 itself and returns False when refused."""
        admission = self.state.admission
        try:
            if not admission.try_acquire(call.tenant):
                async with asyncio.timeout(self.config.timeouts.request_s):
                    await admission.acquire(priority, deadline, call.tenant)
            return True
        except QueueFull as full:
            reason = "shed" if full.dropped else "queue_full"
            self.state.count_refusal(reason, call.tenant)
            call.responder.send(
                429,
                error_body(429, _QUEUE_FULL[full.dropped]),
                [("retry-after", str(full.retry_after_s))],
            )
        except TimeoutError:
            self.state.count_refusal("queue_timeout", call.tenant)
            call.responder.send(
                503,
                error_body(503, "Timed out waiting in the router's queue."),
                [("retry-after", "5")],
            )
        return False

    async def _within_deadline(self, call: Call, target: SloTarget | None) -> None:
        """Serves the call; past `request_s` ends it with a 504 (or a 504 event mid-stream)."""
        # One timer per request that cancels it (cheaper than asyncio.timeout on the hot path).
        task = asyncio.current_task()
        assert task is not None
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            task.cancel()

        limit = self.config.timeouts.request_s
        deadline = asyncio.get_running_loop().call_later(limit, expire)
        responder = call.responder
        try:
            await self._serve(call, target)
        except asyncio.CancelledError:
            if not expired:
                self.metrics.disconnects.inc()
                raise
            task.uncancel()
            message = f"request exceeded {limit}s"
            if responder.started:
                await responder.write(sse_error_event(504, message))
                responder.end()
            else:
                responder.send(504, error_body(504, message))
        except ClientError as exc:
            responder.send(exc.status, exc.body, exc.headers)
        finally:
            deadline.cancel()

    # -- planning ----------------------------------------------------------------------------

    async def features(self, body: dict[str, Any], chat: bool) -> Features:
        """The request's prompt features; a 400 (ClientError) when it cannot be tokenized."""
        try:
            return await self.state.featurizer.features(body, chat)
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise ClientError(400, error_body(400, f"cannot tokenize the request: {exc}")) from None

    def plan(
        self,
        body: dict[str, Any],
        chat: bool,
        headers: dict[str, str],
        features: Features,
        target: SloTarget | None,
    ) -> tuple[RoutePlan | None, str, PredictiveInputs | None]:
        """Gathers the plan's inputs from the state and calls `plan_route`; returns the plan, the
        index name and, under the `predictive` policy, the predictions the plan was made with.
        The endpoint picker (epp/) plans with it too, so both place a request alike."""
        state = self.state
        exact = state.use_exact and features.exact
        index = state.exact_index if exact else state.approx_index
        adapter = features.adapter
        decoders = [e for e in state.pool.candidates("decode") if e.serves_model(adapter)]
        prefillers = [
            e
            for e in state.pool.candidates("prefill")
            if not e.colocated and e.serves_model(adapter)
        ]
        engines = [e.id for e in (*decoders, *prefillers)]
        keys = features.keys
        session = headers.get(self._session_header) or None
        predictive = self._predictive(body, chat, features, session, target)
        inputs = RouteInputs(
            prompt_tokens=features.prompt_tokens,
            total_blocks=len(keys),
            n=body.get("n") or 1,
            decoders=decoders,
            prefillers=prefillers,
            any_prefill_configured=any(not e.colocated for e in state.pool.all("prefill")),
            hits=index.match(keys, engines) if keys else {},
            cached_blocks={e: index.size(e) for e in engines} if len(engines) > 1 else {},
            first_block_key=features.first_block_key,
            session=session,
            adapter=adapter,
            predictive=predictive,
        )
        index_name = "exact" if exact else "approximate"
        return plan_route(inputs, self.config), index_name, predictive

    def _predictive(
        self,
        body: dict[str, Any],
        chat: bool,
        features: Features,
        session: str | None,
        target: SloTarget | None,
    ) -> PredictiveInputs | None:
        predictor = self.predictor
        if predictor is None or target is None:
            return None
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        max_tokens = max_tokens if isinstance(max_tokens, int) else None
        group = session if session is not None else features.first_block_key
        keys = length_keys(chat, max_tokens, features.prompt_tokens, group)
        return PredictiveInputs(predictor, target, keys, max_tokens, time.monotonic())

    # -- carrying a plan out -----------------------------------------------------------------

    async def _serve(self, call: Call, target: SloTarget | None) -> None:
        """Plans the request and carries the plan out; when every decode engine refused it before
        answering (a pool just put to sleep that the health checks had not caught yet), it waits
        for an engine like a request that found none, and is planned and carried out once more."""
        t_route = time.perf_counter()
        features = await self.features(call.body, call.chat)
        self._charge_tenant(call, features)
        plan_now = functools.partial(
            self.plan, call.body, call.chat, call.request.headers, features, target
        )
        plan, index_name, predictive = plan_now()
        if plan is None and await self.scale_from_zero.wait_for_engine():
            plan, index_name, predictive = plan_now()
        if plan is None:
            raise self.scale_from_zero.no_engine()
        try:
            await self._carry_out_predicted(call, features, plan, index_name, predictive, t_route)
        except ClientError as exc:
            gone = exc.status == 502 and not self.state.pool.candidates("decode")
            if (
                not gone
                or call.responder.started
                or not await self.scale_from_zero.wait_for_engine()
            ):
                raise
            again, index_name, predictive = plan_now()
            if again is None:
                raise
            await self._carry_out_predicted(
                call, features, again, index_name, predictive, time.perf_counter()
            )

    async def _carry_out_predicted(
        self,
        call: Call,
        features: Features,
        plan: RoutePlan,
        index_name: str,
        predictive: PredictiveInputs | None,
        t_route: float,
    ) -> None:
        """`_carry_out`; under the predictive policy first a 429 for a placement that sheds the
        request, else a ticket of this plan's predictions (a request planned again gets a new
        one: what a plan's engines learn and hold is that plan's), given back when it ends. A
        plan decided without them has them made once the request is sent (`Predictor.ticket`)."""
        placement = plan.placement
        placed = placement or plan.place_later
        if predictive is None or placed is None:
            await self._carry_out(call, features, plan, index_name, t_route)
            return
        if placement is not None and placement.shed:
            metrics = self.metrics
            metrics.child(metrics.rejected, "slo").inc()
            metrics.child(metrics.requests, "none", "429").inc()
            raise ClientError(
                429,
                error_body(429, "The request's SLO targets cannot be met now; retry later."),
                [("retry-after", str(retry_after_s(placement, predictive.target)))],
            )
        predictor = predictive.predictor
        ticket = call.ticket = predictor.ticket(
            placed, predictive.keys, call.body.get("stream") is True
        )
        # its share of the ledgers (and a placement made later) taken when this task first
        # waits: after the upstream write, before anything its plan read has changed
        asyncio.get_running_loop().call_soon(predictor.settle)
        try:
            if placement is not None and placement.hold_s > 0.0:  # a local prefill (hold(d))
                # its blocks pending on its engine from now, so that what follows it while it is
                # held is placed as if it had been sent (a burst of one prefix stays together)
                self.remember(features, plan.decode.engine, None)
                t_route += await ticket.past_the_shared_step()  # the routing time leaves it out
            await self._carry_out(call, features, plan, index_name, t_route)
        finally:
            ticket.finished(call.output_tokens, call.last_event)

    def _charge_tenant(self, call: Call, features: Features) -> None:
        """Takes the request's tokens from its tenant's bucket, or refuses it with a 429."""
        retry_after = self.state.tenants.charge(call.tenant, features.prompt_tokens, call.body)
        if retry_after:
            self.state.count_refusal("rate_limit", call.tenant)
            raise ClientError(
                429,
                error_body(429, f"Tenant {call.tenant} is over its token rate; retry later."),
                [("retry-after", str(retry_after))],
            )

    async def _carry_out(
        self, call: Call, features: Features, plan: RoutePlan, index_name: str, t_route: float
    ) -> None:
        timing = call.timing
        metrics = self.metrics
        total_blocks = len(features.keys)
        hit_blocks = plan.decode.hit_blocks
        metrics.child(metrics.prefix_query_blocks, index_name).inc(total_blocks)
        if hit_blocks:
            metrics.child(metrics.prefix_hit_blocks, index_name).inc(hit_blocks)
            metrics.child(metrics.prefix_hits, index_name).inc()
        timing.schedule_s = time.perf_counter() - t_route
        metrics.routing.observe(timing.schedule_s)

        handoff = (
            await self.prefill_leg.prefill(call, plan.prefill_ranking)
            if plan.prefill_ranking
            else None
        )
        ranking = [c.engine for c in plan.decode_ranking]
        ticket = call.ticket
        if ticket is not None:
            if handoff is not None:
                chosen = ticket.hand_off(self.state.pool.candidates("decode"), time.monotonic())
                ranking = chosen_first(chosen, ranking)
            else:
                await ticket.behind_pulls()
            ticket.prefilled(handoff is not None, timing.prefill_s)
        reason = plan.reason
        if plan.route is Route.DISAGGREGATED and handoff is None:
            reason = Reason.FALLBACK  # every prefill engine failed: the decode engine prefills
        self.scale_from_zero.count_prefill_wanted(
            plan, features, call.body.get("n") or 1, handoff is not None
        )
        metrics.child(metrics.decisions, reason.value).inc()
        self.remember(features, ranking[0], None if handoff is None else handoff.engine)
        hit = f"{hit_blocks}/{total_blocks}"
        with adapter_stream(ranking[0].adapter_streams, features.adapter):
            if await self._decode(call, ranking, handoff, hit):
                # The decode engine could not use the prefill's KV, or its connection broke
                # before answering: once more, prefilling it on a decode engine.
                metrics.child(metrics.retries, "decode", "kv_transfer").inc()
                await self._decode(call, ranking, None, hit)

    def _client_headers(
        self, call: Call, handoff: Handoff | None, hit: str
    ) -> list[tuple[str, str]]:
        route = Route.LOCAL if handoff is None else Route.DISAGGREGATED
        headers = [("x-tandem-route", route.value), ("x-tandem-prefix-hit", hit)]
        headers.append(("x-request-id", call.request_id))
        if call.show_engines and handoff is not None:
            headers.append(("x-tandem-prefill-engine", handoff.engine.id))
        return headers

    def remember(self, features: Features, decode: Engine, prefill: Engine | None) -> None:
        """Routing history for the approximate index, the blocks now pending on the chosen
        engines in the exact one (until their KV events confirm them)."""
        state = self.state
        if features.keys:
            pending = features.keys if state.use_exact and features.exact else ()
            engines = [decode] if prefill is None else [prefill, decode]
            for engine in engines:
                state.approx_index.touch(engine.id, features.keys)
                state.exact_index.add_pending(engine.id, pending)

    def _payload(self, call: Call, handoff: Handoff | None) -> bytes:
        """The decode request's body: the client's bytes untouched unless something changed."""
        if handoff is not None:
            return _encode_json({**call.body, "kv_transfer_params": handoff.params})
        if call.stripped:
            return _encode_json(call.body)
        return call.request.body  # no re-serialisation on the plain path

    def _upstream_failed(self, pool: str, engine: Engine, exc: UpstreamError) -> None:
        """Counts a failed upstream request; a refused connection marks the engine down at once
        (the monitor brings it back when /health answers) and drops the blocks pending on it:
        the requests they stand for never reached it, and a restarted engine starts empty."""
        timeout = isinstance(exc, UpstreamTimeout)
        kind = "timeout" if timeout else "connect" if exc.connect else "broken"
        self.metrics.child(self.metrics.upstream_errors, pool, engine.id, kind).inc()
        if exc.connect and not timeout:
            engine.healthy = False
            self.state.exact_index.clear_pending(engine.id)
        log.warning("%s on %s failed: %s", pool, engine.id, exc)

    async def _decode(
        self, call: Call, ranking: list[Engine], handoff: Handoff | None, hit: str
    ) -> bool:
        """Sends the decode request (another engine on a refused connection) and relays the
        answer. After a handoff, an answer that failed before any output (a failed KV pull,
        `kv_failure.py`) is not relayed, nor is a connection that broke before any answer
        (`decode_retry.py`): returns True to have it sent again without the handoff."""
        route = Route.LOCAL if handoff is None else Route.DISAGGREGATED
        headers = self._client_headers(call, handoff, hit)
        payload = self._payload(call, handoff)
        engine, response, failure = await self._open_decode(call, ranking, payload, route)
        if call.show_engines:
            headers.append(("x-tandem-decode-engine", engine.id))
            if call.ticket is not None:
                predicted = call.ticket.predicted_ttft_s() * 1e3
                headers.append(("x-tandem-predicted-ttft-ms", f"{predicted:.3f}"))
        if response is None:
            if handoff is not None and failure is not None and may_resend_without_handoff(failure):
                return True
            self.metrics.child(self.metrics.requests, route.value, "502").inc()
            raise ClientError(
                502, error_body(502, "no decode engine could serve the request"), headers
            )
        try:
            answer = DecodeAnswer(call, engine, response, route, headers, handoff is not None)
            if (response.header("content-type") or "").startswith("text/event-stream"):
                return await self.relay.stream(answer)
            return await self.relay.body(answer)
        finally:
            engine.in_flight -= 1
            response.release()  # closes the socket if incomplete: the engine aborts the request

    async def _refused(self, engine: Engine, response: Response) -> bool:
        """Reads a decode engine's 500; True (the request released, the engine marked draining)
        when it is vLLM's refusal of a draining engine. Otherwise the body stays readable for the
        client's answer."""
        try:
            body = await response.read()
        except UpstreamError:
            return False  # the relay meets the same error and answers it
        if not refused_while_draining(response.status, body):
            return False
        engine.in_flight -= 1
        engine.pending -= 1
        engine.draining = True
        response.release()
        self.metrics.child(self.metrics.upstream_errors, "decode", engine.id, "draining").inc()
        return True

    async def _open_decode(
        self, call: Call, ranking: list[Engine], payload: bytes, route: Route
    ) -> tuple[Engine, Response | None, UpstreamError | None]:
        """The engine whose response head arrived, and the response; or the last engine tried,
        None and the last failure (None when every engine refused as draining). The engine's
        in_flight and pending counts include the request from here on (pending until its first
        byte).

        An engine that could not be reached moves on to the next (`may_try_another_engine`), as
        does one that refused the request because it is draining (`refused_while_draining`); when
        the connect timed out at every one, the first is tried once more (`decode_attempts`).
        """
        headers = [("content-type", "application/json"), ("x-request-id", call.request_id)]
        if call.timing.upstream_start is None:
            call.timing.upstream_start = time.perf_counter()
        engine = ranking[0]
        failures: list[UpstreamError] = []
        for attempt, engine in enumerate(decode_attempts(ranking[:_DECODE_ENGINES], failures)):
            if attempt:
                self.metrics.child(self.metrics.retries, "decode", "connect").inc()
            engine.in_flight += 1
            engine.pending += 1
            try:
                response = await self.state.upstreams.pool(engine.url).request(
                    "POST", call.request.path, payload, headers, self.config.timeouts.decode_idle_s
                )
            except BaseException as exc:
                engine.in_flight -= 1
                engine.pending -= 1
                if not isinstance(exc, UpstreamError):
                    raise
                self._upstream_failed("decode", engine, exc)
                failures.append(exc)
                if may_try_another_engine(exc, route):
                    continue
                return engine, None, exc
            plain = not (response.header("content-type") or "").startswith("text/event-stream")
            if response.status == 500 and plain and await self._refused(engine, response):
                continue
            return engine, response, None
        return engine, None, failures[-1] if failures else None
