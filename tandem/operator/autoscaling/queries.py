"""PromQL for each pool's signals, selected by namespace, cluster and role labels, and their reading."""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, ConfigDict, ValidationError

from tandem.common.roles import Role
from tandem.operator.autoscaling.policy import PoolPolicy
from tandem.operator.autoscaling.prometheus import PrometheusClient, PrometheusUnavailable
from tandem.operator.autoscaling.signals import PoolSignals

# Prometheus label names that the scrape config must produce from the pods' labels
# `tandem.dev/cluster` and `tandem.dev/role` (what a PodMonitor's podTargetLabels and a
# kubernetes_sd relabelling with labelmap both yield); `namespace` as both add it.
CLUSTER_LABEL = "tandem_dev_cluster"
ROLE_LABEL = "tandem_dev_role"
NAMESPACE_LABEL = "namespace"

# The latency histogram each pool is judged by: prefill by time to first token (on a prefill pod
# that is its queue plus prefill time), decode by the time between output tokens.
LATENCY_HISTOGRAM: dict[Role, str] = {
    "prefill": "vllm:time_to_first_token_seconds",
    "decode": "vllm:inter_token_latency_seconds",
}


class PoolSelector(BaseModel):
    """Which series belong to one pool of one ServingCluster."""

    model_config = ConfigDict(frozen=True)

    namespace: str
    cluster: str
    pool: Role
    cluster_label: str = CLUSTER_LABEL
    role_label: str = ROLE_LABEL
    namespace_label: str = NAMESPACE_LABEL

    def matchers(self) -> str:
        """The label matchers, e.g. `{namespace="serving",tandem_dev_cluster="llama",tandem_dev_role="decode"}`."""
        pairs = (
            (self.namespace_label, self.namespace),
            (self.cluster_label, self.cluster),
            (self.role_label, self.pool),
        )
        return "{" + ",".join(f'{name}="{_escape(value)}"' for name, value in pairs if name) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def series(metric: str, selector: PoolSelector) -> str:
    """`metric` of the pool, e.g. `vllm:num_requests_waiting` -> `{__name__=~"vllm[:_]num_requests_waiting",...}`.

    The name matches both spellings, so the query holds whichever an exporter writes: vLLM names
    its metrics with a colon, and exporters that escape names for OpenMetrics write an underscore.
    """
    prefix, _, rest = metric.partition(":")
    return "{" + f'__name__=~"{prefix}[:_]{rest}",' + selector.matchers()[1:]


def _duration(seconds: float) -> str:
    return f"{max(1, round(seconds))}s"


def pool_queries(selector: PoolSelector, policy: PoolPolicy) -> dict[str, str]:
    """One PromQL expression per signal of the pool; each returns one value (or nothing).

    - engines:      count(vllm:num_requests_running{sel})
    - latency:      histogram_quantile(q, sum by (le) (rate(<latency histogram>_bucket{sel}[w])))
    - waiting:      sum(vllm:num_requests_waiting{sel})
    - running:      sum(vllm:num_requests_running{sel})
    - kv_usage:     avg(vllm:kv_cache_usage_perc{sel})
    - request_rate: sum(rate(vllm:request_success_total{sel}[w]))
    (each metric name written as in `series`, so both exposition spellings match).
    """
    window = _duration(policy.metrics_window_s)
    histogram = LATENCY_HISTOGRAM[selector.pool]
    return {
        "engines": f"count({series('vllm:num_requests_running', selector)})",
        "latency_s": (
            f"histogram_quantile({policy.quantile:g}, sum by (le) "
            f"(rate({series(histogram + '_bucket', selector)}[{window}])))"
        ),
        "waiting": f"sum({series('vllm:num_requests_waiting', selector)})",
        "running": f"sum({series('vllm:num_requests_running', selector)})",
        "kv_usage": f"avg({series('vllm:kv_cache_usage_perc', selector)})",
        "request_rate": f"sum(rate({series('vllm:request_success_total', selector)}[{window}]))",
    }


async def read_pool_signals(
    client: PrometheusClient, selector: PoolSelector, policy: PoolPolicy
) -> PoolSignals:
    """Run the pool's queries concurrently; raises PrometheusUnavailable if any query fails or
    a value is outside what its signal can be (PoolSignals' bounds)."""
    queries = pool_queries(selector, policy)
    values = await asyncio.gather(*(client.value(q) for q in queries.values()))
    observed = dict(zip(queries, values, strict=True))
    try:
        return PoolSignals(
            pool=selector.pool,
            engines=observed["engines"] or 0,
            latency_s=observed["latency_s"],
            waiting=observed["waiting"] or 0.0,
            running=observed["running"] or 0.0,
            kv_usage=observed["kv_usage"],
            request_rate=observed["request_rate"],
        )
    except ValidationError as exc:
        problems = "; ".join(f"{e['loc'][0]}={e.get('input')!r}: {e['msg']}" for e in exc.errors())
        raise PrometheusUnavailable(
            f"{client.base_url} returned implausible values for {selector.matchers()}: {problems}"
        ) from None
