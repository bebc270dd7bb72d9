"""Which clients the router serves, which it trusts, and who may read its internals.

- authorized: no API keys configured, or the bearer token is an API key or an admin key;
- trusted (may set priority and ask for debug headers): `trustAllClients`, or an admin key;
- admin endpoints (/engines, /metrics): on the admin port when one is set (and only there);
  otherwise to trusted clients and to loopback peers (a local `tandem up`, a sidecar).
"""

from __future__ import annotations

import ipaddress

from tandem.router.auth import AUTHORIZATION, ClientAuth
from tandem.router.config import RouterConfig
from tandem.router.httpserver import Request

# A trusted client sending this header gets the engines' addresses in the response headers.
DEBUG_HEADER = "x-tandem-debug"


def _loopback(peer: str) -> bool:
    try:
        return ipaddress.ip_address(peer).is_loopback
    except ValueError:
        return peer == ""  # a Unix socket has no address


class ClientTrust:
    def __init__(self, config: RouterConfig):
        self.clients = ClientAuth.from_config(config)
        # Admin keys are keys too: compared as clients' are (constant time, every key).
        self._admins = ClientAuth(config.trust.admin_keys) if config.trust.admin_keys else None
        self.trust_all = config.trust.trust_all_clients
        self.admin_port = config.trust.admin_port

    def _admin(self, request: Request) -> bool:
        return self._admins is not None and self._admins.allows(request.headers.get(AUTHORIZATION))

    def authorized(self, request: Request) -> bool:
        return self.clients.allows(request.headers.get(AUTHORIZATION)) or self._admin(request)

    def trusted(self, request: Request) -> bool:
        return self.trust_all or self._admin(request)

    def wants_engines(self, request: Request) -> bool:
        """A trusted client asked for the engines' addresses."""
        return DEBUG_HEADER in request.headers and self.trusted(request)

    def admin_on_main_port(self, request: Request) -> bool:
        return self.admin_port is None and (self.trusted(request) or _loopback(request.peer))
