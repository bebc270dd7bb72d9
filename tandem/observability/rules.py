"""Prometheus recording rules for the dashboards' expensive expressions, and Tandem's alerts.

Every recorded series is aggregated per ServingCluster, `by (namespace, tandem_dev_cluster)`,
and named `tandem_cluster:<what>:<how>` (Prometheus's level:metric:operations convention).

Formulas (w = window; sums are over every series of the cluster):
- queueing share   = (router queue + engine queue) per request / E2E per request
                   = (Σ rate(tandem_router_queue_seconds_sum[w]) + Σ rate(vllm:request_queue_time_seconds_sum[w]))
                     / Σ rate(tandem_router_e2e_seconds_sum[w])
- stage per request = Σ rate(<stage>_sum[w]) / Σ rate(tandem_router_e2e_seconds_count[w])
- SLO error ratio  = 1 - Σ rate(<latency>_bucket{le=threshold}[w]) / Σ rate(<latency>_count[w])
- burn rate        = error ratio / (1 - objective); an SLO alert fires when both windows of a pair
                     burn faster than the pair's factor (Google SRE workbook, multi-window,
                     multi-burn-rate: 14.4 over 1h and 5m or 6 over 6h and 30m pages; 3 over 1d
                     and 2h or 1 over 3d and 6h opens a ticket).
"""

from __future__ import annotations

from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tandem.observability import names as n
from tandem.observability.promql import BY_CLUSTER, by, ratio, selector, sum_rate, zero_if_absent

RATE_WINDOW = "5m"
RUNBOOK_BASE = "https://github.com/tandem-serving/tandem/blob/main/docs/observability.md"
SLO_WINDOWS = ("5m", "30m", "1h", "2h", "6h", "1d", "3d")
Severity = Literal["critical", "warning"]

# The router's bucket bounds (tandem/router/metrics.py), as its exposition writes them: an SLO
# threshold must be one of them, or the error ratio could not be read off the histogram.
ROUTER_LATENCY_BOUNDS = ("0.1", "0.25", "0.5", "1.0", "2.5", "5.0", "10.0")
ROUTER_ITL_BOUNDS = ("0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5")


class LatencySLO(BaseModel):
    """`objective` of the events (requests for TTFT, token gaps for ITL) finish within `threshold`."""

    model_config = ConfigDict(frozen=True)

    name: Literal["ttft", "itl"]
    metric: str
    threshold: str
    objective: float = Field(gt=0, lt=1)

    @model_validator(mode="after")
    def _threshold_is_a_bucket_bound(self) -> LatencySLO:
        bounds = ROUTER_LATENCY_BOUNDS if self.name == "ttft" else ROUTER_ITL_BOUNDS
        if self.threshold not in bounds:
            raise ValueError(f"{self.name} threshold must be a bucket bound: {bounds}")
        return self

    @property
    def budget(self) -> float:
        return round(1.0 - self.objective, 6)

    def error_ratio(self, window: str) -> str:
        return f"tandem_cluster:{self.name}_slo_errors:ratio_rate{window}"


class SLOs(BaseModel):
    """The latency objectives the burn-rate alerts guard (router-side: what the client sees)."""

    model_config = ConfigDict(frozen=True)

    ttft: LatencySLO = LatencySLO(
        name="ttft", metric=n.ROUTER_TTFT, threshold="1.0", objective=0.99
    )
    itl: LatencySLO = LatencySLO(name="itl", metric=n.ROUTER_ITL, threshold="0.1", objective=0.99)


class Thresholds(BaseModel):
    """Alert thresholds that are not SLOs."""

    model_config = ConfigDict(frozen=True)

    queueing_share: float = 0.4  # the study: queueing above 40% of E2E is worth acting on
    router_5xx_ratio: float = 0.05
    stale_index_window: str = "10m"


class RecordingRule(BaseModel):
    model_config = ConfigDict(frozen=True)

    record: str
    expr: str
    labels: dict[str, str] = Field(default_factory=dict)

    def rule(self) -> dict[str, object]:
        out: dict[str, object] = {"record": self.record, "expr": self.expr}
        if self.labels:
            out["labels"] = dict(self.labels)
        return out


class AlertRule(BaseModel):
    """An alert, plus `probes`: the expressions that feed it, which must return data on a running
    cluster even when the alert is quiet (its own `expr` is empty then)."""

    model_config = ConfigDict(frozen=True)

    alert: str
    expr: str
    for_: str = Field(alias="for")
    severity: Severity
    summary: str
    description: str
    probes: tuple[str, ...]

    def rule(self) -> dict[str, object]:
        return {
            "alert": self.alert,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity},
            "annotations": {
                "summary": self.summary,
                "description": self.description,
                "runbook_url": f"{RUNBOOK_BASE}#{self.alert.lower()}",
            },
        }


