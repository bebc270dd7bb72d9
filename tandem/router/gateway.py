"""The gateway: one HTTP endpoint in front of several models' routers, in one process.

Each model is a whole `RouterService` (discovery, prefix index, scorers, P/D handoff, admission
queue with tenant fair shares) without a port of its own; the gateway reads the request body's
`model`, hands the request to the router serving that name (its served name, or any name its
proxy answers to, such as an adapter), and answers vLLM's 404 for a name nobody serves. No extra
hop: the router of the model is called in-process. A client key opens the models whose routers
accept it (401 otherwise); /v1/models lists those; /health is ready while any model has a healthy
decode engine; /metrics merges the models' metrics with a `model` label.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any

import msgspec

from tandem.router.config import GatewayConfig
from tandem.router.errors import error_body
from tandem.router.httpserver import HttpServer, Request, Responder
from tandem.router.metrics_merge import merge_families, render_families
from tandem.router.service import RouterService

log = logging.getLogger("tandem.router.gateway")

_COMPLETIONS = ("/v1/completions", "/v1/chat/completions")
_encode_json = msgspec.json.Encoder().encode
_decode_json = msgspec.json.Decoder().decode
MODEL_LABEL = "model"


class _Named(msgspec.Struct):
    """The one field of a request body the gateway reads; the rest is the model router's."""

    model: str | None = None


_decode_named = msgspec.json.Decoder(_Named).decode


def unknown_model(name: str, served: list[str]) -> bytes:
    """vLLM's 404 body for a model it does not serve (tests/fixtures/vllm-0.32/single/10_*)."""
    return error_body(
        404, f"The model `{name}` does not exist. Valid aliases: {', '.join(served)}.", "model"
    )


class GatewayService:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.routers = [RouterService(config.router_config(m)) for m in config.models]
        max_body = max(m.admission.max_body_bytes for m in config.models)
        self.server = HttpServer(self.handle, max_body, config.http)
        self.admin_server = (
            HttpServer(self.handle_admin, 1024, config.http)
            if config.trust.admin_port is not None
            else None
        )
        self.port = 0
        self.admin_port: int | None = None

    def served_names(self, request: Request | None = None) -> list[str]:
        """Every model name served, or those whose routers accept `request`'s key."""
        return sorted(
            name
            for router in self._open_to(request)
            for name in router.proxy.accepted_model_names()
        )

    def _open_to(self, request: Request | None) -> list[RouterService]:
        if request is None:
            return self.routers
        return [router for router in self.routers if router.trust.authorized(request)]

    def router_of(self, name: str) -> RouterService | None:
        for router in self.routers:
            if name in router.proxy.accepted_model_names():
                return router
        return None

    async def start(self) -> int:
        await asyncio.gather(*(router.start_pools() for router in self.routers))
        self.port = await self.server.start(self.config.host, self.config.port)
        if self.admin_server is not None and self.config.trust.admin_port is not None:
            self.admin_port = await self.admin_server.start(
                self.config.host, self.config.trust.admin_port
            )
        log.info(
            "gateway listening on %s:%d for %s",
            self.config.host,
            self.port,
            ", ".join(self.served_names()),
        )
        return self.port

    async def stop(self) -> None:
        await self.server.close()
        if self.admin_server is not None:
            await self.admin_server.close()
        for router in self.routers:
            await router.stop()

    # -- HTTP --------------------------------------------------------------------------------

    async def handle(self, request: Request, responder: Responder) -> None:
        path = request.path
        if path not in _COMPLETIONS or request.method != "POST":
            await self._handle_other(request, responder)
            return
        router = self._route(request, responder)
        if router is None:
            return
        if router.trust.authorized(request):
            await router.proxy.generate(request, responder, chat=path == _COMPLETIONS[1])
        else:
            _unauthorized(responder)

    def _route(self, request: Request, responder: Responder) -> RouterService | None:
        """The router of the body's model; None once it has answered the client itself (a 404
        names only the models the client's key opens, a 401 when it opens none)."""
        try:
            name = _decode_named(request.body).model
        except (msgspec.DecodeError, RecursionError):
            return self.routers[0]  # its parser answers the precise 400
        if name is None:
            if len(self.routers) == 1:
                return self.routers[0]
            served = ", ".join(self.served_names(request))
            responder.send(
                400, error_body(400, f"`model` is required: this endpoint serves {served}", "model")
            )
            return None
        router = self.router_of(name)
        if router is None:
            names = self.served_names(request)
            if names:
                responder.send(404, unknown_model(name, names))
            else:
                _unauthorized(responder)
        return router

    async def _handle_other(self, request: Request, responder: Responder) -> None:
        path = request.path
        if path == "/v1/models" and self._open_to(request):
            responder.send(200, self._models(self._open_to(request)))
        elif path in ("/health", "/ping"):
            healthy = [r for r in self.routers if r.ready()]
            responder.send(
                200 if healthy else 503,
                b"" if healthy else error_body(503, "no healthy decode engine for any model"),
            )
        elif path in ("/metrics", "/engines") and self.routers[0].trust.admin_on_main_port(request):
            self._admin_path(path, responder)
        else:
            # /livez, /version, 401s, 405s and 404s are the same for every model
            await self.routers[0].handle(request, responder)

    async def handle_admin(self, request: Request, responder: Responder) -> None:
        if request.path in ("/livez", "/health"):
            await self._handle_other(request, responder)
        else:
            self._admin_path(request.path, responder)

    def _admin_path(self, path: str, responder: Responder) -> None:
        if path == "/metrics":
            expositions = [
                (r.config.served_model_name, r.metrics.render().decode()) for r in self.routers
            ]
            responder.send(
                200,
                render_families(merge_families(expositions, MODEL_LABEL)),
                content_type="text/plain; version=0.0.4; charset=utf-8",
            )
        elif path == "/engines":
            engines = [
                {**router._describe(engine, costs), MODEL_LABEL: router.config.served_model_name}
                for router, costs in ((r, r.removal_costs()) for r in self.routers)
                for engine in router.pool.engines.values()
            ]
            responder.send(200, _encode_json(engines))
        else:
            responder.send(404, b'{"detail":"Not Found"}')

    @staticmethod
    def _models(routers: list[RouterService]) -> bytes:
        cards: list[Any] = []
        for router in routers:
            cards += _decode_json(router._models())["data"]
        return _encode_json({"object": "list", "data": cards})


def _unauthorized(responder: Responder) -> None:
    responder.send(401, error_body(401, "Unauthorized"), [("www-authenticate", "Bearer")])


async def serve(config: GatewayConfig) -> int:
    """Run the gateway until SIGTERM or SIGINT; the exit status."""
    gateway = GatewayService(config)
    await gateway.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await gateway.stop()
    return 0
