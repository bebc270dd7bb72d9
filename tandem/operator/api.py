"""The ServingCluster v1alpha1 API (group tandem.dev) as pydantic models: the resource, its spec and
the spec's autoscaling section; the other sections live in the api_* modules."""

from __future__ import annotations

from typing import Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
)

from tandem.common.capacity import H200_LLAMA_8B_KV_TOKENS, StepCost
from tandem.common.roles import Role
from tandem.operator.api_engine import EngineSpec, ModelSpec, PoolSpec
from tandem.operator.api_gateway import GatewayJoin, InferencePoolSpec
from tandem.operator.api_lora import LoraSpec
from tandem.operator.api_model import MAX_NAME_LENGTH, NAME_PATTERN, CrossFieldRule, SpecModel
from tandem.operator.api_monitoring import MonitoringSpec
from tandem.operator.api_network import NetworkPolicySpec
from tandem.operator.api_router import RouterSpec
from tandem.operator.api_status import PoolAutoscalingStatus, ServingClusterStatus

GROUP = "tandem.dev"
VERSION = "v1alpha1"
API_VERSION: Final = "tandem.dev/v1alpha1"
KIND: Final = "ServingCluster"
PLURAL = "servingclusters"
SINGULAR = "servingcluster"
# `sc` as asked for; kubectl resolves it to StorageClass first wherever that built-in is
# served, so `tsc` is the unambiguous one.
SHORT_NAMES = ["sc", "tsc"]


_MIN_LE_MAX = CrossFieldRule(
    cel="self.min <= self.max",
    message="min must be <= max",
    field="min",
    check=lambda s: s.min <= s.max,
)


class PrefillAutoscaling(SpecModel):
    """Prefill pool range and targets: time to first token and waiting requests."""

    min: int = Field(1, ge=1)
    """Fewest prefill pods."""
    max: int = Field(8, ge=1)
    """Most prefill pods."""
    target_ttft_seconds: float | None = Field(0.8, gt=0, alias="targetTTFTSeconds")
    """Time to first token (at `quantile`) to keep under; unset = not read."""
    target_waiting_per_replica: float | None = Field(None, gt=0, alias="targetWaitingPerReplica")
    """Mean waiting requests per prefill pod to keep under; unset = not read."""

    cel_rules = (_MIN_LE_MAX,)


class DecodeAutoscaling(SpecModel):
    """Decode pool range and targets: inter-token latency, KV-cache usage and waiting requests."""

    min: int = Field(1, ge=1)
    """Fewest decode pods."""
    max: int = Field(16, ge=1)
    """Most decode pods."""
    target_itl_seconds: float | None = Field(0.05, gt=0, alias="targetITLSeconds")
    """Inter-token latency (at `quantile`) to keep under; unset = not read."""
    max_kv_usage: float | None = Field(0.85, gt=0, le=1, alias="maxKVUsage")
    """Mean KV-cache usage (0..1) to keep under; unset = not read."""
    target_waiting_per_replica: float | None = Field(None, gt=0, alias="targetWaitingPerReplica")
    """Mean waiting requests per decode pod to keep under; unset = not read."""

    cel_rules = (_MIN_LE_MAX,)


class PlannerSpec(SpecModel):
    """The P:D planner's model of an engine and its forecast (read when autoscaling.mode is planner)."""

    target_utilization: float = Field(0.8, gt=0, le=1, alias="targetUtilization")
    """Share of an engine's capacity the planner fills at most; the rest is headroom for bursts.
    Prefill also stays under the utilisation at which its TTFT target holds."""
    startup_seconds: float = Field(60, ge=0, alias="startupSeconds")
    """How long a new engine pod takes to serve; the forecast looks this far plus one interval ahead."""
    forecast_sigmas: float = Field(1.28, ge=0, alias="forecastSigmas")
    """Headroom above the forecast, in standard deviations of its recent errors (1.28: about 90 %)."""
    step: StepCost = Field(default_factory=StepCost)
    """Seed of one engine step's duration (defaults: the emulator's H200 Llama-3.1-8B profile);
    the planner corrects it from the engines' measured latencies."""
    kv_cache_tokens: int = Field(H200_LLAMA_8B_KV_TOKENS, ge=1, alias="kvCacheTokens")
    """KV-cache tokens of one decode engine (vLLM logs it at start as "GPU KV cache size")."""


