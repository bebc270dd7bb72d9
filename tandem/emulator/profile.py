"""Timing profiles (YAML): how long one engine step and one KV transfer take."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
H200_PROFILE = "h200-llama-3.1-8b"
FALLBACK_PROFILE = "llm-d-h100-8b"
REFERENCE_BLOCK_SIZE = 16


class ModelShape(BaseModel):
    model_config = ConfigDict(extra="forbid")
    layers: int = Field(32, ge=1)
    kv_heads: int = Field(8, ge=1)
    head_dim: int = Field(128, ge=1)
    dtype_bytes: int = Field(2, ge=1)

    @property
    def kv_bytes_per_token(self) -> int:
        """layers * 2 (K and V) * kv_heads * head_dim * dtype_bytes."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes


class StepTiming(BaseModel):
    """Duration of one forward pass over a mixed batch.

    t = base_s
      + per_token_s * scheduled_tokens              (prefill chunk tokens + 1 per decode seq)
      + per_attention_pair_s * sum over prefill chunks of chunk_len * (cached_ctx + chunk_len / 2)
      + per_decode_seq_s * decode_seqs
      + per_context_token_s * sum of context lengths of decode seqs
      + per_prefill_token_s * prefill chunk tokens  (extension, default 0)
      + per_prefill_seq_s * prefill chunks          (extension, default 0)
    """

    model_config = ConfigDict(extra="forbid")
    base_s: float = Field(0.006, ge=0)
    per_token_s: float = Field(2.0e-5, ge=0)
    per_attention_pair_s: float = Field(1.0e-10, ge=0)
    per_decode_seq_s: float = Field(1.0e-5, ge=0)
    per_context_token_s: float = Field(1.0e-8, ge=0)
    per_prefill_token_s: float = Field(0.0, ge=0)
    per_prefill_seq_s: float = Field(0.0, ge=0)


class KVTransferTiming(BaseModel):
    """Time of a P/D KV pull: latency_s + full kv bytes / bandwidth_bytes_per_s.

    The bytes really moved through NIXL are emulated_bytes_per_token per token, or (when 0)
    kv bytes/token * bytes_scale, so the emulator's memory stays small while the timing uses
    the full size.
    """

    model_config = ConfigDict(extra="forbid")
    bandwidth_bytes_per_s: float = Field(2.5e10, gt=0)
    latency_s: float = Field(0.0005, ge=0)
    emulated_bytes_per_token: int = Field(0, ge=0)
    bytes_scale: float = Field(0.001, gt=0)


class Capacity(BaseModel):
    """KV capacity when --num-gpu-blocks-override is not given (at the memory model's reference
    settings when the profile has one: TimingProfile.num_gpu_blocks).

    num_gpu_blocks counts blocks of REFERENCE_BLOCK_SIZE (16, vLLM's default) tokens: like vLLM,
    which sizes the cache in bytes, another --block-size keeps the same number of KV tokens.
    """

    model_config = ConfigDict(extra="forbid")
    num_gpu_blocks: int = Field(30000, ge=2)


class DraftTiming(BaseModel):
    """One step of a draft proposer over the speculating sequences:

    t = base_s + per_seq_s * seqs + per_context_token_s * sum of their context lengths
    """

    model_config = ConfigDict(extra="forbid")
    base_s: float = Field(0.0, ge=0)
    per_seq_s: float = Field(0.0, ge=0)
    per_context_token_s: float = Field(0.0, ge=0)

    def seconds(self, seqs: int, context_tokens: int) -> float:
        return self.base_s + self.per_seq_s * seqs + self.per_context_token_s * context_tokens


class SpeculativeTiming(BaseModel):
    """What speculative decoding adds to a step in which `seqs` sequences verify k drafts each.

    verify = verify_base_s + per_verify_token_s * seqs * k
             + per_verify_context_token_s * k * sum of the sequences' context lengths
    (on top of the plain decode step of the same sequences), and the proposer runs k draft steps
    before it: k * drafts[method].seconds(seqs, context). Methods without an entry cost nothing
    on the GPU (ngram looks the drafts up in the prompt on the CPU).
    """

    model_config = ConfigDict(extra="forbid")
    verify_base_s: float = Field(0.0, ge=0)
    per_verify_token_s: float = Field(2.2e-5, ge=0)
    per_verify_context_token_s: float = Field(0.0, ge=0)
    drafts: dict[str, DraftTiming] = Field(default_factory=dict)

    def seconds(self, method: str, k: int, seqs: int, context_tokens: int) -> float:
        if k <= 0 or seqs <= 0:
            return 0.0
        verify = (
            self.verify_base_s
            + self.per_verify_token_s * seqs * k
            + self.per_verify_context_token_s * k * context_tokens
        )
        draft = self.drafts.get(method)
        return verify + (k * draft.seconds(seqs, context_tokens) if draft else 0.0)


class GPUMemory(BaseModel):
    """The emulated GPU's memory, for capacity and the DCGM-named gauges.

    Used = non_torch_bytes + weights_bytes + KV blocks in use * block bytes
           + activation_bytes_per_token * tokens of the step in flight.
    KV capacity moves with --gpu-memory-utilization and --max-num-batched-tokens as vLLM's
    profiling run makes it: the profile's num_gpu_blocks hold at the reference settings, and
        blocks = num_gpu_blocks + ((util - reference_util) * total_bytes
                 - (max_num_batched_tokens - reference_tokens) * activation_bytes_per_token)
                 / (kv bytes per token * 16)
    """

    model_config = ConfigDict(extra="forbid")
    total_bytes: int = Field(150_754_820_096, ge=1)  # 143771 MiB, an H200 as NVML reports it
    weights_bytes: int = Field(16_094_069_248, ge=0)
    activation_bytes_per_token: int = Field(161_605, ge=0)
    non_torch_bytes: int = Field(825_229_312, ge=0)  # CUDA context and NCCL, outside PyTorch
    reference_gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    reference_max_num_batched_tokens: int = Field(8192, ge=1)


