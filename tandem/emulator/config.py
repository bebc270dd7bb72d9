"""The emulator's configuration: vLLM `serve` options that matter here plus its own options."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.emulator.kv_events import KVEventsConfig


class KVTransferConfig(BaseModel):
    """`--kv-transfer-config` (vLLM's KVTransferConfig fields used here; others kept, ignored)."""

    model_config = ConfigDict(extra="allow")
    kv_connector: str | None = None
    engine_id: str | None = None
    kv_role: str | None = None
    kv_buffer_device: str | None = "cuda"
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)
    # What a decode engine does when its KV pull fails: end the request with an error, or
    # prefill the prompt itself.
    kv_load_failure_policy: Literal["fail", "recompute"] = "fail"

    @property
    def lease_seconds(self) -> float:
        return float(self.kv_connector_extra_config.get("kv_lease_duration", 30))


class SpeculativeConfig(BaseModel):
    """`--speculative-config` (vLLM's SpeculativeConfig fields used here; others kept, ignored)."""

    model_config = ConfigDict(extra="allow")
    method: str | None = None
    num_speculative_tokens: int = Field(1, ge=1)
    model: str | None = None

    @property
    def proposer(self) -> str:
        """The method, inferred as vLLM does when not given: ngram without a draft model, EAGLE
        when the draft's name says so, else a draft model."""
        if self.method:
            return self.method
        if self.model is None:
            return "ngram"
        return "eagle" if "eagle" in self.model.lower() else "draft_model"


class Faults(BaseModel):
    """Failure injection for reliability tests (all off by default)."""

    model_config = ConfigDict(extra="forbid")
    startup_delay_s: float = Field(0.0, ge=0)
    error_rate: float = Field(0.0, ge=0, le=1)
    crash_after_requests: int = Field(0, ge=0)
    slow_token_probability: float = Field(0.0, ge=0, le=1)
    slow_token_delay_s: float = Field(0.0, ge=0)
    stall_after_tokens: int = Field(0, ge=0)
    stall_rate: float = Field(1.0, ge=0, le=1)
    # an API server too busy to answer its probes: /health answers this late while requests run
    health_delay_s: float = Field(0.0, ge=0)
    seed: int = 0


class LoraConfig(BaseModel):
    """--enable-lora and its slots (vLLM's names), the adapters of --lora-modules, runtime updates
    (VLLM_ALLOW_RUNTIME_LORA_UPDATING) and the emulator's adapter load times."""

    max_loras: int = Field(1, ge=1)
    max_lora_rank: int = Field(16, ge=1)
    max_cpu_loras: int | None = Field(None, ge=1)
    modules: dict[str, str] = Field(default_factory=dict)  # name -> path or Hugging Face id
    runtime_updates: bool = False
    # seconds to bring an adapter into a GPU slot, and to load one that is not in CPU memory
    swap_s: float = Field(0.002, ge=0)
    load_s: float = Field(0.05, ge=0)


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    tokenizer: str | None = None
    served_model_names: list[str] = Field(default_factory=list)
    host: str | None = None
    port: int = 8000
    block_size: int = Field(16, ge=1)
    max_num_seqs: int = Field(1024, ge=1)
    max_num_batched_tokens: int = Field(8192, ge=1)
    # vLLM's cap on one request's prompt tokens per step: a long prefill leaves room in each
    # step's budget for the requests behind it (0: none)
    long_prefill_token_threshold: int = Field(0, ge=0)
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    prefix_caching_hash_algo: str = "sha256"
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.92
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_rank: int = 0
    seed: int = 0
    kv_transfer_config: KVTransferConfig | None = None
    kv_events_config: KVEventsConfig | None = None
    speculative_config: SpeculativeConfig | None = None
    lora: LoraConfig | None = None  # None: --enable-lora not given
    api_key: str | None = None
    enable_server_load_tracking: bool = False
    enable_request_id_headers: bool = False
    enable_sleep_mode: bool = False
    shutdown_timeout_s: int = Field(0, ge=0)  # --shutdown-timeout: 0 aborts, N drains
    # emulator options
    timing_profile: str | None = None
    speedup: float = Field(1.0, gt=0)
    kv_events_bind_host: str | None = None
    kv_handshake_timeout_s: float = Field(5.0, gt=0)
    use_nixl: bool = True
    # acceptance rate of a drafted token for requests that do not give one (vllm_xargs)
    spec_acceptance_rate: float = Field(0.7, ge=0, le=1)
    batching: Literal["continuous", "static"] = "continuous"
    static_batch_wait_s: float = Field(0.1, ge=0)
    # engines given the same lock file share one emulated GPU's compute (gpu_share.SharedGPU)
    shared_gpu: str | None = None
    faults: Faults = Field(default_factory=Faults)

    @property
    def served_model_name(self) -> str:
        return self.served_model_names[0] if self.served_model_names else self.model

    @property
    def model_dir(self) -> Path | None:
        path = Path(self.model)
        return path if path.is_dir() else None

    @property
    def tokenizer_dir(self) -> Path | None:
        """Where tokenizer.json is looked for: --tokenizer if it is a directory, else the model's."""
        if self.tokenizer and Path(self.tokenizer).is_dir():
            return Path(self.tokenizer)
        return self.model_dir

    def model_config_json(self) -> dict[str, Any]:
        """The model's config.json when the model is a local directory."""
        directory = self.model_dir
        if directory is not None and (directory / "config.json").is_file():
            data = json.loads((directory / "config.json").read_text())
            return data if isinstance(data, dict) else {}
        return {}

    def resolved_max_model_len(self) -> int:
        if self.max_model_len:
            return self.max_model_len
        return int(self.model_config_json().get("max_position_embeddings", 131072))

    @property
    def kv_role(self) -> str | None:
        return self.kv_transfer_config.kv_role if self.kv_transfer_config else None
