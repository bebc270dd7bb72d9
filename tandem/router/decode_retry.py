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
"""

from __future__ import annotations

from tandem.router.decision import Route
from tandem.router.upstream import UpstreamError, UpstreamTimeout


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