class SleepTiming(BaseModel):
    """What vLLM's sleep mode costs on this GPU (measured by benchmarks/h200_wake.py).

    sleep, level 1 = unmap_s + weights / pin_bytes_per_s + weights / offload_bytes_per_s
                     (a fresh pinned CPU buffer per sleep, then a device-to-host copy)
    sleep, level 2 = unmap_s                             (nothing is kept)
    wake, weights  = map_s + weights / wake_bytes_per_s  (host-to-device from the pinned copy)
                     or, after level 2, map_s + weights / reload_bytes_per_s
    wake, KV cache = map_s                               (fresh physical memory, contents lost)
    """

    model_config = ConfigDict(extra="forbid")
    pin_bytes_per_s: float = Field(1.58e9, gt=0)
    offload_bytes_per_s: float = Field(5.52e10, gt=0)
    wake_bytes_per_s: float = Field(5.54e10, gt=0)
    reload_bytes_per_s: float = Field(7.1e9, gt=0)
    map_s: float = Field(0.0087, ge=0)
    unmap_s: float = Field(0.061, ge=0)

    def sleep_seconds(self, level: int, weights_bytes: int) -> float:
        if level <= 0:
            return 0.0
        if level == 1:
            return (
                self.unmap_s
                + weights_bytes / self.pin_bytes_per_s
                + weights_bytes / self.offload_bytes_per_s
            )
        return self.unmap_s

    def wake_weights_seconds(self, level: int, weights_bytes: int) -> float:
        rate = self.wake_bytes_per_s if level == 1 else self.reload_bytes_per_s
        return self.map_s + weights_bytes / rate


class TimingProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str = ""
    model: ModelShape = ModelShape()
    step: StepTiming = StepTiming()
    kv_transfer: KVTransferTiming = KVTransferTiming()
    capacity: Capacity = Capacity()
    speculative: SpeculativeTiming = SpeculativeTiming()
    memory: GPUMemory | None = None  # None: capacity stays num_gpu_blocks whatever the settings
    sleep: SleepTiming = SleepTiming()

    def gpu_memory(self) -> GPUMemory:
        """The memory model (an H200 with 8B bf16 weights when the profile gives none)."""
        return self.memory or GPUMemory()

    def num_gpu_blocks(
        self, block_size: int, gpu_memory_utilization: float, max_num_batched_tokens: int
    ) -> int:
        """KV blocks of `block_size` tokens at these settings (see GPUMemory)."""
        blocks16 = self.capacity.num_gpu_blocks
        memory = self.memory
        if memory is not None:
            spare = (
                gpu_memory_utilization - memory.reference_gpu_memory_utilization
            ) * memory.total_bytes - (
                max_num_batched_tokens - memory.reference_max_num_batched_tokens
            ) * memory.activation_bytes_per_token
            blocks16 += int(spare // (self.model.kv_bytes_per_token * REFERENCE_BLOCK_SIZE))
        return max(2, blocks16 * REFERENCE_BLOCK_SIZE // block_size)

    def step_seconds(
        self,
        prefill_chunks: list[tuple[int, int]],
        decode_seqs: int,
        decode_context_tokens: int,
    ) -> float:
        """Step time for prefill chunks [(chunk_len, cached_ctx)] and decode seqs (see StepTiming)."""
        step = self.step
        prefill_tokens = 0
        pairs = 0.0
        for chunk_len, cached_ctx in prefill_chunks:
            prefill_tokens += chunk_len
            pairs += chunk_len * (cached_ctx + chunk_len / 2)
        return (
            step.base_s
            + step.per_token_s * (prefill_tokens + decode_seqs)
            + step.per_attention_pair_s * pairs
            + step.per_decode_seq_s * decode_seqs
            + step.per_context_token_s * decode_context_tokens
            + step.per_prefill_token_s * prefill_tokens
            + step.per_prefill_seq_s * len(prefill_chunks)
        )

    def transfer_seconds(self, num_tokens: int) -> float:
        """Simulated KV pull time of `num_tokens` tokens."""
        kv = self.kv_transfer
        return kv.latency_s + num_tokens * self.model.kv_bytes_per_token / kv.bandwidth_bytes_per_s

    def emulated_bytes_per_token(self) -> int:
        """Bytes per token that are really moved through NIXL (at least 1)."""
        kv = self.kv_transfer
        if kv.emulated_bytes_per_token:
            return kv.emulated_bytes_per_token
        return max(1, round(self.model.kv_bytes_per_token * kv.bytes_scale))


def default_profile_name() -> str:
    """The H200 profile when it is shipped, else the llm-d H100 reference profile."""
    return H200_PROFILE if (PROFILES_DIR / f"{H200_PROFILE}.yaml").exists() else FALLBACK_PROFILE


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


def load_profile(name_or_path: str | None = None) -> TimingProfile:
    """Load a profile by shipped name (see `available_profiles()`) or by YAML file path."""
    ref = name_or_path or default_profile_name()
    path = Path(ref)
    if not (path.suffix in (".yaml", ".yml") and path.exists()):
        path = PROFILES_DIR / f"{ref}.yaml"
    if not path.exists():
        raise ValueError(
            f"timing profile {ref!r} not found; shipped: {', '.join(available_profiles())}"
        )
    with path.open() as handle:
        data = yaml.safe_load(handle)
    return TimingProfile.model_validate(data)