class RuleGroup(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    rules: tuple[RecordingRule | AlertRule, ...]

    def group(self) -> dict[str, object]:
        return {"name": self.name, "rules": [rule.rule() for rule in self.rules]}


# --- recording rules --------------------------------------------------------------------------

REQUESTS_RATE = "tandem_cluster:router_requests:rate5m"
ROUTER_5XX_RATIO = "tandem_cluster:router_5xx:ratio_rate5m"
STAGE_PER_REQUEST = "tandem_cluster:request_stage_seconds:per_request_rate5m"
QUEUEING_SHARE = "tandem_cluster:queueing_share:ratio_rate5m"
ROUTER_PREFIX_HIT = "tandem_cluster:router_prefix_hit:ratio_rate5m"
ENGINE_PREFIX_HIT = "tandem_cluster:engine_prefix_cache_hit:ratio_rate5m"
KV_HANDOFF_FAILURES = "tandem_cluster:kv_handoff_failures:rate5m"

# Histograms whose quantiles the dashboards draw: short name -> metric.
QUANTILE_HISTOGRAMS = {"ttft": n.ROUTER_TTFT, "itl": n.ROUTER_ITL, "e2e": n.ROUTER_E2E}
# P/D stages per client request: stage label -> the histogram whose _sum it reads.
STAGES = {
    "router_queue": n.ROUTER_QUEUE,
    "schedule": n.ROUTER_DECISION_TIME,
    "engine_queue": n.ENGINE_QUEUE_TIME,
    "prefill": n.ROUTER_PREFILL,
    "kv_handoff": n.ROUTER_KV_HANDOFF,
    "first_token": n.ROUTER_TTFT,
    "e2e": n.ROUTER_E2E,
}
QUEUE_STAGES = ("router_queue", "engine_queue")


def bucket_rate(short: str) -> str:
    """Name of the recorded per-cluster bucket rate of one of QUANTILE_HISTOGRAMS."""
    return f"tandem_cluster:router_{short}_seconds_bucket:rate5m"


def _histogram_rules() -> list[RecordingRule]:
    return [
        RecordingRule(
            record=bucket_rate(short),
            expr=sum_rate(f"{metric}_bucket", RATE_WINDOW, [*BY_CLUSTER, "le"]),
        )
        for short, metric in QUANTILE_HISTOGRAMS.items()
    ]


def _stage_rules() -> list[RecordingRule]:
    requests = sum_rate(f"{n.ROUTER_E2E}_count", RATE_WINDOW)
    return [
        RecordingRule(
            record=STAGE_PER_REQUEST,
            expr=ratio(sum_rate(f"{metric}_sum", RATE_WINDOW), requests),
            labels={"stage": stage},
        )
        for stage, metric in STAGES.items()
    ]


def queueing_share_expr(stages: str = STAGE_PER_REQUEST) -> str:
    """(router queue + engine queue) / E2E, from the per-request stage series."""
    queued = "|".join(QUEUE_STAGES)
    return ratio(
        f'sum without (stage) ({stages}{{stage=~"{queued}"}})',
        f'ignoring (stage) {stages}{{stage="e2e"}}',
    )


def _slo_rules(slo: LatencySLO) -> list[RecordingRule]:
    return [
        RecordingRule(
            record=slo.error_ratio(window),
            expr=(
                "1 - (\n"
                + ratio(
                    sum_rate(selector(f"{slo.metric}_bucket", {"le": slo.threshold}), window),
                    sum_rate(f"{slo.metric}_count", window),
                )
                + "\n)"
            ),
        )
        for window in SLO_WINDOWS
    ]


def recording_rules(slos: SLOs) -> list[RuleGroup]:
    requests_by_status = sum_rate(n.ROUTER_REQUESTS, RATE_WINDOW, [*BY_CLUSTER, "route", "status"])
    all_requests = f"sum by ({by(BY_CLUSTER)}) ({REQUESTS_RATE})"
    five_xx = f'sum by ({by(BY_CLUSTER)}) ({REQUESTS_RATE}{{status=~"5.."}})'
    hits = sum_rate(n.ROUTER_PREFIX_HIT_BLOCKS, RATE_WINDOW, [*BY_CLUSTER, "index"])
    lookups = sum_rate(n.ROUTER_PREFIX_QUERY_BLOCKS, RATE_WINDOW, [*BY_CLUSTER, "index"])
    cluster = RuleGroup(
        name="tandem.cluster.rules",
        rules=(
            RecordingRule(record=REQUESTS_RATE, expr=requests_by_status),
            RecordingRule(
                record=ROUTER_5XX_RATIO,
                expr=ratio(zero_if_absent(five_xx, all_requests), all_requests),
            ),
            *_histogram_rules(),
            *_stage_rules(),
            RecordingRule(record=QUEUEING_SHARE, expr=queueing_share_expr()),
            RecordingRule(
                record=ROUTER_PREFIX_HIT, expr=ratio(zero_if_absent(hits, lookups), lookups)
            ),
            RecordingRule(
                record=ENGINE_PREFIX_HIT,
                expr=ratio(
                    sum_rate(n.ENGINE_PREFIX_HITS, RATE_WINDOW, [*BY_CLUSTER, n.ROLE]),
                    sum_rate(n.ENGINE_PREFIX_QUERIES, RATE_WINDOW, [*BY_CLUSTER, n.ROLE]),
                ),
            ),
            RecordingRule(
                record=KV_HANDOFF_FAILURES,
                expr=(
                    sum_rate(n.ENGINE_NIXL_FAILED, RATE_WINDOW)
                    + "\n+\n"
                    + sum_rate(n.ENGINE_NIXL_EXPIRED, RATE_WINDOW)
                ),
            ),
        ),
    )
    slo = RuleGroup(name="tandem.slo.rules", rules=(*_slo_rules(slos.ttft), *_slo_rules(slos.itl)))
    return [cluster, slo]


# --- alerts -----------------------------------------------------------------------------------

# (severity, for, [(long window, short window, burn factor), ...])
BURN_TIERS: tuple[tuple[Severity, str, tuple[tuple[str, str, float], ...]], ...] = (
    ("critical", "2m", (("1h", "5m", 14.4), ("6h", "30m", 6.0))),
    ("warning", "15m", (("1d", "2h", 3.0), ("3d", "6h", 1.0))),
)


def _burn_alerts(slo: LatencySLO, title: str) -> list[AlertRule]:
    alerts = []
    for severity, for_, pairs in BURN_TIERS:
        clauses = [
            f"(\n  {slo.error_ratio(long)} > ({factor:g} * {slo.budget:g})\n"
            f"and\n  {slo.error_ratio(short)} > ({factor:g} * {slo.budget:g})\n)"
            for long, short, factor in pairs
        ]
        windows = " or ".join(
            f"{factor:g}x over {long} and {short}" for long, short, factor in pairs
        )
        alerts.append(
            AlertRule(
                alert=f"Tandem{title}SLOBurn",
                expr="\nor\n".join(clauses),
                **{"for": for_},
                severity=severity,
                summary=(
                    f"{title} error budget of {{{{ $labels.namespace }}}}/"
                    f"{{{{ $labels.tandem_dev_cluster }}}} is burning "
                    + ("fast" if severity == "critical" else "steadily")
                ),
                description=(
                    f"More than {slo.budget:.0%} of {title} observations exceed {slo.threshold}s "
                    f"at a burn rate of {windows} (objective {slo.objective:.0%}). Now "
                    f"{{{{ $value | humanizePercentage }}}} of the long window's events are slow."
                ),
                probes=tuple(slo.error_ratio(w) for w in SLO_WINDOWS),
            )
        )
    return alerts


def alert_rules(slos: SLOs, limits: Thresholds) -> RuleGroup:
    cluster = "{{ $labels.namespace }}/{{ $labels.tandem_dev_cluster }}"
    pool = f"{cluster} pool {{{{ $labels.pool }}}}"
    healthy_by_pool = f"sum by ({by([*BY_CLUSTER, n.POOL])}) ({n.ROUTER_ENGINE_HEALTHY})"
    desired = (
        f'max by ({by([*BY_CLUSTER, n.POOL])}) ({n.OPERATOR_POOL_REPLICAS}{{state="desired"}})'
    )
    ready = f'max by ({by([*BY_CLUSTER, n.POOL])}) ({n.OPERATOR_POOL_REPLICAS}{{state="ready"}})'
    window = limits.stale_index_window
    index_changes = (
        f'sum by ({by(BY_CLUSTER)}) (changes({n.ROUTER_INDEX_BLOCKS}{{index="exact"}}[{window}]))'
    )
    exact_lookups = sum_rate(selector(n.ROUTER_PREFIX_QUERY_BLOCKS, {"index": "exact"}), window)
    # New KV computed by prefills (cached prompt tokens excluded): each full block of it is a
    # BlockStored event, so the index must change.
    computed_kv = sum_rate(f"{n.ENGINE_PREFILL_COMPUTED}_sum", window)
    limited = f'{n.AUTOSCALER_LIMITED}{{limit="TooManyReplicas"}}'
    return RuleGroup(
        name="tandem.alerts",
        rules=(
            *_burn_alerts(slos.ttft, "TTFT"),
            *_burn_alerts(slos.itl, "ITL"),
            AlertRule(
                alert="TandemQueueingShareHigh",
                expr=f"{QUEUEING_SHARE} > {limits.queueing_share:g}",
                **{"for": "15m"},
                severity="warning",
                summary=f"Requests of {cluster} spend most of their time queueing",
                description=(
                    "Router queue plus engine queue is {{ $value | humanizePercentage }} of "
                    f"end-to-end latency (threshold {limits.queueing_share:.0%}): the pools are "
                    "short of capacity or the router is placing badly."
                ),
                probes=(QUEUEING_SHARE,),
            ),
            AlertRule(
                alert="TandemKVHandoffFailures",
                expr=f"{KV_HANDOFF_FAILURES} > 0",
                **{"for": "5m"},
                severity="warning",
                summary=f"KV-cache transfers between prefill and decode fail in {cluster}",
                description=(
                    "NIXL transfers fail or prefilled KV expires before the decode pod pulls it "
                    '({{ printf "%.3g" $value }} per second): those requests are prefilled twice or fail.'
                ),
                probes=(KV_HANDOFF_FAILURES,),
            ),
            AlertRule(
                alert="TandemRouter5xxRatioHigh",
                expr=f"{ROUTER_5XX_RATIO} > {limits.router_5xx_ratio:g}",
                **{"for": "5m"},
                severity="critical",
                summary=f"The router of {cluster} answers 5xx",
                description=(
                    "{{ $value | humanizePercentage }} of requests end in a 5xx "
                    f"(threshold {limits.router_5xx_ratio:.0%})."
                ),
                probes=(ROUTER_5XX_RATIO,),
            ),
            AlertRule(
                alert="TandemPoolNoHealthyEngine",
                expr=f"({healthy_by_pool} == 0)\nor\n(({desired} > 0) unless ({ready} > 0))",
                **{"for": "2m"},
                severity="critical",
                summary=f"No healthy engine in {pool}",
                description=(
                    "The router sees no engine of the pool passing health checks, or the "
                    "operator counts no ready replica while some are desired."
                ),
                probes=(healthy_by_pool, desired, ready),
            ),
            AlertRule(
                alert="TandemPoolAtMaxReplicasBreaching",
                expr=f"max by ({by([*BY_CLUSTER, n.POOL])}) ({limited}) == 1",
                **{"for": "15m"},
                severity="warning",
                summary=f"The autoscaler wants more replicas than the maximum of {pool}",
                description=(
                    "The pool is at spec.autoscaling.<pool>.max while its signals still breach "
                    "their targets: raise max or add capacity."
                ),
                probes=(n.AUTOSCALER_LIMITED, n.AUTOSCALER_REPLICAS, n.AUTOSCALER_SIGNAL),
            ),
            AlertRule(
                alert="TandemPrefixIndexStale",
                expr=(
                    f"({index_changes} == 0)\nand on ({by(BY_CLUSTER)})\n({exact_lookups} > 0)"
                    f"\nand on ({by(BY_CLUSTER)})\n({computed_kv} > 0)"
                ),
                **{"for": "10m"},
                severity="warning",
                summary=f"The router's exact prefix index of {cluster} stopped changing",
                description=(
                    f"The engines computed new prompt KV over {window} but the router's "
                    "KV-event index did not change: its KV-event subscribers are not receiving "
                    "events, so prefix-aware placement works from stale data."
                ),
                probes=(index_changes, exact_lookups, computed_kv),
            ),
            AlertRule(
                alert="TandemAutoscalerMetricsUnavailable",
                expr=f"{n.AUTOSCALER_METRICS_AVAILABLE} == 0",
                **{"for": "5m"},
                severity="warning",
                summary=f"The autoscaler cannot read the metrics of {pool}",
                description=(
                    "Prometheus did not answer or holds no engine metrics for the pool: the "
                    "autoscaler holds its size (condition MetricsUnavailable)."
                ),
                probes=(n.AUTOSCALER_METRICS_AVAILABLE, n.AUTOSCALER_EVALUATIONS),
            ),
        ),
    )


def rule_groups(slos: SLOs | None = None, limits: Thresholds | None = None) -> list[RuleGroup]:
    slos, limits = slos or SLOs(), limits or Thresholds()
    return [*recording_rules(slos), alert_rules(slos, limits)]


class _BlockDumper(yaml.SafeDumper):
    """Writes multi-line strings (the PromQL) as literal blocks, so the file reads like PromQL."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _str)


def rules_yaml(groups: list[RuleGroup] | None = None) -> str:
    """The rule file (`groups:`), as `promtool check rules` and a PrometheusRule's spec take it."""
    body = {"groups": [group.group() for group in groups or rule_groups()]}
    return yaml.dump(body, Dumper=_BlockDumper, sort_keys=False, width=100)
