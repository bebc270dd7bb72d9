"""The running router: HTTP endpoints, discovery, engine monitor and KV-event subscribers wired together.

Endpoints: /v1/completions and /v1/chat/completions (`CompletionProxy`), /v1/models, /version;
/livez (the process serves: liveness) and /health (a decode engine is healthy: readiness);
/metrics and /engines on the admin port, or on the main port to trusted or loopback clients.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Iterable

import msgspec
import zmq.asyncio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tandem.common.block_hash import BlockHasher
from tandem.router.config import RouterConfig
from tandem.router.discovery.kubernetes import PodWatcher
from tandem.router.discovery.static import static_engines
from tandem.router.engines import Engine
from tandem.router.epp.server import EppServer
from tandem.router.errors import error_body
from tandem.router.httpserver import HttpServer, Request, Responder
from tandem.router.kv_events import EngineBlockMap, KvEventSubscriber
from tandem.router.lora import served_adapters
from tandem.router.lora_admin import (
    LOAD_PATH,
    UNLOAD_PATH,
    RuntimeAdapters,
    combined_answer,
    parse_adapter_request,
    record_answers,
    send_to_engines,
)
from tandem.router.monitor import EngineMonitor
from tandem.router.proxy import CompletionProxy
from tandem.router.removal_cost import RemovalCostCache, Snapshot, index_snapshot, pool_of
from tandem.router.state import RouterState
from tandem.router.trust import ClientTrust

log = logging.getLogger("tandem.router")
_encode_json = msgspec.json.Encoder().encode
_ADMIN_PATHS = frozenset(("/metrics", "/engines"))


class RouterService:
    """One router process: its state, its HTTP servers, discovery and the per-engine tasks."""

    def __init__(
        self, config: RouterConfig, *, reuse_port: bool = False, admin_host: str | None = None
    ):
        """`reuse_port` and `admin_host` make it one worker of several on one port (supervisor.py):
        the port shared with SO_REUSEPORT, the admin endpoint on a private address."""
        self.config = config
        self.reuse_port = reuse_port
        self.admin_host = admin_host or config.host
        self.state = RouterState(config)
        self.pool = self.state.pool
        self.metrics = self.state.metrics
        self.trust = ClientTrust(config)
        self.proxy = CompletionProxy(config, self.state, self.trust)
        self.runtime_adapters = RuntimeAdapters()
        self.monitor = EngineMonitor(
            self.pool,
            config.metrics_scrape_interval_s,
            config.health_check_interval_s,
            timeout_s=config.timeouts.connect_s,
            auth=self.state.upstreams.auth,
            runtime_adapters=self.runtime_adapters,
            load_timeout_s=config.timeouts.prefill_s,
        )
        self.server = HttpServer(self.handle, config.admission.max_body_bytes, config.http)
        self.admin_server = (
            HttpServer(self.handle_admin, 1024, config.http)
            if config.trust.admin_port is not None
            else None
        )
        self.epp = EppServer(config, self.proxy, self.trust) if config.epp is not None else None
        self.subscribers: dict[str, KvEventSubscriber] = {}
        self._zmq: zmq.asyncio.Context | None = None
        self._pods: dict[str, str] = {}  # pod name -> engine url
        self._watcher: PodWatcher | None = None
        self._created = int(time.time())
        self.port = 0
        self.admin_port: int | None = None
        self._removal_costs = RemovalCostCache(self._index_snapshot)
        self.metrics.add_gauges(self._gauges)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> int:
        await self.start_pools()
        return await self.start_serving()

    async def start_pools(self) -> None:
        """Discovery, the engine monitor and KV-event catch-up: everything but the HTTP ports (a
        gateway serves several routers' pools on one port of its own, `gateway.py`)."""
        if self.config.static is not None:
            for engine in static_engines(self.config.static):
                self.add_engine(engine)
        if self.config.kubernetes is not None:
            self._watcher = PodWatcher(
                self.config.kubernetes, self._on_pod, self._on_resync, asyncio.get_running_loop()
            )
            self._watcher.start()
        self.monitor.start()
        await self._catch_up()

    async def start_serving(self) -> int:
        self.port = await self.server.start(self.config.host, self.config.port, self.reuse_port)
        if self.admin_server is not None and self.config.trust.admin_port is not None:
            self.admin_port = await self.admin_server.start(
                self.admin_host, self.config.trust.admin_port
            )
        if self.epp is not None:
            await self.epp.start(self.reuse_port)
        log.info(
            "router listening on %s:%d%s (%d engines, %s index)",
            self.config.host,
            self.port,
            f", admin on {self.admin_port}" if self.admin_port is not None else "",
            len(self.pool.engines),
            "exact" if self.state.use_exact else "approximate",
        )
        # What start-up built lives as long as the process: moved out of the collector's sight,
        # so the full collections that request garbage triggers no longer walk it each time.
        gc.collect()
        gc.freeze()
        return self.port

    async def _catch_up(self) -> None:
        """Waits, for at most `catchUpSeconds`, for discovery's first listing of the engines and
        then for each KV-event subscriber's first replay. Until then the port is not bound, so
        neither a load balancer nor, for a router of several processes, the kernel can hand this
        process a request it would route as if the engines' caches were cold."""
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.config.catch_up_s):
                if self._watcher is not None:
                    await self._watcher.synced.wait()
                for subscriber in list(self.subscribers.values()):
                    await subscriber.caught_up.wait()
        except TimeoutError:
            behind = [url for url, s in self.subscribers.items() if not s.caught_up.is_set()]
            log.warning(
                "serving after %.0f s without %s",
                self.config.catch_up_s,
                "the first listing of engines"
                if self._watcher is not None and not self._watcher.synced.is_set()
                else f"the KV events of {', '.join(behind)} caught up",
            )
            return
        if self.subscribers:
            log.info(
                "KV events of %d engines caught up in %.2f s",
                len(self.subscribers),
                time.monotonic() - started,
            )

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
        await self.server.close(self.config.timeouts.shutdown_s)
        if self.epp is not None:
            await self.epp.stop()
        if self.admin_server is not None:
            await self.admin_server.close()
        await self.monitor.stop()
        for subscriber in list(self.subscribers.values()):
            await subscriber.stop()
        self.subscribers.clear()
        self.state.upstreams.close()
        if self._zmq is not None:
            self._zmq.term()

    # -- membership --------------------------------------------------------------------------

    def add_engine(self, engine: Engine) -> None:
        engine = self.pool.upsert(engine)
        if self.state.use_exact and engine.kv_events and engine.id not in self.subscribers:
            if self._zmq is None:
                self._zmq = zmq.asyncio.Context()
            hasher = BlockHasher(
                self.config.hash_algo, self.config.block_size, self.config.hash_seed
            )
            block_map = EngineBlockMap(
                engine.id, self.state.exact_index, self.config.block_size, hasher
            )
            subscriber = KvEventSubscriber(
                block_map, engine.kv_events, engine.kv_events_replay, self._zmq, self.metrics
            )
            self.subscribers[engine.id] = subscriber
            subscriber.start()

    def remove_engine(self, url: str) -> None:
        if self.pool.remove(url) is None:
            return
        subscriber = self.subscribers.pop(url, None)
        if subscriber is not None:
            asyncio.get_running_loop().create_task(subscriber.stop())
        self.state.forget_engine(url)
        log.info("engine %s removed", url)

    def _on_pod(self, name: str, engine: Engine | None) -> None:
        old = self._pods.get(name)
        if engine is None:
            if old is not None:
                del self._pods[name]
                self.remove_engine(old)
            return
        if old is not None and old != engine.url:
            self.remove_engine(old)
        self._pods[name] = engine.url
        if engine.url not in self.pool.engines:
            log.info(
                "engine %s (pod %s, %s) added", engine.url, name, ",".join(sorted(engine.roles))
            )
        self.add_engine(engine)

    def _on_resync(self, names: set[str]) -> None:
        for name in [n for n in self._pods if n not in names]:
            self._on_pod(name, None)

    # -- HTTP --------------------------------------------------------------------------------

    async def handle(self, request: Request, responder: Responder) -> None:
        """The main port: the OpenAI surface, probes, and (without an admin port) admin paths."""
        path = request.path
        if path in ("/v1/completions", "/v1/chat/completions"):
            if request.method != "POST":
                responder.send(405, error_body(405, "Method Not Allowed"), [("allow", "POST")])
            elif not self.trust.authorized(request):
                self._unauthorized(responder)
            else:
                await self.proxy.generate(request, responder, chat=path == "/v1/chat/completions")
        elif path == "/v1/models":
            if self.trust.authorized(request):
                responder.send(200, self._models())
            else:
                self._unauthorized(responder)
        elif path in (LOAD_PATH, UNLOAD_PATH):
            await self._adapter_change(request, responder, load=path == LOAD_PATH)
        elif path == "/livez":
            responder.send(200, b"")
        elif path in ("/health", "/ping"):
            ok = self.ready()
            responder.send(
                200 if ok else 503, b"" if ok else error_body(503, "no healthy decode engine")
            )
        elif path == "/version":
            from tandem import __version__

            responder.send(200, _encode_json({"version": __version__}))
        elif path in _ADMIN_PATHS and self.trust.admin_on_main_port(request):
            self.handle_admin_path(path, responder)
        else:
            responder.send(404, b'{"detail":"Not Found"}')

    async def handle_admin(self, request: Request, responder: Responder) -> None:
        """The admin port: /metrics, /engines and the probes."""
        if request.path in ("/livez", "/health"):
            await self.handle(request, responder)
        else:
            self.handle_admin_path(request.path, responder)

    def handle_admin_path(self, path: str, responder: Responder) -> None:
        if path == "/metrics":
            responder.send(
                200, self.metrics.render(), content_type="text/plain; version=0.0.4; charset=utf-8"
            )
        elif path == "/engines":
            costs = self.removal_costs()
            responder.send(
                200, _encode_json([self._describe(e, costs) for e in self.pool.engines.values()])
            )
        else:
            responder.send(404, b'{"detail":"Not Found"}')

    @staticmethod
    def _unauthorized(responder: Responder) -> None:
        responder.send(401, error_body(401, "Unauthorized"), [("www-authenticate", "Bearer")])

    def _models(self) -> bytes:
        """The base model, then every LoRA adapter some engine serves (vLLM's shape: `parent` the
        base model, `root` the adapter's path)."""
        name = self.config.served_model_name
        models: list[tuple[str, str, str | None]] = [(name, name, None)]
        adapters = served_adapters(e.adapters for e in self.pool.engines.values())
        models += [(adapter, path, name) for adapter, path in sorted(adapters.items())]
        data = [
            {
                "id": model,
                "object": "model",
                "created": self._created,
                "owned_by": "tandem",
                "root": root,
                "parent": parent,
            }
            for model, root, parent in models
        ]
        return _encode_json({"object": "list", "data": data})

    async def _adapter_change(self, request: Request, responder: Responder, load: bool) -> None:
        """POST /v1/load_lora_adapter or /v1/unload_lora_adapter from a trusted client: sent to
        every engine (`lora_admin.py`); the engines allow it only with runtime LoRA updating on."""
        if request.method != "POST":
            responder.send(405, error_body(405, "Method Not Allowed"), [("allow", "POST")])
            return
        if not self.trust.authorized(request):
            self._unauthorized(responder)
            return
        if not self.trust.trusted(request):
            responder.send(403, error_body(403, "loading adapters needs a trusted client"))
            return
        parsed = parse_adapter_request(request.body)
        if parsed is None:
            responder.send(400, error_body(400, "`lora_name` must be provided", "lora_name"))
            return
        name, adapter_path = parsed
        engines = list(self.pool.engines.values())
        answers = await send_to_engines(
            engines,
            self.state.upstreams,
            LOAD_PATH if load else UNLOAD_PATH,
            request.body,
            self.config.timeouts.prefill_s,
        )
        record_answers(answers, load, name, adapter_path)
        self.runtime_adapters.record(answers, load, name, request.body)
        status, body = combined_answer(answers, load, name)
        content_type = "text/plain; charset=utf-8" if status == 200 else "application/json"
        responder.send(status, body, content_type=content_type)

    def ready(self) -> bool:
        """Readiness: a decode engine is healthy, or the router holds requests for one
        (`admission.engineWaitSeconds`), so it serves while the pools are at zero."""
        return bool(self.config.admission.engine_wait_s or self.pool.candidates("decode"))

    def removal_costs(self) -> dict[str, float]:
        """Each engine's removal cost (`removal_cost.py`), as of the read before (RemovalCostCache)."""
        return self._removal_costs.read()

    def _index_snapshot(self) -> Snapshot:
        index = self.state.exact_index if self.state.use_exact else self.state.approx_index
        return index_snapshot(index, {e.id: pool_of(e.roles) for e in self.pool.engines.values()})

    def _describe(self, engine: Engine, costs: dict[str, float]) -> dict[str, object]:
        subscriber = self.subscribers.get(engine.id)
        return {
            "url": engine.url,
            "roles": sorted(engine.roles),
            "healthy": engine.healthy,
            "draining": engine.draining,
            "in_flight": engine.in_flight,
            "waiting": engine.waiting,
            "running": engine.running,
            "kv_usage": engine.kv_usage,
            "kv_capacity": engine.kv_capacity,
            "lora": None
            if engine.lora is None
            else {
                "max_loras": engine.lora.max_loras,
                "running": sorted(engine.lora.running),
                "waiting": sorted(engine.lora.waiting),
            },
            "adapters": engine.adapters,
            "kv_events": engine.kv_events,
            "indexed_blocks": self.state.exact_index.size(engine.id),
            "history_blocks": self.state.approx_index.size(engine.id),
            "removal_cost": costs.get(engine.id, 0.0),
            "kv_events_last_seq": subscriber.last_seq if subscriber else None,
            "kv_events_replays": subscriber.replays if subscriber else None,
            "kv_events_replay_rounds": subscriber.replay_rounds if subscriber else None,
            "kv_events_resubscribes": subscriber.resubscribes if subscriber else None,
            "kv_events_catch_ups": subscriber.catch_ups if subscriber else None,
        }

    def _gauges(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        in_flight = GaugeMetricFamily(
            "tandem_router_engine_in_flight",
            "Router requests open per engine.",
            labels=["pool", "endpoint"],
        )
        healthy = GaugeMetricFamily(
            "tandem_router_engine_healthy",
            "1 if the engine passes health checks.",
            labels=["pool", "endpoint"],
        )
        removal_cost = GaugeMetricFamily(
            "tandem_router_engine_removal_cost",
            "Cached blocks lost with the engine: blocks no other engine of its pool holds, each "
            "weighted by the LRU life it has left (docs/autoscaling.md, cache-aware scale-down).",
            labels=["pool", "endpoint", "engine_pod"],
        )
        costs = self.removal_costs()
        for engine in self.pool.engines.values():
            pool = pool_of(engine.roles)
            in_flight.add_metric([pool, engine.id], engine.in_flight)
            healthy.add_metric([pool, engine.id], 1.0 if engine.healthy else 0.0)
            removal_cost.add_metric(
                [pool, engine.id, engine.labels.get("pod", "")], costs.get(engine.id, 0.0)
            )
        waiting = GaugeMetricFamily(
            "tandem_router_queue_waiting", "Requests waiting in the admission queue."
        )
        waiting.add_metric([], self.state.admission.waiting)
        held = GaugeMetricFamily(
            "tandem_router_engine_wait_requests",
            "Requests held until a decode engine is ready (scale from zero wakes on it).",
        )
        held.add_metric([], self.proxy.scale_from_zero.engine_wait.held)
        blocks = GaugeMetricFamily(
            "tandem_router_index_blocks", "Distinct blocks in the prefix index.", labels=["index"]
        )
        blocks.add_metric(["exact"], len(self.state.exact_index))
        blocks.add_metric(["approximate"], len(self.state.approx_index))
        connections = GaugeMetricFamily(
            "tandem_router_client_connections", "Open client connections."
        )
        connections.add_metric([], len(self.server.connections))
        refused = CounterMetricFamily(
            "tandem_router_http_refused",
            "Client connections or requests the HTTP limits turned away.",
            labels=["reason"],
        )
        for reason, count in sorted(self.server.counts.items()):
            refused.add_metric([reason], count)
        return [in_flight, healthy, removal_cost, waiting, held, blocks, connections, refused]
