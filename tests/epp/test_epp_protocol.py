"""The endpoint picker protocol message by message, as a gateway would speak it: a gRPC client on
127.0.0.1 against `tandem router --epp-port` in front of emulated engines — the destination in
header and `envoy.lb` metadata alike, the subset hint, immediate responses, streamed bodies passed
through, buffered bodies answered with the destination, and the gRPC health services the protocol
names."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from epp.epp_harness import PickerRouter, hostport
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from router.router_harness import Engine, metric, metrics, running, wait_until

from tandem.common.ports import free_port

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def picker() -> Iterator[tuple[PickerRouter, list[Engine]]]:
    engines = [Engine(None), Engine(None)]
    with running(*engines):
        router = PickerRouter([arg for e in engines for arg in ("--worker", e.url)])
        with running(router):
            yield router, engines


def headers_message(
    path: str, end: bool, subset: list[str] | None = None
) -> ext_proc.ProcessingRequest:
    pairs = [(":method", "POST" if not end else "GET"), (":path", path), (":authority", "gw")]
    message = ext_proc.ProcessingRequest(
        request_headers=ext_proc.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
            ),
            end_of_stream=end,
        )
    )
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return message


def body_message(body: bytes, end: bool) -> ext_proc.ProcessingRequest:
    return ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=body, end_of_stream=end))


def exchange(
    port: int, messages: list[ext_proc.ProcessingRequest], timeout: float = 30
) -> list[ext_proc.ProcessingResponse]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ext_proc_grpc.ExternalProcessorStub(channel)
        return list(stub.Process(iter(messages), timeout=timeout))


def set_headers(response: ext_proc.ProcessingResponse) -> dict[str, str]:
    mutation = response.request_headers.response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


COMPLETION = json.dumps({"model": "tiny", "prompt": "pick me", "max_tokens": 2}).encode()


def test_destination_in_header_and_metadata_then_the_body(
    picker: tuple[PickerRouter, list[Engine]],
) -> None:
    router, engines = picker
    half = len(COMPLETION) // 2
    answers = exchange(router.epp_port, [
        headers_message("/v1/completions", False),
        body_message(COMPLETION[:half], False),
        body_message(COMPLETION[half:], True),
    ])  # fmt: skip
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
    picked = set_headers(answers[0])["x-gateway-destination-endpoint"]
    assert picked in {"{}:{}".format(*hostport(e.url)) for e in engines}
    metadata = answers[0].dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert metadata["x-gateway-destination-endpoint"].string_value == picked
    assert set_headers(answers[0])["content-length"] == str(len(COMPLETION))
    removed = answers[0].request_headers.response.header_mutation.remove_headers
    assert "x-tandem-prefill-endpoint" in removed
    streamed = answers[1].request_body.response.body_mutation.streamed_response
    assert (streamed.body, streamed.end_of_stream) == (COMPLETION, True)


def buffered_headers(path: str) -> ext_proc.ProcessingRequest:
    """The first message of a stream whose request body the gateway sends BUFFERED."""
    message = headers_message(path, False)
    message.protocol_config.request_body_mode = processing_mode_pb2.ProcessingMode.BUFFERED
    return message


def test_buffered_body_is_answered_with_the_destination(
    picker: tuple[PickerRouter, list[Engine]],
) -> None:
    """BUFFERED: the headers are let through at once (Envoy sends the body only then), the
    destination comes in the body's answer, and Envoy's own copy of the body is kept unless the
    picker changed it."""
    router, engines = picker
    answers = exchange(router.epp_port, [
        buffered_headers("/v1/completions"), body_message(COMPLETION, True)])  # fmt: skip
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
    assert answers[0] == ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse())
    common = answers[1].request_body.response
    headers = {
        h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers
    }
    picked = headers["x-gateway-destination-endpoint"]
    assert picked in {"{}:{}".format(*hostport(e.url)) for e in engines}
    metadata = answers[1].dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert metadata["x-gateway-destination-endpoint"].string_value == picked
    assert common.clear_route_cache
    assert not common.HasField("body_mutation")
    steered = json.dumps({**json.loads(COMPLETION), "kv_transfer_params": {"x": 1}}).encode()
    answers = exchange(router.epp_port, [
        buffered_headers("/v1/completions"), body_message(steered, True)])  # fmt: skip
    common = answers[1].request_body.response
    body = common.body_mutation.body
    assert json.loads(body) == json.loads(COMPLETION)
    headers = {
        h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers
    }
    assert headers["content-length"] == str(len(body))
    (missing,) = exchange(router.epp_port, [
        buffered_headers("/v1/completions"),
        body_message(json.dumps({"model": "nope", "prompt": "x"}).encode(), True)])[1:]  # fmt: skip
    assert missing.immediate_response.status.code == 404


def test_subset_hint_limits_the_pick(picker: tuple[PickerRouter, list[Engine]]) -> None:
    router, engines = picker
    for engine in engines:
        only = "{}:{}".format(*hostport(engine.url))
        answers = exchange(router.epp_port, [
            headers_message("/v1/completions", False, [only]), body_message(COMPLETION, True)])  # fmt: skip
        assert set_headers(answers[0])["x-gateway-destination-endpoint"] == only
    (refused,) = exchange(router.epp_port, [
        headers_message("/v1/completions", False, ["127.0.0.9:1"]), body_message(COMPLETION, True)])  # fmt: skip
    assert refused.immediate_response.status.code == 503
    assert json.loads(refused.immediate_response.body)["error"]["code"] == 503


def test_a_request_is_held_until_a_decode_engine_starts_then_picked() -> None:
    """Scale from zero through the gateway: with `engineWaitSeconds` the picker holds a request
    while no decode engine is ready (counted in the held gauge that wakes the pool, and as an
    arrival), and picks the engine that starts on the address the router lists."""
    port = free_port()
    router = PickerRouter(["--worker", f"http://127.0.0.1:{port}", "--engine-wait-seconds", "90"])
    with running(router), concurrent.futures.ThreadPoolExecutor(1) as pool:
        messages = [headers_message("/v1/completions", False), body_message(COMPLETION, True)]
        answer = pool.submit(exchange, router.epp_port, messages, 120)
        wait_until(
            lambda: metric(metrics(router.url), "tandem_router_engine_wait_requests") == 1,
            timeout=30,
        )
        assert not answer.done(), "the request must wait, not fail"
        with running(Engine(None, port=port)):
            answers = answer.result(timeout=120)
        text = metrics(router.url)
    assert set_headers(answers[0])["x-gateway-destination-endpoint"] == f"127.0.0.1:{port}"
    assert metric(text, "tandem_router_arrivals_total") == 1
    assert metric(text, "tandem_router_engine_wait_seconds_count", outcome="ready") == 1
    assert metric(text, "tandem_router_engine_wait_requests") == 0


def test_bad_requests_are_answered_by_the_picker(picker: tuple[PickerRouter, list[Engine]]) -> None:
    router, _ = picker
    (missing,) = exchange(router.epp_port, [
        headers_message("/v1/completions", False),
        body_message(json.dumps({"model": "nope", "prompt": "x"}).encode(), True)])  # fmt: skip
    assert missing.immediate_response.status.code == 404
    assert "nope" in json.loads(missing.immediate_response.body)["error"]["message"]


def test_bodyless_request_and_response_pass_through(
    picker: tuple[PickerRouter, list[Engine]],
) -> None:
    router, _ = picker
    response_body = [
        ext_proc.ProcessingRequest(response_headers=ext_proc.HttpHeaders()),
        ext_proc.ProcessingRequest(response_body=ext_proc.HttpBody(body=b"data: 1\n\n")),
        ext_proc.ProcessingRequest(response_body=ext_proc.HttpBody(body=b"", end_of_stream=True)),
    ]
    answers = exchange(router.epp_port, [headers_message("/v1/models", True), *response_body])
    assert [a.WhichOneof("response") for a in answers] == [
        "request_headers", "response_headers", "response_body", "response_body"]  # fmt: skip
    assert "x-gateway-destination-endpoint" in set_headers(answers[0])
    chunks = [a.response_body.response.body_mutation.streamed_response for a in answers[2:]]
    assert [(c.body, c.end_of_stream) for c in chunks] == [(b"data: 1\n\n", False), (b"", True)]


@pytest.mark.parametrize(
    "service", ["", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"]
)
def test_grpc_health(picker: tuple[PickerRouter, list[Engine]], service: str) -> None:
    router, _ = picker
    with grpc.insecure_channel(f"127.0.0.1:{router.epp_port}") as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10
        )
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_body_over_the_routers_limit_is_a_413(picker: tuple[PickerRouter, list[Engine]]) -> None:
    router, _ = picker
    chunk = b"x" * (3 << 20)  # three of them pass the default 8 MiB maxBodyBytes
    answers = exchange(router.epp_port, [
        headers_message("/v1/completions", False), *(body_message(chunk, False) for _ in range(3))])  # fmt: skip
    assert [a.immediate_response.status.code for a in answers] == [413]
