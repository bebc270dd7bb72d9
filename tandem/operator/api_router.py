"""The router section of the ServingCluster API: its pods, Service, routing policy and keys."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from tandem import __version__
from tandem.common.routing import (
    AdmissionConfig,
    DisaggregationConfig,
    ScoringConfig,
    TimeoutConfig,
)
from tandem.common.tenancy import TenancyConfig
from tandem.operator.api_kube import EnvVar, ResourceRequirements, Toleration
from tandem.operator.api_model import SpecModel

DEFAULT_ROUTER_IMAGE = f"ghcr.io/tandem-serving/tandem:{__version__}"


class RouterServiceSpec(SpecModel):
    """The router's Service (the endpoint clients use)."""

    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    """Service type."""
    port: int = Field(8000, ge=1, le=65535)
    """Service port (the router itself listens on 8000)."""
    annotations: dict[str, str] = Field(default_factory=dict)
    """Annotations of the Service (e.g. for a cloud load balancer)."""


class ClientKeysSecret(SpecModel):
    """A Secret holding the API keys clients present to the router (`Authorization: Bearer KEY`)."""

    name: str = Field(min_length=1)
    """Secret name (in the ServingCluster's namespace; never created or deleted by Tandem)."""
    key: str = Field("api-keys", min_length=1)
    """Key inside the Secret: one API key per line (blank lines and lines starting with # are
    ignored). The router re-reads it when the kubelet updates the mounted Secret, so keys are added
    and revoked without a restart (within the kubelet's sync period, about a minute)."""


class RouterAuthSpec(SpecModel):
    """Who may call the router, and the key the router presents to the engines."""

    client_keys_secret: ClientKeysSecret | None = Field(None, alias="clientKeysSecret")
    """Client API keys; unset, the router serves anyone who reaches it (the NetworkPolicy then
    decides who that is)."""
    engine_key: bool = Field(True, alias="engineKey")
    """Generate a random engine API key (Secret `<name>-engine-key`, owned by the ServingCluster):
    every engine runs with `--api-key` from it and the router sends it on every request, so an
    engine's OpenAI endpoints are useless to anyone who reaches its pod IP without the key."""


class RouterSpec(SpecModel):
    """The KV-aware router in front of the pools."""

    replicas: int = Field(1, ge=0)
    """Router pods. Above one, a PodDisruptionBudget keeps all but one of them through
    voluntary disruptions (drains), and the default topologySpreadConstraints spread them."""
    processes: int = Field(1, ge=1, le=64)
    """Router processes per pod, sharing its port (SO_REUSEPORT): each is a whole router on its
    own core. Give the container about one CPU core per process: the default `resources` does
    (see `resources`)."""
    image: str = DEFAULT_ROUTER_IMAGE
    """Tandem image (command `tandem router`)."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", alias="imagePullPolicy"
    )
    """When the kubelet pulls the image."""
    scoring: ScoringConfig = Field(default_factory=ScoringConfig)
    """Scorer weights."""
    disaggregation: DisaggregationConfig = Field(default_factory=DisaggregationConfig)
    """Prefill/decode split policy."""
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    """Queueing and request limits."""
    tenancy: TenancyConfig = Field(default_factory=TenancyConfig)
    """Tenants' fair shares of the admission queue and their token-rate limits (here and in a
    shared gateway, `gateway`)."""
    timeouts: TimeoutConfig = Field(default_factory=TimeoutConfig)
    """Request timeouts."""
    metrics_scrape_interval_seconds: float = Field(0.5, gt=0, alias="metricsScrapeIntervalSeconds")
    """How often the router reads each engine's /metrics (queue depth, KV usage)."""
    tokenizer: str | None = None
    """Directory with tokenizer.json inside the router image. Unset: a Hugging Face model's
    tokenizer files are fetched by an init container of the engine image, a model on
    `model.cache` is mounted read-only; otherwise the router keys prefixes by an approximation
    and condition ExactTokenization is False."""
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", alias="logLevel")
    """Router log level."""
    resources: ResourceRequirements | None = None
    """Router container resources. Unset: requests cpu 500m and memory 512Mi, limits memory 2Gi
    for one process; with `processes` > 1, one CPU core, 512Mi requested and 2Gi of memory limit
    per process (each holds its own index and tokenizer). No CPU limit: throttling would add
    latency to every request."""
    node_selector: dict[str, str] = Field(default_factory=dict, alias="nodeSelector")
    """Node labels the router pods must match."""
    tolerations: list[Toleration] = Field(default_factory=list)
    """Taints the router pods tolerate."""
    affinity: dict[str, Any] | None = None
    """A core/v1 Affinity of the router pods."""
    topology_spread_constraints: list[dict[str, Any]] | None = Field(
        None, alias="topologySpreadConstraints"
    )
    """core/v1 TopologySpreadConstraints of the router pods, passed through unchanged. Unset: at
    most one pod of skew across nodes (kubernetes.io/hostname) and zones
    (topology.kubernetes.io/zone), preferred (ScheduleAnyway) so a one-node cluster still runs
    every replica; `[]` turns spreading off."""
    env: list[EnvVar] = Field(default_factory=list)
    """Extra environment variables of the router."""
    pod_labels: dict[str, str] = Field(default_factory=dict, alias="podLabels")
    """Extra labels on router pods."""
    pod_annotations: dict[str, str] = Field(default_factory=dict, alias="podAnnotations")
    """Extra annotations on router pods."""
    service: RouterServiceSpec = Field(default_factory=RouterServiceSpec)
    """The router Service."""
    auth: RouterAuthSpec = Field(default_factory=RouterAuthSpec)
    """Client API keys of the router and the engine key between router and engines."""
    security_context: dict[str, Any] | None = Field(None, alias="securityContext")
    """A core/v1 SecurityContext of the router container, merged over Tandem's default (which
    passes the "restricted" Pod Security Standard)."""
    pod_security_context: dict[str, Any] | None = Field(None, alias="podSecurityContext")
    """A core/v1 PodSecurityContext of the router pods, merged over Tandem's default."""
