"""The ServingCluster v1alpha1 API (group tandem.dev) as pydantic models, and manifest loading."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Final, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from tandem import __version__
from tandem.common.capacity import H200_LLAMA_8B_KV_TOKENS, StepCost
from tandem.common.roles import Role
from tandem.common.routing import (
    AdmissionConfig,
    DisaggregationConfig,
    ScoringConfig,
    TimeoutConfig,
)
from tandem.common.settings import SettingsModel
from tandem.common.tenancy import TenancyConfig

GROUP = "tandem.dev"
VERSION = "v1alpha1"
API_VERSION: Final = "tandem.dev/v1alpha1"
KIND: Final = "ServingCluster"
PLURAL = "servingclusters"
SINGULAR = "servingcluster"
# `sc` as asked for; kubectl resolves it to StorageClass first wherever that built-in is
# served, so `tsc` is the unambiguous one.
SHORT_NAMES = ["sc", "tsc"]

DEFAULT_ENGINE_IMAGE = "vllm/vllm-openai:v0.32.0"
DEFAULT_ROUTER_IMAGE = f"ghcr.io/tandem-serving/tandem:{__version__}"
# Children are named "<name>-prefill" etc.; Service names are DNS-1035 labels of at most 63
# characters, so the object's own name leaves room for the longest suffix.
MAX_NAME_LENGTH = 52
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"

Quantity = int | str
"""A Kubernetes resource quantity: an integer or a string such as "500m" or "16Gi"."""


@dataclass(frozen=True)
class CrossFieldRule:
    """A rule over several fields, enforced by pydantic here and by CEL in the CRD at admission.

    `cel` is evaluated with `self` bound to the object the rule sits on; `check` is the same
    predicate in Python; `field` names the field the message is about, relative to that object.
    """

    cel: str
    message: str
    field: str
    check: Callable[[Any], bool]


class _Model(SettingsModel):
    cel_rules: ClassVar[tuple[CrossFieldRule, ...]] = ()

    @model_validator(mode="after")
    def _cross_field_rules(self) -> Any:
        for rule in self.cel_rules:
            if not rule.check(self):
                raise PydanticCustomError(
                    "cross_field", "{message}", {"message": rule.message, "field": rule.field}
                )
        return self


# --- Kubernetes building blocks (the subset of core/v1 a ServingCluster exposes) -----------------


class ResourceRequirements(_Model):
    """CPU, memory and accelerator requests and limits of one container."""

    requests: dict[str, Quantity] = Field(default_factory=dict)
    """Minimum resources the scheduler reserves, e.g. {cpu: "4", memory: 32Gi}."""
    limits: dict[str, Quantity] = Field(default_factory=dict)
    """Maximum resources; accelerators such as nvidia.com/gpu are set here."""


class Toleration(_Model):
    """A core/v1 Toleration: lets pods schedule onto nodes with a matching taint."""

    key: str | None = None
    """Taint key the toleration applies to; empty with operator Exists matches every taint."""
    operator: Literal["Exists", "Equal"] | None = None
    """Exists (any value) or Equal (the value below); Kubernetes defaults to Equal."""
    value: str | None = None
    """Taint value to match when the operator is Equal."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to match; empty matches every effect."""
    toleration_seconds: int | None = Field(None, alias="tolerationSeconds")
    """For NoExecute: how long the pod stays bound after the taint appears."""


class EnvVar(_Model):
    """A core/v1 EnvVar: a literal value or a reference (valueFrom) to a Secret, ConfigMap or field."""

    name: str = Field(min_length=1)
    """Environment variable name."""
    value: str | None = None
    """Literal value."""
    value_from: dict[str, Any] | None = Field(None, alias="valueFrom")
    """Source of the value (secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef)."""


class SecretKeyRef(_Model):
    """One key of a Secret in the ServingCluster's namespace (never created or deleted by Tandem)."""

    name: str = Field(min_length=1)
    """Secret name."""
    key: str = "token"
    """Key inside the Secret."""


class ProbeOverride(_Model):
    """Timing of one probe; unset fields keep Tandem's defaults."""

    initial_delay_seconds: int | None = Field(None, ge=0, alias="initialDelaySeconds")
    """Seconds after start before the first probe."""
    period_seconds: int | None = Field(None, ge=1, alias="periodSeconds")
    """Seconds between probes."""
    timeout_seconds: int | None = Field(None, ge=1, alias="timeoutSeconds")
    """Seconds before one probe times out."""
    failure_threshold: int | None = Field(None, ge=1, alias="failureThreshold")
    """Consecutive failures before the probe counts as failed."""
    success_threshold: int | None = Field(None, ge=1, alias="successThreshold")
    """Consecutive successes before the probe counts as passed (1 for liveness and startup)."""