class ScaleToZeroSpec(SpecModel):
    """Both pools to zero engines when the cluster is idle, and back when requests arrive; the
    router stays up and holds requests meanwhile (docs/autoscaling.md, "Scale to zero")."""

    enabled: bool = False
    """Scale both pools to zero after `idleSeconds` without requests."""
    idle_seconds: float = Field(900, ge=0, alias="idleSeconds")
    """No request answered, held or in flight at the router for this long: both pools go to 0."""
    wake_timeout_seconds: float = Field(300, gt=0, le=3600, alias="wakeTimeoutSeconds")
    """How long the router holds a request while no decode engine is ready (the router's
    `admission.engineWaitSeconds`); past it the request gets 503 with Retry-After. Cover the
    engines' start (scheduling, image pull, model load) and stay under
    `router.timeouts.requestSeconds`, which bounds the whole request."""


class AutoscalingSpec(SpecModel):
    """Prometheus-driven sizing of the two pools, each on its own signal."""

    enabled: bool = False
    """Turn the autoscaler on; off, the pools keep spec replicas."""
    provider: Literal["tandem", "keda", "hpa"] = "tandem"
    """Who sizes the pools: the operator itself (tandem), or a rendered KEDA ScaledObject or
    autoscaling/v2 HorizontalPodAutoscaler per pool (same signals and targets; the Deployments
    then leave `replicas` to them)."""
    prometheus_url: str = Field(
        "http://prometheus-operated.monitoring:9090", alias="prometheusURL", pattern=r"^https?://"
    )
    """Prometheus base URL the operator queries."""
    interval_seconds: float = Field(15, ge=1, alias="intervalSeconds")
    """How often the autoscaler evaluates."""
    prefill: PrefillAutoscaling = Field(default_factory=PrefillAutoscaling)
    """Prefill range and targets."""
    decode: DecodeAutoscaling = Field(default_factory=DecodeAutoscaling)
    """Decode range and targets."""
    scale_down_stabilization_seconds: float = Field(
        300, ge=0, alias="scaleDownStabilizationSeconds"
    )
    """A pool shrinks only to the highest recommendation seen over this many seconds."""
    metrics_window_seconds: float = Field(60, gt=0, alias="metricsWindowSeconds")
    """Range of the PromQL rate() windows for latency quantiles."""
    quantile: float = Field(0.9, gt=0, lt=1)
    """Latency quantile compared with the targets (0.9 = p90)."""
    tolerance: float = Field(0.1, ge=0, lt=1)
    """A signal within this fraction of its target does not move the pool."""
    scale_up_max_factor: float = Field(2.0, ge=1, alias="scaleUpMaxFactor")
    """One step grows a pool of n to at most max(ceil(n x factor), n + scaleUpMaxPods)."""
    scale_up_max_pods: int = Field(4, ge=1, alias="scaleUpMaxPods")
    """See scaleUpMaxFactor."""
    mode: Literal["independent", "planner"] = "independent"
    """How the built-in autoscaler decides: each pool on its own signals (independent), or both
    pools in one plan from the offered load and the engines' capacity (planner)."""
    planner: PlannerSpec = Field(default_factory=PlannerSpec)
    """The planner's engine model and forecast (mode: planner)."""
    scale_to_zero: ScaleToZeroSpec = Field(default_factory=ScaleToZeroSpec, alias="scaleToZero")
    """Zero engines while idle: decode wakes on the first held request, prefill once P/D pays (in
    mode planner, with decode)."""


