"""What the router remembers between requests, in one place: engines, indexes, pools.

The proxy reads and updates it per request; the service adds and removes engines. Forgetting an
engine goes through `forget_engine`, so no per-engine trace (index entries, metric
series, pooled connections) outlives it.
"""

from __future__ import annotations

from tandem.router.admission import Admission
from tandem.router.auth import EngineKey
from tandem.router.config import RouterConfig
from tandem.router.engines import EnginePool
from tandem.router.features import featurizer_of
from tandem.router.index import PrefixIndex
from tandem.router.metrics import RouterMetrics
from tandem.router.predict.predictor import Predictor
from tandem.router.predict.slo import slo_class
from tandem.router.tenants import TenantDirectory
from tandem.router.upstream import Upstreams


class RouterState:
    def __init__(self, config: RouterConfig, metrics: RouterMetrics | None = None):
        self.pool = EnginePool()
        self.metrics = metrics or RouterMetrics()
        self.featurizer = featurizer_of(config, self.metrics)
        self.exact_index = PrefixIndex(config.index_max_blocks_per_engine, config.pending_ttl_s)
        self.approx_index = PrefixIndex(config.index_max_blocks_per_engine)
        # The exact index is consulted only when events can meet request keys (a tokenizer is set).
        self.use_exact = config.kv_events and self.featurizer.exact
        admission = config.admission
        self.tenants = TenantDirectory(config.tenancy)
        slo_classes = config.scoring.predictive.slo_classes
        self.admission = Admission(
            admission.max_in_flight,
            admission.max_queue,
            admission.max_queue_per_priority,
            sheddable=lambda priority: slo_class(slo_classes, priority).sheddable,
            weight=self.tenants.weight,
        )
        # the `predictive` policy's ledgers and models; None under `weighted`
        self.predictor = (
            Predictor(config.scoring.predictive, self.metrics)
            if config.scoring.policy == "predictive"
            else None
        )
        engine_key = EngineKey.from_config(config)
        self.upstreams = Upstreams(
            config.timeouts.connect_s, engine_key.header if engine_key else None
        )

    def count_refusal(self, reason: str, tenant: str) -> None:
        """A request refused by admission or its tenant's rate, counted per tenant as well."""
        metrics = self.metrics
        metrics.child(metrics.rejected, reason).inc()
        if tenant:
            label = self.tenants.metric_label(tenant)
            metrics.child(metrics.tenant_requests, label, reason).inc()

    def count_admission(self, tenant: str, queue_s: float) -> None:
        """A request of `tenant` past the admission queue after `queue_s` (tenancy on)."""
        if tenant:
            metrics = self.metrics
            label = self.tenants.metric_label(tenant)
            metrics.child(metrics.tenant_queue, label).observe(queue_s)
            metrics.child(metrics.tenant_requests, label, "admitted").inc()

    def forget_engine(self, engine_id: str) -> None:
        self.exact_index.drop_engine(engine_id)
        self.approx_index.drop_engine(engine_id)
        self.upstreams.drop(engine_id)
        self.metrics.forget_endpoint(engine_id)
        if self.predictor is not None:
            self.predictor.forget(engine_id)