class Probes(_Model):
    """Engine health probes, all on GET /health of the http port."""

    startup_budget_seconds: int = Field(1800, ge=10, alias="startupBudgetSeconds")
    """Longest time a pod may take to load the model and answer /health before it is restarted."""
    startup: ProbeOverride = Field(default_factory=ProbeOverride)
    """Overrides of the startup probe (period 10 s; the failure threshold comes from the budget)."""
    readiness: ProbeOverride = Field(default_factory=ProbeOverride)
    """Overrides of the readiness probe (period 5 s, timeout 3 s, 3 failures)."""
    liveness: ProbeOverride = Field(default_factory=ProbeOverride)
    """Overrides of the liveness probe (period 10 s, timeout 5 s, 6 failures)."""


class RolloutStrategy(_Model):
    """How a pool's Deployment replaces pods when the spec changes."""

    max_surge: Quantity = Field(0, alias="maxSurge")
    """Extra pods during a rollout; 0 by default because a GPU node rarely has a spare GPU."""
    max_unavailable: Quantity = Field(1, alias="maxUnavailable")
    """Pods that may be down during a rollout."""

    cel_rules = (
        CrossFieldRule(
            cel="!(string(self.maxSurge) in ['0', '0%'] && string(self.maxUnavailable) in ['0', '0%'])",
            message="maxSurge and maxUnavailable cannot both be 0",
            field="maxUnavailable",
            check=lambda s: (
                not (str(s.max_surge) in {"0", "0%"} and str(s.max_unavailable) in {"0", "0%"})
            ),
        ),
    )


class DrainSpec(_Model):
    """How a pod of the pool leaves when Kubernetes removes it (scale-down, rollout, eviction, node
    drain): out of routing first, then vLLM's own drain, within terminationGracePeriodSeconds."""

    pre_stop_seconds: int = Field(5, ge=0, le=300, alias="preStopSeconds")
    """Seconds between the pod's removal and vLLM's SIGTERM (a preStop sleep). The router drops a
    terminating pod from its pool as soon as its watch shows the deletion; meanwhile the engine
    keeps serving, so a request already on its way still lands. 0 sends SIGTERM at once."""


# --- spec -------------------------------------------------------------------------------------


class ModelCache(_Model):
    """A PersistentVolumeClaim holding model weights; mounted into every engine pod, never deleted."""

    pvc: str = Field(min_length=1)
    """Name of an existing PersistentVolumeClaim in the ServingCluster's namespace."""
    mount_path: str = Field("/models", alias="mountPath", pattern=r"^/")
    """Where the claim is mounted; HF_HOME points below it so downloads land on the claim."""
    sub_path: str | None = Field(None, alias="subPath")
    """Sub-directory of the claim to mount instead of its root."""
    read_only: bool = Field(False, alias="readOnly")
    """Mount read-only (weights were put there beforehand; nothing is downloaded)."""


class ModelSpec(_Model):
    """What the engines load and the name clients use."""

    name: str = Field(min_length=1)
    """What vLLM loads: a Hugging Face model id or a path inside the pod."""
    served_name: str | None = Field(None, alias="servedName", min_length=1)
    """What clients send as "model" (--served-model-name); defaults to `name`."""
    revision: str | None = None
    """Model revision (branch, tag or commit) on the Hugging Face Hub."""
    tokenizer: str | None = None
    """Tokenizer id or path of the engines when it differs from the model (--tokenizer)."""
    max_model_len: int | None = Field(None, ge=1, alias="maxModelLen")
    """Longest context (prompt plus output) in tokens; vLLM's model default when unset."""
    trust_remote_code: bool = Field(False, alias="trustRemoteCode")
    """Allow the model's own Python code from the Hub (--trust-remote-code)."""
    cache: ModelCache | None = None
    """Optional PVC with the model weights (the Hugging Face cache lives on it)."""
    hf_token_secret: SecretKeyRef | None = Field(None, alias="hfTokenSecret")
    """Secret key holding a Hugging Face token, exposed to engines as HF_TOKEN."""

    @property
    def served_model_name(self) -> str:
        return self.served_name or self.name


