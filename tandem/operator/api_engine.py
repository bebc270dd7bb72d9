"""What the engines run: the model, the vLLM settings of both pools, and each pool's own."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from tandem.common.routing import DEFAULT_STEP_TOKENS
from tandem.operator.api_kube import (
    DrainSpec,
    EnvVar,
    Probes,
    ResourceRequirements,
    RolloutStrategy,
    SecretKeyRef,
    Toleration,
)
from tandem.operator.api_lora import LoraCapacity
from tandem.operator.api_model import CrossFieldRule, Quantity, SpecModel

DEFAULT_ENGINE_IMAGE = "vllm/vllm-openai:v0.32.0"


class ModelCache(SpecModel):
    """A PersistentVolumeClaim holding model weights; mounted into every engine pod, never deleted."""

    pvc: str = Field(min_length=1)
    """Name of an existing PersistentVolumeClaim in the ServingCluster's namespace."""
    mount_path: str = Field("/models", alias="mountPath", pattern=r"^/")
    """Where the claim is mounted; HF_HOME points below it so downloads land on the claim."""
    sub_path: str | None = Field(None, alias="subPath")
    """Sub-directory of the claim to mount instead of its root."""
    read_only: bool = Field(False, alias="readOnly")
    """Mount read-only (weights were put there beforehand; nothing is downloaded)."""


class ModelSpec(SpecModel):
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


class SpeculativeSpec(SpecModel):
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


class GPUSharingSpec(SpecModel):
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


class EngineSpec(SpecModel):
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


class PoolSpec(SpecModel):
    """One pool of vLLM pods (prefill or decode)."""

    replicas: int = Field(1, ge=0)
    """Pod count when autoscaling is off (clamped to the autoscaling range when on)."""
    tensor_parallel_size: int = Field(1, ge=1, le=64, alias="tensorParallelSize")
    """GPUs per pod for one model replica (--tensor-parallel-size); also the default GPU limit."""
    max_num_batched_tokens: int = Field(DEFAULT_STEP_TOKENS, ge=1, alias="maxNumBatchedTokens")
    """Token budget of one engine step (--max-num-batched-tokens); long prompts are chunked. The
    predictive router counts each prefill's steps at it (an extraArgs override included)."""
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
