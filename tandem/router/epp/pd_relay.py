"""`tandem relay`: the P/D hop behind an endpoint picker, beside one decode engine.

A gateway sends each request to the endpoint the picker named. For a P/D route that is this
relay, with the prefill engine in `x-tandem-prefill-endpoint` (host:port) and its NIXL side
channel in `x-tandem-prefill-side-channel`; the relay then does what `tandem router` does after
its plan, with the router's own code (`CompletionProxy`): the prefill request, the check that the
answer's `kv_transfer_params` name that engine, the decode request to its local engine with them,
a local prefill when every prefill attempt failed, and a resend without them when the engine
could not pull the KV. Without the header the request goes to the local engine as it came (a
local route). Every other path is passed through to the engine.

The headers are trusted as the router trusts its discovery: the picker sets or removes them on
every request, so a client cannot choose the prefill engine through the gateway; the relay's
port must be reachable from the gateway only (a NetworkPolicy in a cluster).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import time
from collections import OrderedDict

from tandem.router.call import Call, ClientError
from tandem.router.config import RouterConfig, StaticDiscovery, StaticEndpoint
from tandem.router.decision import Reason, Route, RoutePlan
from tandem.router.engines import Engine
from tandem.router.epp.protocol import PREFILL_HEADER, SIDE_CHANNEL_HEADER
from tandem.router.errors import error_body
from tandem.router.features import Features
from tandem.router.httpserver import HttpServer, Request, Responder
from tandem.router.monitor import EngineMonitor
from tandem.router.predict.slo import SloTarget
from tandem.router.proxy import CompletionProxy
from tandem.router.scoring import Choice
from tandem.router.state import RouterState
from tandem.router.trust import ClientTrust
from tandem.router.upstream import UpstreamError

log = logging.getLogger("tandem.relay")
_NO_FEATURES = Features(prompt_tokens=0, keys=[], exact=False)  # the picker indexed the prompt
_MAX_PREFILL_ENGINES = 256  # prefill engines remembered (pooled connections) at once
_PASS_HEADERS = ("content-type", "accept", "x-request-id")  # the engine key authenticates


def prefill_target(headers: dict[str, str]) -> tuple[str, int] | None:
    """(prefill engine URL, side-channel port) from the picker's headers; None without them;
    a 400 (ClientError) when they are malformed."""
    endpoint = headers.get(PREFILL_HEADER)
    if not endpoint:
        return None
    host, _, port = endpoint.rpartition(":")
    side = headers.get(SIDE_CHANNEL_HEADER, "")
    if not host or not port.isdigit() or not side.isdigit():
        raise ClientError(
            400, error_body(400, f"malformed {PREFILL_HEADER} / {SIDE_CHANNEL_HEADER} headers")
        )
    return f"http://{endpoint}", int(side)


class RelayProxy(CompletionProxy):
    """The router's request flow with a plan read from the picker's headers: decode on the
    local engine, prefill first on the named engine when there is one."""

    def __init__(self, config: RouterConfig, state: RouterState, engine: Engine):
        super().__init__(config, state, ClientTrust(config))
        self.engine = engine
        self.prefill_engines: OrderedDict[str, Engine] = OrderedDict()

    def prefill_engine(self, url: str, side_channel_port: int) -> Engine:
        """The engine for `url`, kept (with its pooled connections) for the next request."""
        engine = self.prefill_engines.get(url)
        if engine is not None and engine.side_channel_port == side_channel_port:
            self.prefill_engines.move_to_end(url)
            return engine
        if len(self.prefill_engines) >= _MAX_PREFILL_ENGINES:
            oldest, _ = self.prefill_engines.popitem(last=False)
            self.state.upstreams.drop(oldest)
        engine = Engine(url, frozenset({"prefill"}), side_channel_port=side_channel_port)
        self.prefill_engines[url] = engine
        return engine

    async def _serve(self, call: Call, target: SloTarget | None) -> None:
        started = time.perf_counter()
        named = prefill_target(call.request.headers)
        local = [Choice(self.engine, 0.0, 0)]
        if named is None:
            plan = RoutePlan(local, Route.LOCAL, Reason.LOCAL, [])
        else:
            prefill = Choice(self.prefill_engine(*named), 0.0, 0)
            plan = RoutePlan(local, Route.DISAGGREGATED, Reason.DISAGGREGATED, [prefill])
        await self._carry_out(call, _NO_FEATURES, plan, "none", started)


class RelayService:
    """The relay's HTTP server: completions through `RelayProxy`, the rest passed through."""

    def __init__(self, config: RouterConfig):
        assert config.static is not None
        endpoint = config.static.decode[0]
        self.config = config
        self.state = RouterState(config)
        self.engine = self.state.pool.upsert(Engine(endpoint.url, frozenset({"decode"})))
        self.proxy = RelayProxy(config, self.state, self.engine)
        # Reads the engine's /v1/models (its LoRA adapters, which the relay then accepts as
        # model names) and keeps its load figures current.
        self.monitor = EngineMonitor(
            self.state.pool,
            config.metrics_scrape_interval_s,
            config.health_check_interval_s,
            timeout_s=config.timeouts.connect_s,
            auth=self.state.upstreams.auth,
        )
        self.server = HttpServer(self.handle, config.admission.max_body_bytes, config.http)
        self.port = 0

    async def start(self) -> int:
        self.port = await self.server.start(self.config.host, self.config.port)
        await self.monitor.check_all(health=True)
        self.monitor.start()
        log.info("relay listening on %s:%d for %s", self.config.host, self.port, self.engine.url)
        return self.port

    async def stop(self) -> None:
        await self.monitor.stop()
        await self.server.close()
        self.state.upstreams.close()

    async def handle(self, request: Request, responder: Responder) -> None:
        if request.path in ("/v1/completions", "/v1/chat/completions") and request.method == "POST":
            await self.proxy.generate(
                request, responder, chat=request.path.endswith("chat/completions")
            )
            return
        path = request.path + (f"?{request.query}" if request.query else "")
        headers = [(k, v) for k, v in request.headers.items() if k in _PASS_HEADERS]
        try:
            response = await self.state.upstreams.pool(self.engine.url).request(
                request.method, path, request.body, headers, self.config.timeouts.decode_idle_s
            )
            data = await response.read()
        except UpstreamError as exc:
            responder.send(502, error_body(502, f"the engine did not answer: {exc}"))
            return
        response.release()
        content_type = response.header("content-type") or "application/json"
        responder.send(response.status, data, [], content_type)


def relay_config(args: argparse.Namespace) -> RouterConfig:
    """The relay's RouterConfig: its one engine as the decode pool, no KV events, no index."""
    return RouterConfig.model_validate(
        {
            "host": args.host,
            "port": args.port,
            "servedModelName": args.model,
            "kvEvents": False,
            "catchUpSeconds": 0,
            "static": StaticDiscovery(decode=[StaticEndpoint(url=args.engine.rstrip("/"))]),
            "trust": {"trustAllClients": args.trust_all_clients},
            "auth": {"engineKeyFile": args.engine_key_file},
            "logLevel": args.log_level,
        }
    )


async def serve(config: RouterConfig) -> int:
    service = RelayService(config)
    await service.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await service.stop()
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tandem relay", description=__doc__.splitlines()[0])
    p.add_argument("--engine", required=True, help="the local decode engine's URL")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--engine-key-file", help="the engine's API key (its --api-key), in a file")
    p.add_argument("--trust-all-clients", action="store_true", help="honour debug headers")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    config = relay_config(args)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return asyncio.run(serve(config))