class SpeculativeSpec(_Model):
    """Speculative decoding (--speculative-config)."""

    method: Literal[
        "ngram", "eagle", "eagle3", "medusa", "mlp_speculator", "draft_model", "mtp"
    ] = "ngram"
    """Proposal method; ngram needs no extra weights."""
    num_speculative_tokens: int = Field(4, ge=1, le=32, alias="numSpeculativeTokens")
    """Tokens proposed per step."""
    model: str | None = None
    """Draft or EAGLE/Medusa weights (required by every method except ngram and mtp)."""
    prompt_lookup_max: int | None = Field(None, ge=1, alias="promptLookupMax")
    """ngram: longest n-gram matched in the prompt."""
    prompt_lookup_min: int | None = Field(None, ge=1, alias="promptLookupMin")
    """ngram: shortest n-gram matched in the prompt."""
    draft_tensor_parallel_size: int | None = Field(None, ge=1, alias="draftTensorParallelSize")
    """Tensor parallelism of the draft model."""

    cel_rules = (
        CrossFieldRule(
            cel="self.method in ['ngram', 'mtp'] || has(self.model)",
            message="a draft model is required unless method is ngram or mtp",
            field="model",
            check=lambda s: s.method in ("ngram", "mtp") or s.model is not None,
        ),
    )


Quantization = Literal[
    "awq", "gptq", "fp8", "bitsandbytes", "compressed-tensors", "gguf", "modelopt", "marlin"
]
KvCacheDtype = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16"]


class GPUSharingSpec(_Model):
    """Engines that share each GPU with another engine, each with part of its memory.

    Measured (docs/findings.md, section 8): two models' engines on one GPU hold half the
    GPU-seconds of a GPU each and pay in TTFT and TPOT as their steps take turns; it pays while
    both models together keep one GPU busy well under half the time, and overloads beyond.
    """

    enabled: bool = False
    """Ask for a slice of a GPU instead of a whole one, and take memoryFraction of its memory."""
    resource_name: str = Field(
        "nvidia.com/gpu.shared", alias="resourceName", pattern=r"^[a-z0-9.-]+/[a-zA-Z0-9._-]+$"
    )
    """The extended resource of a GPU slice: the NVIDIA device plugin's time-slicing or MPS
    sharing with renameByDefault advertises nvidia.com/gpu.shared, `replicas` per GPU."""
    memory_fraction: float = Field(0.45, gt=0, lt=1, alias="memoryFraction")
    """--gpu-memory-utilization of each engine (pools' gpuMemoryUtilization still wins): the
    fractions of the engines on one GPU must add up to less than 1, since vLLM checks the free
    memory at start; 0.45 suits two engines per GPU."""


class EngineSpec(_Model):
    """vLLM settings shared by both pools; pools override image, args, env and batching."""

    image: str = DEFAULT_ENGINE_IMAGE
    """vLLM OpenAI-server image."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", alias="imagePullPolicy"
    )
    """When the kubelet pulls the image."""
    block_size: Literal[1, 8, 16, 32, 64, 128] = Field(16, alias="blockSize")
    """KV-cache block size in tokens (--block-size); the router hashes prefixes with the same size."""
    kv_connector: Literal["NixlConnector"] = Field("NixlConnector", alias="kvConnector")
    """KV-transfer connector between prefill and decode pods (--kv-transfer-config). Decode pods
    also get `kv_load_failure_policy: recompute`: a failed KV pull recomputes the prompt there."""
    kv_buffer_device: Literal["cuda", "cpu"] | None = Field(None, alias="kvBufferDevice")
    """Where the connector stages KV blocks; vLLM picks the accelerator when unset."""
    kv_connector_extra_config: dict[str, Any] = Field(
        default_factory=dict, alias="kvConnectorExtraConfig"
    )
    """Extra connector settings (kv_connector_extra_config), e.g. {backends: [UCX]}."""
    hash_algo: Literal["sha256", "sha256_cbor"] = Field("sha256_cbor", alias="hashAlgo")
    """Prefix-cache block hash (--prefix-caching-hash-algo); the router recomputes it."""
    hash_seed: str = Field("0", alias="hashSeed", min_length=1)
    """PYTHONHASHSEED of every engine: pins the hash chain's seed so the router can reproduce it."""
    dtype: Literal["auto", "half", "float16", "bfloat16", "float32"] = "auto"
    """Weight and activation dtype (--dtype)."""
    quantization: Quantization | None = None
    """Weight quantization method (--quantization); detected from the checkpoint when unset."""
    kv_cache_dtype: KvCacheDtype = Field("auto", alias="kvCacheDtype")
    """KV-cache element type (--kv-cache-dtype); fp8 halves KV memory and transfer bytes."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, alias="gpuMemoryUtilization")
    """Fraction of GPU memory vLLM may use for weights, activations and KV cache."""
    enforce_eager: bool = Field(False, alias="enforceEager")
    """Disable CUDA graphs (faster start, slower steps)."""
    gpu_sharing: GPUSharingSpec | None = Field(None, alias="gpuSharing")
    """Share each GPU with another engine (split memory); off when unset."""
    shm_size: Quantity = Field("8Gi", alias="shmSize")
    """Size of the memory-backed /dev/shm volume (NCCL and tensor-parallel workers need it)."""
    probes: Probes = Field(default_factory=Probes)
    """Health-probe timing of engine pods."""
    extra_args: list[str] = Field(default_factory=list, alias="extraArgs")
    """Extra `vllm serve` arguments appended to both pools' arguments."""
    env: list[EnvVar] = Field(default_factory=list)
    """Extra environment variables of both pools."""