class ServingClusterSpec(SpecModel):
    """Desired state of one disaggregated serving cluster."""

    model: ModelSpec
    """The model served."""
    engine: EngineSpec = Field(default_factory=EngineSpec)
    """vLLM settings of both pools."""
    prefill: PoolSpec = Field(default_factory=lambda: PoolSpec(replicas=1))
    """The prefill pool (kv_producer)."""
    decode: PoolSpec = Field(default_factory=lambda: PoolSpec(replicas=1))
    """The decode pool (kv_consumer)."""
    lora: LoraSpec | None = None
    """LoRA adapters (unset: none, and vLLM runs without LoRA support)."""
    router: RouterSpec = Field(default_factory=RouterSpec)
    """The KV-aware router."""
    gateway: GatewayJoin | None = None
    """A shared endpoint of the namespace this cluster's model joins (unset: none)."""
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    """Pool autoscaling."""
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec)
    """ServiceMonitor / PodMonitor."""
    network_policy: NetworkPolicySpec = Field(
        default_factory=NetworkPolicySpec, alias="networkPolicy"
    )
    """NetworkPolicies (on by default)."""
    inference_pool: InferencePoolSpec = Field(
        default_factory=InferencePoolSpec, alias="inferencePool"
    )
    """The Gateway API Inference Extension's InferencePool, Tandem as its endpoint picker."""
    image_pull_secrets: list[str] = Field(default_factory=list, alias="imagePullSecrets")
    """Names of docker-registry Secrets used to pull engine and router images."""
    service_account_name: str | None = Field(None, alias="serviceAccountName")
    """ServiceAccount of engine pods (none is mounted by default)."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Extra labels on every object Tandem creates (and their pods)."""
    annotations: dict[str, str] = Field(default_factory=dict)
    """Extra annotations on every object Tandem creates."""

    cel_rules = (
        CrossFieldRule(
            cel="self.router.disaggregation.mode != 'always' || self.prefill.replicas >= 1"
            " || (has(self.autoscaling) && self.autoscaling.enabled"
            " && self.autoscaling.prefill.min >= 1)",
            message="disaggregation mode always needs at least one prefill replica",
            field="prefill.replicas",
            check=lambda s: (
                s.router.disaggregation.mode != "always"
                or s.prefill.replicas >= 1
                or (s.autoscaling.enabled and s.autoscaling.prefill.min >= 1)
            ),
        ),
        CrossFieldRule(
            cel="!has(self.lora) || !has(self.lora.adapters) || self.lora.adapters.all(a, a.name"
            " != (has(self.model.servedName) ? self.model.servedName : self.model.name))",
            message="a LoRA adapter cannot take the served model's name",
            field="lora.adapters",
            check=lambda s: (
                s.lora is None or all(a.name != s.model.served_model_name for a in s.lora.adapters)
            ),
        ),
    )


class ObjectMeta(BaseModel):
    """The part of metadata Tandem reads; everything else is kept as given."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, use_attribute_docstrings=True)

    name: str = Field(min_length=1, max_length=MAX_NAME_LENGTH, pattern=NAME_PATTERN)
    """Object name; prefix of every child's name."""
    namespace: str = "default"
    """Namespace of the object and its children."""
    uid: str | None = None
    """Set by the API server; owner references of the children point at it."""
    generation: int | None = None
    """Set by the API server; bumped by every spec change."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Labels of the ServingCluster itself."""
    annotations: dict[str, str] = Field(default_factory=dict)
    """Annotations of the ServingCluster itself."""


class ServingCluster(BaseModel):
    """A ServingCluster: one model served by a prefill pool, a decode pool and a router."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, use_attribute_docstrings=True)

    api_version: Literal["tandem.dev/v1alpha1"] = Field(API_VERSION, alias="apiVersion")
    """tandem.dev/v1alpha1."""
    kind: Literal["ServingCluster"] = KIND
    """ServingCluster."""
    metadata: ObjectMeta
    """Standard object metadata."""
    spec: ServingClusterSpec
    """Desired state."""
    status: ServingClusterStatus = Field(default_factory=ServingClusterStatus)
    """Observed state."""

    @field_validator("status", mode="wrap")
    @classmethod
    def _lenient_status(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """A status the operator cannot read (another writer's, an older version's) never makes
        the object unusable: it is recomputed from the children anyway."""
        try:
            return handler(value)
        except ValidationError:
            return ServingClusterStatus()

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        return self.metadata.namespace


def pool_replicas(sc: ServingCluster, role: Role) -> int:
    """Replicas a pool should run.

    Autoscaling off: spec.<pool>.replicas. On: status.autoscaling.<pool>.replicas when the
    autoscaler has decided, else clamp(spec.<pool>.replicas, min, max).
    """
    pool: PoolSpec = getattr(sc.spec, role)
    scaling = sc.spec.autoscaling
    if not scaling.enabled:
        return pool.replicas
    decided: PoolAutoscalingStatus | None = (
        getattr(sc.status.autoscaling, role) if sc.status.autoscaling else None
    )
    if decided is not None and decided.replicas is not None:
        return decided.replicas
    bounds: PrefillAutoscaling | DecodeAutoscaling = getattr(scaling, role)
    return max(bounds.min, min(bounds.max, pool.replicas))
