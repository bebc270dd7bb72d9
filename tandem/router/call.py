"""One client request on its way through the router: its parts, its timing, and the error
response that ends it early."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.router.httpserver import Request, Responder

if TYPE_CHECKING:
    from tandem.router.predict.predictor import Ticket


class ClientError(Exception):
    """A response to send as is (an error decided before or during routing)."""

    def __init__(self, status: int, body: bytes, headers: list[tuple[str, str]] | None = None):
        super().__init__(status)
        self.status = status
        self.body = body
        self.headers = headers or []


class Timing:
    """One request's timing breakdown (perf_counter seconds).

    Each stage is measured once and goes two ways: into its Prometheus histogram and into an
    `x-tandem-<stage>-ms` response header (`add_headers`). The client's headers leave when the
    decode pod's first body byte arrives, so every stage up to that byte can be reported.
    """

    __slots__ = ("prefill_done", "prefill_s", "queue_s", "schedule_s", "start", "upstream_start")

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.queue_s = 0.0
        self.schedule_s = 0.0
        self.upstream_start: float | None = None  # the first upstream request (prefill or decode)
        self.prefill_s: float | None = None
        self.prefill_done: float | None = None

    def add_headers(self, headers: list[tuple[str, str]], first_byte: float) -> None:
        """Appends the breakdown up to the decode pod's first body byte, in milliseconds."""
        headers.append(("x-tandem-queue-ms", f"{self.queue_s * 1e3:.3f}"))
        headers.append(("x-tandem-schedule-ms", f"{self.schedule_s * 1e3:.3f}"))
        if self.prefill_done is not None and self.prefill_s is not None:
            headers.append(("x-tandem-prefill-ms", f"{self.prefill_s * 1e3:.3f}"))
            headers.append(
                ("x-tandem-kv-handoff-ms", f"{(first_byte - self.prefill_done) * 1e3:.3f}")
            )
        if self.upstream_start is not None:
            headers.append(
                ("x-tandem-upstream-ms", f"{(first_byte - self.upstream_start) * 1e3:.3f}")
            )
        headers.append(("x-tandem-ttft-ms", f"{(first_byte - self.start) * 1e3:.3f}"))


@dataclass(slots=True)
class Call:
    """One client request on its way through the router."""

    request: Request
    responder: Responder
    body: dict[str, Any]
    chat: bool
    stripped: bool  # the client's kv_transfer_params were removed: the raw body cannot be sent
    show_engines: bool  # a trusted client asked for the engines' addresses
    request_id: str
    timing: Timing
    tenant: str = ""  # `TenantDirectory.identify`'s name; "" with tenancy off
    # the `predictive` policy's record of the request, and what its answer showed
    ticket: Ticket | None = None
    output_tokens: int | None = None  # stream events (or usage) of the answer
    last_event: float | None = None  # perf_counter of the answer's last stream chunk