LoraRank = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]
"""The ranks vLLM accepts for `--max-lora-rank`."""


class LoraAdapter(_Model):
    """A LoRA adapter of the model, served under its own name."""

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][-A-Za-z0-9_.]*$")
    """The model name clients send to reach the adapter."""
    source: str = Field(
        min_length=1, max_length=1024, pattern=r"^(/.+|[-A-Za-z0-9_.]+/[-A-Za-z0-9_.]+)$"
    )
    """A Hugging Face repository id (`org/adapter`), downloaded by the engines like the model, or
    an absolute path inside the engine container (an adapter on the model volume:
    `<model.cache.mountPath>/...`)."""


class LoraCapacity(_Model):
    """LoRA adapter slots of a pool's engines; unset fields take the cluster's `lora` settings."""

    max_loras: int | None = Field(None, ge=1, alias="maxLoras")
    """Adapters one batch may use at once (vLLM `--max-loras`, GPU slots)."""
    max_lora_rank: LoraRank | None = Field(None, alias="maxLoraRank")
    """The largest adapter rank served (vLLM `--max-lora-rank`)."""
    max_cpu_loras: int | None = Field(None, ge=1, alias="maxCpuLoras")
    """Adapters kept in CPU memory, ready to swap in (vLLM `--max-cpu-loras`, >= maxLoras)."""


class LoraSpec(_Model):
    """LoRA adapters served on top of the model (vLLM `--enable-lora`), by both pools."""

    adapters: list[LoraAdapter] = Field(default_factory=list, max_length=256)
    """Adapters loaded when an engine starts (vLLM `--lora-modules`)."""
    runtime_updates: bool = Field(False, alias="runtimeUpdates")
    """Allow loading and unloading adapters at run time (`POST /v1/load_lora_adapter` and
    `/v1/unload_lora_adapter` on the router, sent to every engine; vLLM's
    VLLM_ALLOW_RUNTIME_LORA_UPDATING). An engine started later has only `adapters`."""
    max_loras: int = Field(1, ge=1, alias="maxLoras")
    """Adapters one batch may use at once (vLLM `--max-loras`); a pool's `lora` overrides it."""
    max_lora_rank: LoraRank = Field(16, alias="maxLoraRank")
    """The largest adapter rank served (vLLM `--max-lora-rank`)."""
    max_cpu_loras: int | None = Field(None, ge=1, alias="maxCpuLoras")
    """Adapters kept in CPU memory (vLLM `--max-cpu-loras`; unset: vLLM's default, maxLoras)."""

    cel_rules = (
        CrossFieldRule(
            cel="self.adapters.all(a, self.adapters.exists_one(b, b.name == a.name))",
            message="adapter names must be unique",
            field="adapters",
            check=lambda s: len({a.name for a in s.adapters}) == len(s.adapters),
        ),
        CrossFieldRule(
            cel="!has(self.maxCpuLoras) || self.maxCpuLoras >= self.maxLoras",
            message="maxCpuLoras must be >= maxLoras",
            field="maxCpuLoras",
            check=lambda s: s.max_cpu_loras is None or s.max_cpu_loras >= s.max_loras,
        ),
    )


