"""Which failed decode requests go to the next engine: the rule, and the failures a real socket
gives for an engine that cannot be reached."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from tandem.router.decision import Route
from tandem.router.decode_retry import (
    decode_attempts,
    may_resend_without_handoff,
    may_try_another_engine,
)
from tandem.router.upstream import UpstreamError, UpstreamPool, UpstreamTimeout

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("exc", "route", "expected"),
    [
        (UpstreamError("refused", connect=True), Route.LOCAL, True),
        (UpstreamError("refused", connect=True), Route.DISAGGREGATED, True),
        (UpstreamTimeout("connect timed out", connect=True), Route.LOCAL, True),
        (UpstreamTimeout("connect timed out", connect=True), Route.DISAGGREGATED, True),
        (UpstreamError("reset", connect=True, delivered=True), Route.LOCAL, True),
        (UpstreamError("reset", connect=True, delivered=True), Route.DISAGGREGATED, False),
        (UpstreamTimeout("no head", connect=True, delivered=True), Route.LOCAL, False),
        (UpstreamTimeout("no head", connect=True, delivered=True), Route.DISAGGREGATED, False),
    ],
)
def test_only_requests_that_cannot_have_reached_the_kv_move_on(
    exc: UpstreamError, route: Route, expected: bool
) -> None:
    assert may_try_another_engine(exc, route) is expected


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (UpstreamError("reset", connect=True, delivered=True), True),
        (UpstreamTimeout("no head", connect=True, delivered=True), False),
        (UpstreamError("broken mid-body", delivered=True), False),
    ],
)
def test_after_a_handoff_only_a_connection_broken_before_any_answer_is_sent_again_locally(
    exc: UpstreamError, expected: bool
) -> None:
    assert may_resend_without_handoff(exc) is expected


STALLED = UpstreamTimeout("connect timed out", connect=True)
REFUSED = UpstreamError("refused", connect=True)


def attempts_after(ranking: list[str], outcomes: list[UpstreamError | None]) -> list[str]:
    """The engines `decode_attempts` yields when the attempts end with `outcomes` in turn (None:
    the engine refused as draining, which is no failure); stops where the outcomes do."""
    failures: list[UpstreamError] = []
    tried: list[str] = []
    for engine, outcome in zip(decode_attempts(ranking, failures), outcomes, strict=False):
        tried.append(engine)
        if outcome is not None:
            failures.append(outcome)
    return tried


@pytest.mark.parametrize(
    ("ranking", "outcomes", "expected"),
    [
        (["a"], [STALLED, STALLED, STALLED], ["a", "a"]),
        (["a", "b"], [STALLED, STALLED, STALLED], ["a", "b", "a"]),
        (["a", "b"], [STALLED, REFUSED, STALLED], ["a", "b"]),
        (["a"], [REFUSED, STALLED], ["a"]),
        (["a", "b"], [None, STALLED, STALLED], ["a", "b"]),
        ([], [STALLED], []),
    ],
)
def test_only_connects_that_timed_out_everywhere_earn_the_first_engine_once_more(
    ranking: list[str], outcomes: list[UpstreamError | None], expected: list[str]
) -> None:
    assert attempts_after(ranking, outcomes) == expected


@pytest.fixture
def unreachable() -> Iterator[str]:
    """A listener whose accept queue is full and which never accepts: a new connection's SYN is
    dropped, as on an engine too busy to accept (its process starved of CPU)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    queued: list[socket.socket] = []
    for _ in range(8):  # the kernel keeps backlog + 1 connections; the rest block in SYN-SENT
        client = socket.socket()
        client.setblocking(False)
        client.connect_ex(("127.0.0.1", port))
        queued.append(client)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        for client in queued:
            client.close()
        listener.close()


async def test_a_connect_that_times_out_reached_nothing_and_moves_on(unreachable: str) -> None:
    pool = UpstreamPool(unreachable, connect_timeout=0.5)
    with pytest.raises(UpstreamTimeout) as failure:
        await pool.request("POST", "/v1/completions", b"{}")
    assert failure.value.connect
    assert not failure.value.delivered
    assert may_try_another_engine(failure.value, Route.DISAGGREGATED)
