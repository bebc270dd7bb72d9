"""Envoy as the gateway in front of an endpoint picker: its bootstrap config, as a pure function.

Every request goes through the ext_proc filter, then to the endpoint the picker named in
`x-gateway-destination-endpoint` (an ORIGINAL_DST cluster keyed on that header); the headers only
the picker may set are first removed from the client's request. What happens when the picker
cannot be reached is the InferencePool's `failureMode`, and it decides the request body mode:

    FailClose -> request bodies FULL_DUPLEX_STREAMED (streamed to the picker as they arrive, the
                 mode GIE gateways use); Envoy answers 503 at once, an OpenAI-format error
                 naming the endpoint picker
    FailOpen  -> request bodies BUFFERED (Envoy holds the request, sends the picker the whole
                 body after its headers are answered, and keeps it); `failure_mode_allow` lets
                 the held request go on without a pick, round robin over `pool` (the pool's
                 endpoints), by the route that matches when the header is absent

Why FailOpen cannot stream: Envoy drains each FULL_DUPLEX_STREAMED chunk once it is sent to the
picker, so it has no body left to pass on, and its ext_proc filter ignores `failure_mode_allow`
as soon as such a body chunk arrived (`Filter::failureModeAllow()`). A refused picker connection
is reported after the client's body has arrived, so every request would get the 503.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.router.epp.protocol import DESTINATION_HEADER, PREFILL_HEADER, SIDE_CHANNEL_HEADER

PICKED_CLUSTER = "original_destination_cluster"
POOL_CLUSTER = "inference_pool"
EPP_CLUSTER = "endpoint_picker"
# The status Envoy gives a request whose ext_proc stream failed; rewritten to a clear 503.
_EXT_PROC_ERROR = 500
# Set by the picker alone: a client's own would steer the request (or a relay's prefill) when the
# picker does not answer (FailOpen).
PICKER_HEADERS = (DESTINATION_HEADER, PREFILL_HEADER, SIDE_CHANNEL_HEADER)


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
    response_headers: bool = False,
    keepalive_s: float = 5.0,
    max_body_bytes: int = 8 << 20,
    max_queue_s: float = 3600.0,
) -> dict[str, Any]:
    """The bootstrap of an Envoy listening on host:`port` (admin on `admin_port`), asking the
    picker at `picker` (host, port) for every request. `fail_open` needs `pool`.

    `message_timeout_s` bounds each wait for the picker's answer (admission queueing included)
    where Envoy applies it (not to FULL_DUPLEX_STREAMED bodies; to BUFFERED ones it does). Under
    FailOpen a request that waits in the router's admission would go on to the pool unplaced at
    that timeout, so the picker extends it to its queue timeout (`override_message_timeout`),
    up to `max_queue_s` (Envoy's `max_message_timeout`); `keepalive_s` is the HTTP/2 PING interval and timeout on the picker's
    connection, so a picker that stops answering altogether fails its requests within about
    twice that instead of holding them.
    `max_body_bytes` bounds a request body Envoy holds under FailOpen (its 413 above that; the
    router's own `admission.maxBodyBytes` default).
    `response_bodies` True (the default) sends the picker the response body and trailers, not
    the response headers; False sends it the response headers only (the response body and
    trailers pass it by): fewer gRPC messages per request, but the picker sees no first byte.
    A response without a body closes the request's bookkeeping when Envoy ends its ext_proc
    stream. `response_headers` True sends the response headers as well (another picker, such as
    llm-d's, may read them).
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
            # the picker reads the response from its body chunks: its headers would cost one
            # more gRPC round trip (a message each way) per request
            "response_header_mode": "SEND" if response_headers or not response_bodies else "SKIP",
            "request_body_mode": "BUFFERED" if fail_open else "FULL_DUPLEX_STREAMED",
            "response_body_mode": "FULL_DUPLEX_STREAMED" if response_bodies else "NONE",
            # FULL_DUPLEX_STREAMED needs the trailers; a buffered body ends the request itself
            "request_trailer_mode": "SKIP" if fail_open else "SEND",
            "response_trailer_mode": "SEND" if response_bodies else "SKIP",
        },
        "message_timeout": timeout,
        "max_message_timeout": f"{max(max_queue_s, message_timeout_s)}s",
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
        # before the route is chosen (a route matches on the destination header)
        "early_header_mutation_extensions": [
            {
                "name": "envoy.http.early_header_mutation.header_mutation",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
                    "mutations": [{"remove": name} for name in PICKER_HEADERS],
                },
            }
        ],
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
                    # a buffered request body (FailOpen) is held up to this size
                    **({"per_connection_buffer_limit_bytes": max_body_bytes} if fail_open else {}),
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