class PoolSpec(_Model):
    """One pool of vLLM pods (prefill or decode)."""

    replicas: int = Field(1, ge=0)
    """Pod count when autoscaling is off (clamped to the autoscaling range when on)."""
    tensor_parallel_size: int = Field(1, ge=1, le=64, alias="tensorParallelSize")
    """GPUs per pod for one model replica (--tensor-parallel-size); also the default GPU limit."""
    max_num_batched_tokens: int = Field(8192, ge=1, alias="maxNumBatchedTokens")
    """Token budget of one engine step (--max-num-batched-tokens); long prompts are chunked."""
    max_num_seqs: int | None = Field(None, ge=1, alias="maxNumSeqs")
    """Most sequences in one step (--max-num-seqs)."""
    image: str | None = None
    """Image override for this pool."""
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, alias="gpuMemoryUtilization")
    """Override of engine.gpuMemoryUtilization for this pool."""
    speculative: SpeculativeSpec | None = None
    """Speculative decoding for this pool (usually decode)."""
    resources: ResourceRequirements | None = None
    """Container resources; by default requests cpu 4, memory 32Gi and limits nvidia.com/gpu to the
    tensor-parallel size."""
    node_selector: dict[str, str] = Field(default_factory=dict, alias="nodeSelector")
    """Node labels the pods must match, e.g. {nvidia.com/gpu.product: NVIDIA-H200}."""
    tolerations: list[Toleration] = Field(default_factory=list)
    """Taints the pods tolerate (GPU nodes are often tainted nvidia.com/gpu:NoSchedule)."""
    affinity: dict[str, Any] | None = None
    """A core/v1 Affinity (node and pod affinity), passed through unchanged."""
    topology_spread_constraints: list[dict[str, Any]] = Field(
        default_factory=list, alias="topologySpreadConstraints"
    )
    """core/v1 TopologySpreadConstraints, passed through unchanged."""
    lora: LoraCapacity | None = None
    """This pool's LoRA adapter slots, over the cluster's `lora` settings."""
    priority_class_name: str | None = Field(None, alias="priorityClassName")
    """PriorityClass of the pods."""
    extra_args: list[str] = Field(default_factory=list, alias="extraArgs")
    """Extra `vllm serve` arguments of this pool (after engine.extraArgs)."""
    env: list[EnvVar] = Field(default_factory=list)
    """Extra environment variables of this pool (after engine.env)."""
    pod_labels: dict[str, str] = Field(default_factory=dict, alias="podLabels")
    """Extra labels on this pool's pods."""
    pod_annotations: dict[str, str] = Field(default_factory=dict, alias="podAnnotations")
    """Extra annotations on this pool's pods."""
    probes: Probes | None = None
    """Probe timing override of this pool (replaces engine.probes)."""
    rollout: RolloutStrategy = Field(default_factory=RolloutStrategy)
    """Rolling-update limits of this pool."""
    termination_grace_period_seconds: int = Field(120, ge=0, alias="terminationGracePeriodSeconds")
    """Time a removed pod gets to leave: the preStop sleep (drain.preStopSeconds), then vLLM's own
    drain of its in-flight requests and KV handoffs (--shutdown-timeout, the rest less a teardown
    margin), then SIGKILL."""
    drain: DrainSpec = Field(default_factory=DrainSpec)
    """How a removed pod is drained (docs/reliability.md, "Drain-safe removal")."""
    security_context: dict[str, Any] | None = Field(None, alias="securityContext")
    """A core/v1 SecurityContext of the vLLM container, merged over Tandem's default (non-root uid
    1000, no privilege escalation, every capability dropped, read-only root filesystem, seccomp
    RuntimeDefault): keys given here replace the default's (e.g. capabilities: {add: [IPC_LOCK],
    drop: [ALL]} for RDMA, which then needs a namespace allowing it)."""
    pod_security_context: dict[str, Any] | None = Field(None, alias="podSecurityContext")
    """A core/v1 PodSecurityContext of this pool's pods, merged over Tandem's default (runAsNonRoot,
    uid/gid/fsGroup 1000, seccomp RuntimeDefault)."""


class RouterServiceSpec(_Model):
    """The router's Service (the endpoint clients use)."""

    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    """Service type."""
    port: int = Field(8000, ge=1, le=65535)
    """Service port (the router itself listens on 8000)."""
    annotations: dict[str, str] = Field(default_factory=dict)
    """Annotations of the Service (e.g. for a cloud load balancer)."""


