"""The endpoint picker protocol's messages (Envoy ext_proc v3, as the GIE specification uses it).

Pure functions from what the picker decided to the `ProcessingResponse` Envoy reads: the
destination in the `x-gateway-destination-endpoint` header and in the `envoy.lb` dynamic
metadata (the same value in both, as the specification requires), bodies streamed back in
FULL_DUPLEX_STREAMED mode, and errors as an ImmediateResponse.

The gateway chooses the request body mode; the picker speaks two:

    FULL_DUPLEX_STREAMED  Envoy streams the body without waiting: the destination answers the
                          request headers, then the body is streamed back (`body_chunk`)
    BUFFERED              Envoy holds the request until the headers are answered (`proceed`),
                          then sends the whole body and keeps it: the destination answers the
                          body (`destination_body_response`), the body is replaced only if the
                          picker changed it. A failed picker lets the held request go on, which
                          is what makes failure_mode_allow work (FailOpen).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2, struct_pb2

DESTINATION_HEADER = "x-gateway-destination-endpoint"
METADATA_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
# Tandem's own hop: the relay beside a decode engine prefills on this engine first (pd_relay.py).
PREFILL_HEADER = "x-tandem-prefill-endpoint"  # host:port of the prefill engine's HTTP server
SIDE_CHANNEL_HEADER = "x-tandem-prefill-side-channel"  # its NIXL side-channel port
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
BUFFERED: int = processing_mode_pb2.ProcessingMode.BUFFERED


def buffered(message: ext_proc.ProcessingRequest) -> bool:
    """Whether the gateway sends this stream's request body BUFFERED (from the protocol
    configuration Envoy puts on a stream's first message; absent means the streamed protocol)."""
    mode: int = message.protocol_config.request_body_mode
    return mode == BUFFERED


def header_map(headers: ext_proc.HttpHeaders) -> dict[str, str]:
    """Envoy's request headers as a dict of lower-case names (`raw_value` when Envoy sends it)."""
    return {
        h.key.lower(): h.raw_value.decode("latin-1") if h.raw_value else h.value
        for h in headers.headers.headers
    }


def subset_of(metadata: base_pb2.Metadata) -> frozenset[str] | None:
    """The endpoints the data plane allows (`envoy.lb.subset_hint`), or None when it sets none."""
    if SUBSET_NAMESPACE not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[SUBSET_NAMESPACE].fields
    if SUBSET_KEY not in fields:
        return None
    value = fields[SUBSET_KEY]
    if value.HasField("list_value"):
        return frozenset(v.string_value for v in value.list_value.values)
    return frozenset(e.strip() for e in value.string_value.split(",") if e.strip())


def _mutation(
    set_headers: Iterable[tuple[str, str]], remove: Iterable[str]
) -> ext_proc.HeaderMutation:
    return ext_proc.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=k, raw_value=v.encode("latin-1")),
                append_action=_OVERWRITE,
            )
            for k, v in set_headers
        ],
        remove_headers=list(remove),
    )


def _destination(
    endpoint: str, set_headers: Iterable[tuple[str, str]], remove: Iterable[str]
) -> tuple[ext_proc.CommonResponse, struct_pb2.Struct]:
    """The header mutation naming `endpoint` (ip:port), with the route cache cleared so that
    routes matching on the header see it, and the same value as `envoy.lb` metadata."""
    metadata = struct_pb2.Struct()
    metadata.update({METADATA_NAMESPACE: {DESTINATION_HEADER: endpoint}})
    headers = [(DESTINATION_HEADER, endpoint), *set_headers]
    common = ext_proc.CommonResponse(
        header_mutation=_mutation(headers, remove), clear_route_cache=True
    )
    return common, metadata


def destination_response(
    endpoint: str, set_headers: Iterable[tuple[str, str]] = (), remove: Iterable[str] = ()
) -> ext_proc.ProcessingResponse:
    """The request headers' answer naming `endpoint` (streamed bodies, or no body)."""
    common, metadata = _destination(endpoint, set_headers, remove)
    return ext_proc.ProcessingResponse(
        request_headers=ext_proc.HeadersResponse(response=common), dynamic_metadata=metadata
    )


def destination_body_response(
    endpoint: str,
    set_headers: Iterable[tuple[str, str]] = (),
    remove: Iterable[str] = (),
    body: bytes | None = None,
) -> ext_proc.ProcessingResponse:
    """The buffered request body's answer naming `endpoint` in the held headers; `body` replaces
    the request's body (None: Envoy sends on the body it holds)."""
    common, metadata = _destination(endpoint, set_headers, remove)
    if body is not None:
        common.body_mutation.body = body
    return ext_proc.ProcessingResponse(
        request_body=ext_proc.BodyResponse(response=common), dynamic_metadata=metadata
    )


def proceed() -> ext_proc.ProcessingResponse:
    """The request headers' answer under BUFFERED: go on and send the body."""
    return ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse())


def extend_timeout(seconds: float) -> ext_proc.ProcessingResponse:
    """Asks Envoy to wait `seconds` more for the answer it is waiting for (its message timer
    restarted; ignored above its `max_message_timeout`)."""
    timeout = duration_pb2.Duration()
    timeout.FromNanoseconds(int(seconds * 1e9))
    return ext_proc.ProcessingResponse(override_message_timeout=timeout)


def body_chunk(body: bytes, end: bool, *, request: bool) -> ext_proc.ProcessingResponse:
    """One body chunk sent on (FULL_DUPLEX_STREAMED: the picker passes every chunk back)."""
    answer = ext_proc.BodyResponse(
        response=ext_proc.CommonResponse(
            body_mutation=ext_proc.BodyMutation(
                streamed_response=ext_proc.StreamedBodyResponse(body=body, end_of_stream=end)
            )
        )
    )
    if request:
        return ext_proc.ProcessingResponse(request_body=answer)
    return ext_proc.ProcessingResponse(response_body=answer)


def response_headers() -> ext_proc.ProcessingResponse:
    return ext_proc.ProcessingResponse(response_headers=ext_proc.HeadersResponse())


def trailers(*, request: bool) -> ext_proc.ProcessingResponse:
    if request:
        return ext_proc.ProcessingResponse(request_trailers=ext_proc.TrailersResponse())
    return ext_proc.ProcessingResponse(response_trailers=ext_proc.TrailersResponse())


def immediate(
    status: int, body: bytes, headers: Mapping[str, str] | None = None, details: str = ""
) -> ext_proc.ProcessingResponse:
    """The picker answers the client itself (an error: 4xx from the request, 429, 503)."""
    head = {"content-type": "application/json", **(headers or {})}
    return ext_proc.ProcessingResponse(
        immediate_response=ext_proc.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=_mutation(head.items(), ()),
            body=body,
            details=details,
        )
    )
