"""What the router may do with a decode request that failed before its response head arrived.

failure                                next engine of the ranking   once more, without the handoff
nothing reached the engine             yes                          -
  (connect refused or timed out)
the connection broke before a head,    yes (the engine aborts it)   -
  local route
the same after a handoff               no: the engine may have      yes: the engine aborted it
                                       pulled the KV, and a lease   when the connection closed,
                                       is read once                 and a local prefill needs no
                                                                    lease
no head within the idle timeout        no: the engine has it        no: the engine has it

When the connect timed out at every engine tried (either route), the first engine is tried once
more: nothing reached any of them, so a handoff is still unread, and a connect that times out on a
loopback or pod network is most often a stall of that engine or of this process (a machine short of
CPU). A dead node's address times out as well: then the extra attempt adds one connect timeout
before the 502. A lease that ran out meanwhile fails the pull, and the decode answer's failure
sends the request once more without the handoff (`kv_failure.py`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar

from tandem.router.decision import Route
from tandem.router.upstream import UpstreamError, UpstreamTimeout

Engine = TypeVar("Engine")


def _broken_before_head(exc: UpstreamError) -> bool:
    return exc.connect and not isinstance(exc, UpstreamTimeout)


def may_try_another_engine(exc: UpstreamError, route: Route) -> bool:
    """Whether a decode request that failed with `exc` may go to the next engine (table above)."""
    if not exc.delivered:
        return True
    return _broken_before_head(exc) and route is Route.LOCAL


def may_resend_without_handoff(exc: UpstreamError) -> bool:
    """Whether a decode request sent with a handoff that failed with `exc`, and that no other
    engine may take with that handoff, may be sent once more without it (table above)."""
    return exc.delivered and _broken_before_head(exc)


def _stalled(exc: UpstreamError) -> bool:
    return isinstance(exc, UpstreamTimeout) and not exc.delivered


def decode_attempts(ranking: list[Engine], failures: list[UpstreamError]) -> Iterator[Engine]:
    """The engines a decode request is sent to, in turn, while the caller appends each attempt's
    failure to `failures`: the `ranking`, then its first engine once more when every attempt
    failed with a connect that timed out (table above)."""
    yield from ranking
    if ranking and len(failures) == len(ranking) and all(map(_stalled, failures)):
        yield ranking[0]