class ClientKeysSecret(_Model):
    """A Secret holding the API keys clients present to the router (`Authorization: Bearer KEY`)."""

    name: str = Field(min_length=1)
    """Secret name (in the ServingCluster's namespace; never created or deleted by Tandem)."""
    key: str = Field("api-keys", min_length=1)
    """Key inside the Secret: one API key per line (blank lines and lines starting with # are
    ignored). The router re-reads it when the kubelet updates the mounted Secret, so keys are added
    and revoked without a restart (within the kubelet's sync period, about a minute)."""


class RouterAuthSpec(_Model):
    """Who may call the router, and the key the router presents to the engines."""

    client_keys_secret: ClientKeysSecret | None = Field(None, alias="clientKeysSecret")
    """Client API keys; unset, the router serves anyone who reaches it (the NetworkPolicy then
    decides who that is)."""
    engine_key: bool = Field(True, alias="engineKey")
    """Generate a random engine API key (Secret `<name>-engine-key`, owned by the ServingCluster):
    every engine runs with `--api-key` from it and the router sends it on every request, so an
    engine's OpenAI endpoints are useless to anyone who reaches its pod IP without the key."""


class RouterSpec(_Model):
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


_MIN_LE_MAX = CrossFieldRule(
    cel="self.min <= self.max",
    message="min must be <= max",
    field="min",
    check=lambda s: s.min <= s.max,
)


class PrefillAutoscaling(_Model):
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


class DecodeAutoscaling(_Model):
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


class PlannerSpec(_Model):
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


class ScaleToZeroSpec(_Model):
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


class AutoscalingSpec(_Model):
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


class MonitoringSpec(_Model):
    """Prometheus Operator objects (rendered only when the monitoring.coreos.com CRDs exist)."""

    enabled: bool = True
    """Render a ServiceMonitor for the router and a PodMonitor for the engines."""
    interval: str = Field("15s", pattern=r"^[0-9]+(ms|s|m|h)$")
    """Scrape interval."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Extra labels on the monitors (to match a Prometheus' selector, e.g. release: prometheus)."""


class EgressTarget(_Model):
    """Destinations (core/v1 NetworkPolicyPeers) and TCP ports a component may open connections to."""

    to: list[dict[str, Any]] = Field(default_factory=list)
    """NetworkPolicyPeers (podSelector, namespaceSelector, ipBlock); empty = nowhere."""
    ports: list[int] = Field(default_factory=list)
    """TCP ports."""


def _everywhere(*ports: int) -> EgressTarget:
    return EgressTarget(to=[{"ipBlock": {"cidr": "0.0.0.0/0"}}], ports=list(ports))


