"""Static discovery: engines from the config (`--prefill URL --decode URL --worker URL`)."""

from __future__ import annotations

from tandem.common.roles import ROLES
from tandem.router.config import StaticDiscovery
from tandem.router.engines import Engine


def static_engines(static: StaticDiscovery) -> list[Engine]:
    """One Engine per distinct URL; a URL listed as prefill and decode, or as a worker, serves both."""
    roles: dict[str, set[str]] = {}
    events: dict[str, tuple[str | None, str | None]] = {}
    side_channels: dict[str, int] = {}
    for role, endpoints in (
        ("prefill", static.prefill),
        ("decode", static.decode),
        ("worker", static.workers),
    ):
        for endpoint in endpoints:
            url = endpoint.url.rstrip("/")
            wanted = set(ROLES) if role == "worker" else {role}
            roles.setdefault(url, set()).update(wanted)
            if endpoint.kv_events or url not in events:
                events[url] = (endpoint.kv_events, endpoint.kv_events_replay)
            if endpoint.side_channel_port is not None:
                side_channels[url] = endpoint.side_channel_port
    return [
        Engine(
            url,
            frozenset(r),
            kv_events=events[url][0],
            kv_events_replay=events[url][1],
            side_channel_port=side_channels.get(url, Engine.side_channel_port),
        )
        for url, r in roles.items()
    ]
