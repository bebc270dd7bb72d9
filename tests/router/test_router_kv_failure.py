"""Which decode answers count as a failed KV pull, on answers real vLLM 0.32 gave (golden/pd/)."""

from __future__ import annotations

import pytest
from tandem_process import GOLDEN

from tandem.router.kv_failure import failed_before_output

PD = GOLDEN / "pd" / "main"


def first_event(name: str) -> bytes:
    return (PD / name).read_bytes().split(b"\n\n", 1)[0] + b"\n\n"


def test_a_stream_that_opens_with_an_error_event_failed_before_output() -> None:
    # A decode request carrying a prefill engine id it cannot reach: 200, an error event, [DONE].
    assert failed_before_output(200, True, first_event("11_decode_wrong_engine_id.sse"))
    assert failed_before_output(
        200, True, (PD / "15_decode_wrong_port_unknown_engine_stream.sse").read_bytes()
    )


def test_a_stream_with_output_or_a_cut_event_did_not() -> None:
    assert not failed_before_output(200, True, first_event("02_decode_stream.sse"))
    assert not failed_before_output(200, True, b'data: {"error": {"mess')  # cut: already output
    assert not failed_before_output(200, True, b": keep-alive\n\n")


@pytest.mark.parametrize(
    ("status", "failed"), [(500, True), (503, True), (200, False), (400, False)]
)
def test_a_plain_answer_failed_before_output_when_it_is_a_server_error(
    status: int, failed: bool
) -> None:
    assert failed_before_output(status, False, b'{"error": {}}') is failed


def test_the_golden_non_streaming_failure_is_a_500() -> None:
    head = (
        (PD / "17_decode_wrong_port_unknown_engine_nonstream.resp.http")
        .read_bytes()
        .split(b"\r\n", 1)[0]
    )
    status = int(head.split()[1])
    assert failed_before_output(status, False, b"")