class PrometheusPeer(_Model):
    """Where Prometheus runs: it may scrape the router's and the engines' metrics port."""

    namespace_selector: dict[str, Any] = Field(
        default_factory=lambda: {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        alias="namespaceSelector",
    )
    """LabelSelector of Prometheus' namespaces. The default names the namespace `monitoring` by
    `kubernetes.io/metadata.name`, a label the API server sets and nobody can forge."""
    pod_selector: dict[str, Any] | None = Field(None, alias="podSelector")
    """LabelSelector of the Prometheus pods inside those namespaces; unset = every pod there."""


class NetworkPolicySpec(_Model):
    """NetworkPolicies per component, written from the traffic Tandem really has; everything else
    in and out of the cluster's pods is denied (docs/security.md has the matrix)."""

    enabled: bool = True
    """Render the NetworkPolicies (they take effect where the network plugin enforces them)."""
    allow_from: list[dict[str, Any]] = Field(default_factory=list, alias="allowFrom")
    """core/v1 NetworkPolicyPeers that may call the router (its clients); empty = anyone. Engines
    never accept traffic from these."""
    prometheus: PrometheusPeer = Field(default_factory=PrometheusPeer)
    """Prometheus, allowed to the metrics port of router and engines."""
    dns: list[dict[str, Any]] = Field(
        default_factory=lambda: [
            {
                "namespaceSelector": {
                    "matchLabels": {"kubernetes.io/metadata.name": "kube-system"}
                },
                "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
            }
        ]
    )
    """NetworkPolicyPeers of the cluster DNS (port 53, UDP and TCP); default kube-dns/CoreDNS."""
    api_server: EgressTarget = Field(
        default_factory=lambda: _everywhere(443, 6443), alias="apiServer"
    )
    """The Kubernetes API, which the router watches for engine pods. The API server is not a pod,
    so no selector names it: narrow `to` to its address blocks (an ipBlock) where known."""
    model_download: EgressTarget = Field(
        default_factory=lambda: _everywhere(443), alias="modelDownload"
    )
    """Where engines download weights (the Hugging Face Hub over HTTPS by default). Not rendered
    when the model cache is mounted read-only (engines are offline then); `to: []` denies it."""


class GatewayJoin(_Model):
    """Membership of a shared endpoint: one address for several ServingClusters' models."""

    name: str = Field(min_length=1, max_length=MAX_NAME_LENGTH, pattern=NAME_PATTERN)
    """The shared endpoint of the namespace this cluster joins. The operator runs `tandem
    gateway` as `<name>-gateway` (Deployment, Service, ConfigMap) for every ServingCluster of the
    namespace naming it: a request goes by its `model` to that model's pools, with the model's
    own P/D and KV-aware routing, admission queue, tenants and client keys; an unknown model gets
    vLLM's 404. The cluster's own router keeps serving too. The gateway's image, replicas and
    Service follow the member whose name sorts first."""
    replicas: int = Field(1, ge=0)
    """Gateway pods (the first member's value counts)."""
    service: RouterServiceSpec = Field(default_factory=RouterServiceSpec)
    """The gateway's Service (the first member's value counts)."""


class InferencePoolSpec(_Model):
    """The Gateway API Inference Extension (docs/gateway-api.md): an InferencePool
    (inference.networking.k8s.io/v1) of this cluster's engines, with the router as its endpoint
    picker, so that a GIE gateway (Envoy based) routes to them by Tandem's placement."""

    enabled: bool = False
    """Render the InferencePool, the endpoint picker's Service `<name>-epp` and, with P/D, the
    relay container beside each decode engine. Needs the InferencePool CRD in the cluster."""
    epp_port: int = Field(9002, ge=1, le=65535, alias="eppPort")
    """The router's endpoint picker port (Envoy ext_proc over gRPC, and gRPC health)."""
    relay_port: int = Field(8001, ge=1, le=65535, alias="relayPort")
    """The port of the relay container (`tandem relay`) in decode pods: the pool's target port
    under P/D. Without P/D the target port is the engines' own."""
    failure_mode: Literal["FailOpen", "FailClose"] = Field("FailClose", alias="failureMode")
    """What the gateway does when the endpoint picker does not answer: FailClose answers 503,
    FailOpen sends the request to an endpoint of the pool without Tandem's placement (the
    gateway's ext_proc filter must then send request bodies BUFFERED: docs/gateway-api.md)."""
    allow_from: list[dict[str, Any]] = Field(default_factory=list, alias="allowFrom")
    """core/v1 NetworkPolicyPeers of the gateway (its proxy pods): allowed to the endpoint picker
    and to the pool's target port; empty = anyone."""


class ServingClusterSpec(_Model):
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


# --- status -----------------------------------------------------------------------------------


class _Status(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, use_attribute_docstrings=True)


class PoolStatus(_Status):
    """Observed state of one Deployment."""

    desired: int = 0
    """Replicas asked for."""
    ready: int = 0
    """Pods passing readiness."""
    updated: int = 0
    """Pods running the current template."""
    summary: str = "0/0"
    """"ready/desired", for printer columns."""


class Condition(_Status):
    """A standard Kubernetes condition."""

    type: str
    """Ready, Progressing, Degraded, ExactTokenization or ScalingLimited."""
    status: Literal["True", "False", "Unknown"]
    """Whether the condition holds."""
    reason: str = ""
    """One CamelCase word saying why."""
    message: str = ""
    """A sentence for people."""
    last_transition_time: str | None = Field(None, alias="lastTransitionTime")
    """When status last changed (RFC 3339)."""
    observed_generation: int | None = Field(None, alias="observedGeneration")
    """metadata.generation the condition was computed for."""


class PoolAutoscalingStatus(_Status):
    """The autoscaler's last decision for one pool."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, use_attribute_docstrings=True)

    replicas: int | None = None
    """Replicas the autoscaler chose; the renderer uses them while autoscaling is enabled."""
    last_scale_time: str | None = Field(None, alias="lastScaleTime")
    """When replicas last changed (RFC 3339)."""
    reason: str | None = None
    """Why (the metric and value that drove the decision)."""


class AutoscalingStatus(_Status):
    """Autoscaler decisions per pool."""

    prefill: PoolAutoscalingStatus | None = None
    """Prefill decision."""
    decode: PoolAutoscalingStatus | None = None
    """Decode decision."""


class GeneratedSecret(_Status):
    """A Secret the operator created for the ServingCluster (it never reads one back)."""

    name: str
    """Secret name."""
    uid: str
    """The uid the API server gave it at creation: a same-named Secret with another uid (or one
    that existed before) is not Tandem's."""


class ServingClusterStatus(_Status):
    """Observed state, written by the operator."""

    observed_generation: int | None = Field(None, alias="observedGeneration")
    """metadata.generation last reconciled."""
    phase: Literal["Pending", "Progressing", "Ready", "Degraded"] | None = None
    """Pending (nothing ready yet), Progressing (rolling or scaling), Ready, Degraded (failing)."""
    endpoint: str | None = None
    """In-cluster URL of the router Service."""
    prefill: PoolStatus | None = None
    """Prefill Deployment."""
    decode: PoolStatus | None = None
    """Decode Deployment."""
    router: PoolStatus | None = None
    """Router Deployment."""
    conditions: list[Condition] = Field(default_factory=list)
    """Ready, Progressing, Degraded, ExactTokenization, ScalingLimited."""
    autoscaling: AutoscalingStatus | None = None
    """Autoscaler decisions."""
    engine_key_secret: GeneratedSecret | None = Field(None, alias="engineKeySecret")
    """The engine API key Secret the operator generated."""


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


# --- loading ----------------------------------------------------------------------------------


class ManifestError(ValueError):
    """A manifest that is not a valid ServingCluster; the message names every bad field."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


def _field_path(loc: tuple[int | str, ...], extra: str | None) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in {"function-after", "function-before"} or "[" in str(part):
            continue  # pydantic's validator frames and union tags are not fields
        else:
            path += f".{part}" if path else str(part)
    if extra:
        path = f"{path}.{extra}" if path else extra
    return path or "(root)"


def _message(error: Any) -> str:
    kind = error["type"]
    ctx = error.get("ctx") or {}
    given = error.get("input")
    if kind == "missing":
        return "required field is missing"
    if kind == "extra_forbidden":
        return "unknown field"
    if kind in {"greater_than_equal", "greater_than", "less_than_equal", "less_than"}:
        op = {
            "greater_than_equal": ">=",
            "greater_than": ">",
            "less_than_equal": "<=",
            "less_than": "<",
        }
        bound = next(iter(v for k, v in ctx.items() if k in {"ge", "gt", "le", "lt"}))
        return f"must be {op[kind]} {bound} (got {given!r})"
    if kind in {"literal_error", "enum"}:
        return f"unsupported value {given!r}; must be one of {ctx.get('expected')}"
    if kind == "cross_field":
        return str(ctx.get("message", error["msg"]))
    return (
        f"{error['msg']} (got {given!r})" if not isinstance(given, (dict, list)) else error["msg"]
    )


def errors_of(exc: ValidationError, prefix: tuple[str, ...] = ()) -> list[str]:
    """One "field.path: message" line per pydantic error, with fields in their camelCase names."""
    lines = []
    for error in exc.errors():
        ctx = error.get("ctx") or {}
        extra = ctx.get("field") if error["type"] == "cross_field" else None
        lines.append(f"{_field_path(prefix + tuple(error['loc']), extra)}: {_message(error)}")
    return lines


def parse_manifest(document: Any) -> ServingCluster:
    """Validate one decoded manifest; raises ManifestError naming each bad field."""
    if not isinstance(document, dict):
        raise ManifestError(
            [f"(root): expected a ServingCluster object, got {type(document).__name__}"]
        )
    try:
        return ServingCluster.model_validate(document)
    except ValidationError as exc:
        raise ManifestError(errors_of(exc)) from None


def load_manifest(path: str | Path) -> ServingCluster:
    """Read a YAML file holding one ServingCluster (the first ServingCluster of a multi-document file)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ManifestError([f"{path}: cannot read: {exc.strerror}"]) from None
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ManifestError([f"{path}: not valid YAML: {exc}"]) from None
    if not documents:
        raise ManifestError([f"{path}: no object in the file"])
    for document in documents:
        if isinstance(document, dict) and document.get("kind") == KIND:
            return parse_manifest(document)
    return parse_manifest(documents[0])


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
