"""The endpoint picker's gRPC server: ext_proc and the gRPC health services the protocol names."""

from __future__ import annotations

import logging

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.router.config import RouterConfig
from tandem.router.epp.picker import EndpointPicker
from tandem.router.proxy import CompletionProxy
from tandem.router.trust import ClientTrust

log = logging.getLogger("tandem.router.epp")
# The health services of the endpoint picker protocol: "" (the server), liveness, readiness and
# the ext_proc service itself.
HEALTH_SERVICES = ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")


class EppServer:
    """Serves `EndpointPicker` on `config.epp.port`; started once the router is caught up, so
    readiness holds from the first answer on."""

    def __init__(self, config: RouterConfig, proxy: CompletionProxy, trust: ClientTrust):
        assert config.epp is not None
        self.config = config
        self.picker = EndpointPicker(config, proxy, trust)
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def start(self, reuse_port: bool = False) -> int:
        assert self.config.epp is not None
        server = grpc.aio.server(options=[("grpc.so_reuseport", 1 if reuse_port else 0)])
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(self.picker, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        bind = f"{self.config.host}:{self.config.epp.port}"
        self.port = server.add_insecure_port(bind)
        if not self.port:
            raise OSError(f"cannot listen on {bind} for the endpoint picker")
        await server.start()
        for service in HEALTH_SERVICES:
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.server = server
        log.info("endpoint picker (ext_proc) listening on %s:%d", self.config.host, self.port)
        return self.port

    async def stop(self) -> None:
        if self.server is not None:
            await self.health.enter_graceful_shutdown()
            await self.server.stop(grace=1.0)
            self.server = None
