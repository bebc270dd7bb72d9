"""The router's Prometheus metrics: per-stage latency histograms, decision and prefix-hit counters.

They are the lock-free families of `tandem.common.metrics`, which matters at a few observations
per proxied request; exposition goes through prometheus_client's registry and text format.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from tandem.common.metrics import CounterFamily, Family, HistogramFamily

_LATENCY = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0,
)  # fmt: skip
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
_ROUTING = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01)
_ERROR_RATIO = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)


class _Collector(Collector):
    def __init__(
        self,
        families: list[HistogramFamily | CounterFamily],
        gauges: list[Callable[[], Iterable[Metric]]],
    ):
        self.families = families
        self.gauges = gauges

    def collect(self) -> Iterator[Metric]:
        for family in self.families:
            yield family.collect()
        for read in self.gauges:
            yield from read()


def latency(name: str, documentation: str, labelnames: list[str]) -> HistogramFamily:
    """A histogram of request-stage seconds, on the latency buckets."""
    return HistogramFamily(name, documentation, labelnames, buckets=_LATENCY)


class RouterMetrics:
    def __init__(self) -> None:
        self.queue = latency(
            "tandem_router_queue_seconds",
            "Time waiting in the router's admission queue.",
            ["priority"],
        )
        self.prefill = latency(
            "tandem_router_prefill_seconds",
            "Prefill request on a prefill pod (max_tokens=1).",
            ["endpoint"],
        )
        self.kv_handoff = latency(
            "tandem_router_kv_handoff_seconds",
            "From the prefill pod's answer to the decode pod's first body byte (KV pull + first step).",
            ["endpoint"],
        )
        self.ttft = latency(
            "tandem_router_ttft_seconds",
            "Request arrival to the first body byte sent to the client.",
            ["pool", "endpoint"],
        )
        self.itl = HistogramFamily(
            "tandem_router_inter_token_seconds",
            "Gap between consecutive streamed chunks.",
            ["endpoint"],
            buckets=_ITL,
        )
        self.e2e = latency(
            "tandem_router_e2e_seconds",
            "Request arrival to the last byte sent.",
            ["pool", "endpoint"],
        )
        self.routing = HistogramFamily(
            "tandem_router_decision_seconds",
            "Tokenize, index lookup and scoring.",
            buckets=_ROUTING,
        )
        self.requests = CounterFamily(
            "tandem_router_requests_total",
            "Requests answered, by route and HTTP status.",
            ["route", "status"],
        )
        self.decisions = CounterFamily(
            "tandem_router_decisions_total",
            "Routing decisions: disaggregated, local or fallback.",
            ["decision"],
        )
        self.prefix_query_blocks = CounterFamily(
            "tandem_router_prefix_query_blocks_total", "Full prompt blocks looked up.", ["index"]
        )
        self.prefix_hit_blocks = CounterFamily(
            "tandem_router_prefix_hit_blocks_total",
            "Prompt blocks already cached on the chosen decode engine.",
            ["index"],
        )
        self.prefix_hits = CounterFamily(
            "tandem_router_prefix_hit_requests_total",
            "Requests routed to an engine with a prefix hit.",
            ["index"],
        )
        self.retries = CounterFamily(
            "tandem_router_retries_total",
            "Upstream attempts retried on another engine.",
            ["pool", "reason"],
        )
        self.upstream_errors = CounterFamily(
            "tandem_router_upstream_errors_total",
            "Failed upstream requests.",
            ["pool", "endpoint", "kind"],
        )
        self.rejected = CounterFamily(
            "tandem_router_rejected_total", "Requests refused before routing.", ["reason"]
        )
        self.tenant_requests = CounterFamily(
            "tandem_router_tenant_requests_total",
            "Requests per tenant (tenancy on) by admission outcome: admitted, shed, queue_full, "
            "queue_timeout, rate_limit.",
            ["tenant", "outcome"],
        )
        self.tenant_queue = latency(
            "tandem_router_tenant_queue_seconds",
            "Time an admitted request of the tenant waited in the admission queue (tenancy on).",
            ["tenant"],
        )
        self.disconnects = CounterFamily(
            "tandem_router_client_disconnects_total", "Clients that went away mid-request."
        )
        self.tokenize_fallbacks = CounterFamily(
            "tandem_router_tokenize_fallbacks_total",
            "Requests the router could not tokenize exactly (routed on the approximation).",
            ["reason"],
        )
        self.stripped = CounterFamily(
            "tandem_router_stripped_kv_transfer_params_total",
            "Client requests that carried kv_transfer_params (removed).",
        )
        self.handoff_rejected = CounterFamily(
            "tandem_router_kv_handoff_rejected_total",
            "Prefill answers whose kv_transfer_params did not name the answering engine (502).",
            ["endpoint"],
        )
        self.kv_event_lag = latency(
            "tandem_router_kv_event_lag_seconds",
            "Engine clock at a live KV-event batch's publication to this router applying it "
            "(replays not counted; clock skew between nodes included).",
            ["endpoint"],
        )
        self.kv_event_errors = CounterFamily(
            "tandem_router_kv_event_errors_total",
            "KV-event batches or subscriptions that failed (the subscriber logs and resubscribes).",
            ["endpoint", "kind"],
        )
        self.engine_wait = latency(
            "tandem_router_engine_wait_seconds",
            "Time a request waited for a decode engine to become ready (scale from zero), by "
            "outcome: ready, or timeout (answered 503).",
            ["outcome"],
        )
        self.prefill_wanted = CounterFamily(
            "tandem_router_prefill_wanted_total",
            "Requests served on a decode engine only because no prefill engine was ready, which "
            "P/D would have taken (wakes a prefill pool at zero).",
        )
        self.arrivals = CounterFamily(
            "tandem_router_arrivals_total",
            "Requests received on the completion endpoints (scale to zero's activity signal).",
        )
        self.handoffs_moved = CounterFamily(
            "tandem_router_handoffs_moved_total",
            "Predictive policy: P/D handoffs sent to another decode engine than planned, chosen "
            "again when the prefill answered.",
        )
        self.prefills_held = CounterFamily(
            "tandem_router_local_prefills_held_total",
            "Predictive policy: local prefills of a whole step's budget held back (at most their "
            "predicted stall) until the handoffs already sent to their engine landed.",
        )
        self.step_holds = CounterFamily(
            "tandem_router_prefills_held_for_step_total",
            "Predictive policy: prefills held in the router to halfway through their engine's "
            "next step, which ends this router's prefills queued there, so as not to delay "
            "them (and those held behind such a prefill).",
        )
        self.prediction_error = HistogramFamily(
            "tandem_router_prediction_error_ratio",
            "Predictive policy: |observed - predicted| / observed per request (its _sum / _count "
            "is the MAPE): ttft, prefill, tpot, output_tokens, and output_tokens_mean (the "
            "running mean as the prediction, the baseline).",
            ["quantity"],
            buckets=_ERROR_RATIO,
        )
        # Exposed at 0 from the start: Prometheus's increase() over a series that is born at 1
        # would miss its first request, and these wake and keep awake pools at zero.
        self.arrivals.labels()
        self.prefill_wanted.labels()
        families = [
            v for v in vars(self).values() if isinstance(v, HistogramFamily | CounterFamily)
        ]
        self._families = families
        self._gauges: list[Callable[[], Iterable[Metric]]] = []
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(families, self._gauges))

    def child(self, metric: Family[Any], *labels: str) -> Any:
        """`metric.labels(*labels)` (kept as one call site for the hot path)."""
        return metric.labels(*labels)

    def forget_endpoint(self, endpoint: str) -> None:
        """Drops every series labelled with `endpoint` (the engine left the pool)."""
        for family in self._families:
            if "endpoint" not in family.labelnames:
                continue
            at = family.labelnames.index("endpoint")
            for values in [v for v in family.children if v[at] == endpoint]:
                del family.children[values]

    def add_gauges(self, read: Callable[[], Iterable[Metric]]) -> None:
        self._gauges.append(read)

    def render(self) -> bytes:
        return generate_latest(self.registry)
