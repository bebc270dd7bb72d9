"""vLLM's refusal of a request that reaches it while it drains after SIGTERM (docs/protocols.md §9)."""

from __future__ import annotations

REFUSAL = b"cannot schedule new futures after shutdown"


def refused_while_draining(status: int, body: bytes) -> bool:
    """A 500 carrying vLLM 0.32's refusal: the engine never scheduled the request (nor pulled any
    KV for it), so it may go to another engine, with its handoff."""
    return status == 500 and REFUSAL in body
