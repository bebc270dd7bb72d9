"""Envoy as the gateway in front of an endpoint picker: its bootstrap config, as a pure function.

Every request goes through the ext_proc filter (headers and bodies streamed both ways,
FULL_DUPLEX_STREAMED, as the GIE protocol asks), then to the endpoint the picker named in
`x-gateway-destination-endpoint` (an ORIGINAL_DST cluster keyed on that header). What happens
when the picker cannot be reached is the InferencePool's `failureMode`:

    FailClose -> Envoy answers 503 at once, an OpenAI-format error naming the endpoint picker
    FailOpen  -> the request goes on without a pick, round robin over `pool` (the pool's
                 endpoints), by the route that matches when the header is absent. Envoy cannot
                 pass on a request whose body it had already streamed to the picker when the
                 picker's connection failed: that one is answered 503 as under FailClose.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.router.epp.protocol import DESTINATION_HEADER

PICKED_CLUSTER = "original_destination_cluster"
POOL_CLUSTER = "inference_pool"
EPP_CLUSTER = "endpoint_picker"
# The status Envoy gives a request whose ext_proc stream failed; rewritten to a clear 503.
_EXT_PROC_ERROR = 500


def _socket(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _endpoints(name: str, endpoints: Sequence[tuple[str, int]]) -> dict[str, Any]:
    return {
        "cluster_name": name,
        "endpoints": [
            {"lb_endpoints": [{"endpoint": {"address": _socket(h, p)}} for h, p in endpoints]}
        ],
    }


def gateway_config(
    port: int,
    admin_port: int,
    picker: tuple[str, int],
    *,
    fail_open: bool = False,
    pool: Sequence[tuple[str, int]] = (),
    host: str = "127.0.0.1",
    message_timeout_s: float = 60.0,
    max_requests: int = 40000,
    response_bodies: bool = True,
    keepalive_s: float = 5.0,
) -> dict[str, Any]:
    """The bootstrap of an Envoy listening on host:`port` (admin on `admin_port`), asking the
    picker at `picker` (host, port) for every request. `fail_open` needs `pool`.

    `message_timeout_s` bounds each wait for the picker's answer (admission queueing included)
    where Envoy applies it; `keepalive_s` is the HTTP/2 PING interval and timeout on the picker's
    connection, so a picker that stops answering altogether fails its requests within about
    twice that instead of holding them.
    `response_bodies` False sends the picker the response headers only (the response body and
    trailers pass it by): fewer gRPC messages per request; the picker then closes a request's
    bookkeeping when Envoy ends its ext_proc stream.
    """
    if fail_open and not pool:
        raise ValueError("fail_open needs the pool's endpoints to fall back on")
    thresholds = {
        "max_connections": max_requests,
        "max_pending_requests": max_requests,
        "max_requests": max_requests,
    }
    timeout = f"{message_timeout_s}s"
    picked: dict[str, Any] = {"prefix": "/"}
    routes = [
        {
            "match": picked,
            "route": {"cluster": PICKED_CLUSTER, "timeout": "600s", "idle_timeout": "600s"},
        }
    ]
    clusters: list[dict[str, Any]] = [
        {
            "name": PICKED_CLUSTER,
            "type": "ORIGINAL_DST",
            "connect_timeout": "10s",
            "lb_policy": "CLUSTER_PROVIDED",
            "circuit_breakers": {"thresholds": [thresholds]},
            "original_dst_lb_config": {
                "use_http_header": True,
                "http_header_name": DESTINATION_HEADER,
            },
        },
        {
            "name": EPP_CLUSTER,
            "type": "STATIC",
            "connect_timeout": "5s",
            "lb_policy": "ROUND_ROBIN",
            "circuit_breakers": {"thresholds": [thresholds]},
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    # HTTP/2 PINGs: a picker that stops answering (a stopped process, a lost
                    # node) resets its streams, so its requests fail instead of hanging.
                    "explicit_http_config": {
                        "http2_protocol_options": {
                            "connection_keepalive": {
                                "interval": f"{keepalive_s}s",
                                "timeout": f"{keepalive_s}s",
                            }
                        }
                    },
                }
            },
            "load_assignment": _endpoints(EPP_CLUSTER, [picker]),
        },
    ]
    if fail_open:
        picked["headers"] = [{"name": DESTINATION_HEADER, "present_match": True}]
        routes.append(
            {
                "match": {"prefix": "/"},
                "route": {"cluster": POOL_CLUSTER, "timeout": "600s", "idle_timeout": "600s"},
            }
        )
        clusters.append(
            {
                "name": POOL_CLUSTER,
                "type": "STATIC",
                "connect_timeout": "10s",
                "lb_policy": "ROUND_ROBIN",
                "circuit_breakers": {"thresholds": [thresholds]},
                "load_assignment": _endpoints(POOL_CLUSTER, pool),
            }
        )
    ext_proc = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "failure_mode_allow": fail_open,
        "grpc_service": {"envoy_grpc": {"cluster_name": EPP_CLUSTER}, "timeout": timeout},
        "processing_mode": {
            "request_header_mode": "SEND",
            "response_header_mode": "SEND",
            "request_body_mode": "FULL_DUPLEX_STREAMED",
            "response_body_mode": "FULL_DUPLEX_STREAMED" if response_bodies else "NONE",
            "request_trailer_mode": "SEND",
            "response_trailer_mode": "SEND" if response_bodies else "SKIP",
        },
        "message_timeout": timeout,
    }
    unavailable = {
        "filter": {
            "status_code_filter": {
                "comparison": {
                    "op": "EQ",
                    "value": {
                        "default_value": _EXT_PROC_ERROR,
                        "runtime_key": "tandem.ext_proc_error",
                    },
                }
            }
        },
        "status_code": 503,
        "body_format_override": {
            "json_format": {
                "error": {
                    "message": "the endpoint picker is unavailable (%RESPONSE_CODE_DETAILS%)",
                    "type": "ServiceUnavailableError",
                    "code": 503,
                }
            }
        },
    }
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gateway",
        "route_config": {
            "name": "gateway",
            "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}],
        },
        "local_reply_config": {"mappers": [unavailable]},
        "http_filters": [
            {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
                    "suppress_envoy_headers": True,
                },
            },
        ],
    }
    return {
        "admin": {"address": _socket(host, admin_port)},
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": _socket(host, port),
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": manager,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": clusters,
        },
    }
