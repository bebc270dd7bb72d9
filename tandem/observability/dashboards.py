"""Tandem's Grafana dashboards (cluster overview, engines, router), built with grafana-foundation-sdk.

Each dashboard is a list of rows of `PanelSpec`s (title, unit, PromQL targets); `build` turns
them into the SDK's builders, which lay the panels out and emit Grafana's JSON model. Queries
select one ServingCluster through the variables `$namespace` and `$cluster` (and `$pod` on the
engines dashboard, whose row repeats per pod); expensive expressions read recorded series
(rules.py).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboards
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh, VariableSort
from pydantic import BaseModel, ConfigDict

from tandem.observability import names as n
from tandem.observability import rules as r
from tandem.observability.promql import histogram_quantile

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
CLUSTER_SEL = f'{n.NAMESPACE}="$namespace",{n.CLUSTER}="$cluster"'
POD_SEL = f'{CLUSTER_SEL},{n.POD}="$pod"'
RATE = "$__rate_interval"
QUANTILES = (0.5, 0.9, 0.99)


class Target(BaseModel):
    model_config = ConfigDict(frozen=True)

    expr: str
    legend: str


class PanelSpec(BaseModel):
    model_config = ConfigDict(frozen=True)

    title: str
    description: str
    targets: tuple[Target, ...]
    unit: str = "short"
    kind: Literal["timeseries", "stat"] = "timeseries"
    width: int = 12
    height: int = 8
    stacked: bool = False
    max: float | None = None


class RowSpec(BaseModel):
    model_config = ConfigDict(frozen=True)

    title: str
    panels: tuple[PanelSpec, ...]
    repeat: str | None = None


class DashboardSpec(BaseModel):
    model_config = ConfigDict(frozen=True)

    uid: str
    title: str
    description: str
    rows: tuple[RowSpec, ...]
    pod_variable: bool = False


def _t(expr: str, legend: str) -> Target:
    return Target(expr=expr, legend=legend)


def _cluster(metric: str, extra: str = "") -> str:
    return f"{metric}{{{CLUSTER_SEL}{',' + extra if extra else ''}}}"


def _quantiles(short: str, title: str, what: str) -> PanelSpec:
    series = _cluster(r.bucket_rate(short))
    return PanelSpec(
        title=f"{title} p50 / p90 / p99",
        description=f"{what}, measured by the router over 5m windows.",
        unit="s",
        width=8,
        targets=tuple(_t(histogram_quantile(q, series), f"p{round(q * 100)}") for q in QUANTILES),
    )


def _stage_share(stage: str) -> str:
    stages = r.STAGE_PER_REQUEST
    part = _cluster(stages, f'stage="{stage}"')
    whole = _cluster(stages, 'stage="e2e"')
    return f"{part}\n/ ignoring (stage)\n{whole}"


def cluster_overview() -> DashboardSpec:
    requests = _cluster(r.REQUESTS_RATE)
    non_2xx = _cluster(r.REQUESTS_RATE, 'status!~"2.."')
    pd_stages = "|".join(s for s in r.STAGES if s != "e2e")
    traffic = RowSpec(
        title="Traffic",
        panels=(
            PanelSpec(
                title="Request rate by status",
                description="Requests the router answered per second, by HTTP status.",
                unit="reqps",
                targets=(_t(f"sum by (status) ({requests})", "{{status}}"),),
            ),
            PanelSpec(
                title="Error ratio",
                description="Share of requests answered with a 5xx, and with any non-2xx status "
                "(429s from a full admission queue included).",
                unit="percentunit",
                targets=(
                    _t(_cluster(r.ROUTER_5XX_RATIO), "5xx"),
                    _t(f"(sum({non_2xx}) or vector(0))\n/\nsum({requests})", "non-2xx"),
                ),
            ),
        ),
    )
    latency = RowSpec(
        title="Latency",
        panels=(
            _quantiles("ttft", "TTFT", "Request arrival to the first byte sent to the client"),
            _quantiles("itl", "ITL", "Gap between consecutive streamed chunks"),
            _quantiles("e2e", "E2E", "Request arrival to the last byte sent"),
        ),
    )
    queueing = RowSpec(
        title="Queueing and P/D breakdown",
        panels=(
            PanelSpec(
                title="Queueing share of E2E",
                description="(router queue + engine queue) per request / E2E per request: the "
                "study's headline figure. Above ~40% the pools are short of capacity.",
                kind="stat",
                unit="percentunit",
                width=4,
                max=1.0,
                targets=(_t(_cluster(r.QUEUEING_SHARE), "queueing share"),),
            ),
            PanelSpec(
                title="Queueing share of E2E over time",
                description="Total queueing share and its two parts: the router's admission "
                "queue and the engines' waiting queues (prefill and decode both count).",
                unit="percentunit",
                width=8,
                max=1.0,
                targets=(
                    _t(_cluster(r.QUEUEING_SHARE), "total"),
                    _t(_stage_share("router_queue"), "router queue"),
                    _t(_stage_share("engine_queue"), "engine queue"),
                ),
            ),
            PanelSpec(
                title="P/D breakdown per request",
                description="Mean seconds per client request in each stage: router queue, "
                "schedule (tokenize, index lookup, scoring), engine queue, prefill on the "
                "prefill pod, KV handoff to the decode pod, and the resulting first token.",
                unit="s",
                targets=(_t(_cluster(r.STAGE_PER_REQUEST, f'stage=~"{pd_stages}"'), "{{stage}}"),),
            ),
        ),
    )
    cache = RowSpec(
        title="Prefix cache and KV",
        panels=(
            PanelSpec(
                title="Prefix-cache hit rate: router predicted vs engines measured",
                description="Router: prompt blocks it expected cached on the chosen decode "
                "engine (by index). Engines: prefix-cache hits over queries in tokens (by pool). "
                "A gap means the router's index disagrees with the engines' caches.",
                unit="percentunit",
                max=1.0,
                targets=(
                    _t(_cluster(r.ROUTER_PREFIX_HIT), "router predicted ({{index}})"),
                    _t(_cluster(r.ENGINE_PREFIX_HIT), "engines measured ({{tandem_dev_role}})"),
                ),
            ),
            PanelSpec(
                title="KV-cache usage by pool",
                description="Mean and highest KV-cache usage of each pool's engines.",
                unit="percentunit",
                max=1.0,
                targets=(
                    _t(
                        f"avg by ({n.ROLE}) ({_cluster(n.ENGINE_KV_USAGE)})",
                        "{{tandem_dev_role}} mean",
                    ),
                    _t(
                        f"max by ({n.ROLE}) ({_cluster(n.ENGINE_KV_USAGE)})",
                        "{{tandem_dev_role}} max",
                    ),
                ),
            ),
        ),
    )
    pools = RowSpec(
        title="Pools and autoscaler",
        panels=(
            PanelSpec(
                title="Pool sizes: desired vs ready",
                description="Replicas of each pool the operator asks for and those ready "
                "(from the operator's status reports).",
                targets=(_t(_cluster(n.OPERATOR_POOL_REPLICAS), "{{pool}} {{state}}"),),
            ),
            PanelSpec(
                title="Autoscaler decisions",
                description="Evaluations per window by pool and outcome (ScaledUp, ScaledDown, "
                "Steady, Stabilizing, MetricsUnavailable).",
                targets=(
                    _t(
                        f"sum by (pool, decision) (increase({_cluster(n.AUTOSCALER_EVALUATIONS)}[{RATE}]))",
                        "{{pool}} {{decision}}",
                    ),
                ),
            ),
            PanelSpec(
                title="Autoscaler replicas",
                description="Per pool: current, ready, the clamped recommendation, the decided "
                "size, and the configured min and max.",
                targets=(_t(_cluster(n.AUTOSCALER_REPLICAS), "{{pool}} {{kind}}"),),
            ),
            PanelSpec(
                title="Autoscaler signals vs targets",
                description="The latency quantile each pool is judged by (prefill TTFT, decode "
                "ITL) beside its target, as the autoscaler read them from Prometheus.",
                unit="s",
                targets=(
                    _t(
                        _cluster(n.AUTOSCALER_SIGNAL, 'signal="latency_seconds"'),
                        "{{pool}} observed",
                    ),
                    _t(
                        _cluster(n.AUTOSCALER_TARGET, 'signal="latency_seconds"'), "{{pool}} target"
                    ),
                ),
            ),
        ),
    )
    return DashboardSpec(
        uid="tandem-cluster",
        title="Tandem / Cluster overview",
        description="One ServingCluster: traffic, latency, queueing share, P/D breakdown, "
        "prefix cache, KV usage, pool sizes and the autoscaler.",
        rows=(traffic, latency, queueing, cache, pools),
    )


def engines() -> DashboardSpec:
    def pod(metric: str) -> str:
        return f"{metric}{{{POD_SEL}}}"

    row = RowSpec(
        title="$pod",
        repeat="pod",
        panels=(
            PanelSpec(
                title="Requests waiting and running",
                description="vLLM's scheduler queue and running batch on this pod.",
                width=6,
                targets=(
                    _t(pod(n.ENGINE_WAITING), "waiting"),
                    _t(pod(n.ENGINE_RUNNING), "running"),
                ),
            ),
            PanelSpec(
                title="KV-cache usage",
                description="Share of the pod's KV-cache blocks in use.",
                unit="percentunit",
                width=6,
                max=1.0,
                targets=(_t(pod(n.ENGINE_KV_USAGE), "KV usage"),),
            ),
            PanelSpec(
                title="Preemptions",
                description="Requests preempted per second (KV cache full).",
                unit="ops",
                width=6,
                targets=(_t(f"rate({pod(n.ENGINE_PREEMPTIONS)}[{RATE}])", "preemptions"),),
            ),
            PanelSpec(
                title="Throughput",
                description="Prompt tokens prefilled and tokens generated per second.",
                unit="short",
                width=6,
                targets=(
                    _t(f"rate({pod(n.ENGINE_PROMPT_TOKENS)}[{RATE}])", "prompt tokens/s"),
                    _t(f"rate({pod(n.ENGINE_GENERATION_TOKENS)}[{RATE}])", "generated tokens/s"),
                ),
            ),
        ),
    )
    return DashboardSpec(
        uid="tandem-engines",
        title="Tandem / Engines",
        description="One row per engine pod of a ServingCluster: queue, batch, KV usage, "
        "preemptions and throughput.",
        rows=(row,),
        pod_variable=True,
    )


def router() -> DashboardSpec:
    def rate_by(metric: str, labels: str, extra: str = "") -> str:
        return f"sum by ({labels}) (rate({_cluster(metric, extra)}[{RATE}]))"

    def total(metric: str, extra: str = "") -> str:
        # A counter of rare events has no series until its first one: read that as 0/s.
        return f"sum(rate({_cluster(metric, extra)}[{RATE}])) or vector(0)"

    decisions = RowSpec(
        title="Decisions",
        panels=(
            PanelSpec(
                title="Routing decisions by reason",
                description="disaggregated (prefill pod, then decode pod), local (the decode "
                "pod prefills) or fallback.",
                unit="ops",
                targets=(_t(rate_by(n.ROUTER_DECISIONS, "decision"), "{{decision}}"),),
            ),
            PanelSpec(
                title="Routing decision time p50 / p99",
                description="Tokenize, index lookup and scoring per request.",
                unit="s",
                targets=tuple(
                    _t(
                        histogram_quantile(
                            q, f"rate({_cluster(n.ROUTER_DECISION_TIME + '_bucket')}[{RATE}])"
                        ),
                        f"p{round(q * 100)}",
                    )
                    for q in (0.5, 0.99)
                ),
            ),
        ),
    )
    failures = RowSpec(
        title="Retries, fallbacks and refusals",
        panels=(
            PanelSpec(
                title="Retries and fallbacks",
                description="Upstream attempts retried on another engine, and requests sent "
                "down the fallback route.",
                unit="ops",
                width=8,
                targets=(
                    _t(total(n.ROUTER_RETRIES), "retries"),
                    _t(total(n.ROUTER_DECISIONS, 'decision="fallback"'), "fallbacks"),
                ),
            ),
            PanelSpec(
                title="429s and rejections",
                description="Requests refused before routing (queue full, queue timeout, "
                "invalid) and 429s relayed from the engines.",
                unit="ops",
                width=8,
                targets=(
                    _t(total(n.ROUTER_REJECTED), "rejected"),
                    _t(total(n.ROUTER_REQUESTS, 'status="429"'), "429 answered"),
                ),
            ),
            PanelSpec(
                title="Client disconnects and upstream errors",
                description="Clients gone mid-request, and failed upstream requests.",
                unit="ops",
                width=8,
                targets=(
                    _t(total(n.ROUTER_DISCONNECTS), "client disconnects"),
                    _t(total(n.ROUTER_UPSTREAM_ERRORS), "upstream errors"),
                ),
            ),
        ),
    )
    exact_index = _cluster(n.ROUTER_INDEX_BLOCKS, 'index="exact"')
    index = RowSpec(
        title="Prefix index and engines",
        panels=(
            PanelSpec(
                title="Prefix index size",
                description="Distinct blocks in the exact (KV-event) and approximate "
                "(past routes) indexes; the largest over router replicas and processes, each of "
                "which keeps its own (the exact ones hold the same blocks).",
                width=8,
                targets=(_t(f"max by (index) ({_cluster(n.ROUTER_INDEX_BLOCKS)})", "{{index}}"),),
            ),
            PanelSpec(
                title="KV-event lag p50 / p99",
                description="From an engine publishing a KV-event batch to the router applying "
                "it (engine clock to router clock: skew between nodes included): how far the "
                "exact index trails the engines' caches.",
                unit="s",
                width=8,
                targets=tuple(
                    _t(
                        histogram_quantile(
                            q, f"rate({_cluster(n.ROUTER_KV_EVENT_LAG + '_bucket')}[{RATE}])"
                        ),
                        f"p{round(q * 100)}",
                    )
                    for q in (0.5, 0.99)
                ),
            ),
            PanelSpec(
                title="KV events applied (exact index changes)",
                description="How often the KV-event index changed per window: flat at 0 while "
                "the engines prefill means the subscribers are stale.",
                width=8,
                targets=(
                    _t(
                        f"sum(changes({exact_index}[5m]))",
                        "changes per 5m",
                    ),
                ),
            ),
            PanelSpec(
                title="Admission queue and in-flight per engine",
                description="Requests waiting in the router's admission queue, and router "
                "requests open on each engine (summed over router replicas and processes).",
                width=12,
                targets=(
                    _t(f"sum({_cluster(n.ROUTER_QUEUE_WAITING)})", "admission queue"),
                    _t(
                        f"sum by (pool, endpoint) ({_cluster(n.ROUTER_ENGINE_IN_FLIGHT)})",
                        "{{pool}} {{endpoint}}",
                    ),
                ),
            ),
            PanelSpec(
                title="Healthy engines by pool",
                description="Engines passing the health checks of at least one router "
                "process (each router replica and process checks on its own).",
                width=12,
                targets=(
                    _t(
                        "sum by (pool) (max by (pool, endpoint) "
                        f"({_cluster(n.ROUTER_ENGINE_HEALTHY)}))",
                        "{{pool}}",
                    ),
                ),
            ),
        ),
    )
    return DashboardSpec(
        uid="tandem-router",
        title="Tandem / Router",
        description="The KV-aware router of a ServingCluster: decisions, retries and "
        "fallbacks, refusals, disconnects, prefix index and engine health.",
        rows=(decisions, failures, index),
    )


def _variable(name: str, label: str, query: str) -> dashboards.QueryVariable:
    return (
        dashboards.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(query)
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
    )


def _panel(spec: PanelSpec, panel_id: int) -> Any:
    builder: Any = stat.Panel() if spec.kind == "stat" else timeseries.Panel()
    builder = (
        builder.id(panel_id)
        .title(spec.title)
        .description(spec.description)
        .datasource(DATASOURCE)
        .unit(spec.unit)
        .min(0)
        .height(spec.height)
        .span(spec.width)
    )
    if spec.max is not None:
        builder = builder.max(spec.max)
    if spec.kind == "stat":
        builder = builder.graph_mode(common.BigValueGraphMode.AREA).reduce_options(
            common_builders.ReduceDataOptions().calcs(["lastNotNull"])
        )
    else:
        builder = builder.fill_opacity(10)
    for index, target in enumerate(spec.targets):
        builder = builder.with_target(
            prometheus.Dataquery()
            .expr(target.expr)
            .legend_format(target.legend)
            .ref_id(chr(ord("A") + index))
        )
    return builder


def build(spec: DashboardSpec) -> dict[str, Any]:
    """Grafana's JSON model of one dashboard."""
    builder = (
        dashboards.Dashboard(spec.title)
        .uid(spec.uid)
        .description(spec.description)
        .tags(["tandem"])
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .with_variable(
            dashboards.DatasourceVariable("datasource").label("Data source").type("prometheus")
        )
        .with_variable(
            _variable("namespace", "Namespace", f"label_values({n.ROUTER_REQUESTS}, {n.NAMESPACE})")
        )
        .with_variable(
            _variable(
                "cluster",
                "ServingCluster",
                f'label_values({n.ROUTER_REQUESTS}{{{n.NAMESPACE}="$namespace"}}, {n.CLUSTER})',
            )
        )
    )
    if spec.pod_variable:
        builder = builder.with_variable(
            _variable("pod", "Pod", f"label_values({n.ENGINE_RUNNING}{{{CLUSTER_SEL}}}, {n.POD})")
            .multi(True)
            .include_all(True)
        )
    panel_id = 0
    for row in spec.rows:
        panel_id += 1
        row_builder = dashboards.Row(row.title).id(panel_id)
        if row.repeat:
            row_builder = row_builder.repeat(row.repeat)
        builder = builder.with_row(row_builder)
        for panel in row.panels:
            panel_id += 1
            builder = builder.with_panel(_panel(panel, panel_id))
    model: dict[str, Any] = json.loads(json.dumps(builder.build(), cls=JSONEncoder))
    return model


DASHBOARDS = {"cluster-overview": cluster_overview, "engines": engines, "router": router}


def dashboard_json(name: str) -> str:
    return json.dumps(build(DASHBOARDS[name]()), indent=2, sort_keys=True) + "\n"
