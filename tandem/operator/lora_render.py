"""vLLM's LoRA flags and environment of one pool, from the ServingCluster's `lora` settings."""

from __future__ import annotations

from typing import Any

from tandem.operator.api_engine import PoolSpec
from tandem.operator.api_lora import LoraSpec

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def lora_args(lora: LoraSpec | None, pool: PoolSpec) -> list[str]:
    """--enable-lora and the slots (the pool's `lora` over the cluster's), then --lora-modules
    name=source per adapter; nothing without `lora`. Both pools get the same adapters, so a
    request for one can be prefilled on one pool and decoded on the other."""
    if lora is None:
        return []
    capacity = pool.lora
    max_loras = capacity.max_loras if capacity and capacity.max_loras else lora.max_loras
    rank = capacity.max_lora_rank if capacity and capacity.max_lora_rank else lora.max_lora_rank
    cpu = capacity.max_cpu_loras if capacity and capacity.max_cpu_loras else lora.max_cpu_loras
    args = ["--enable-lora", "--max-loras", str(max_loras), "--max-lora-rank", str(rank)]
    if cpu is not None:
        args += ["--max-cpu-loras", str(max(cpu, max_loras))]
    if lora.adapters:
        args += ["--lora-modules", *(f"{a.name}={a.source}" for a in lora.adapters)]
    return args


def lora_env(lora: LoraSpec | None) -> list[dict[str, Any]]:
    """VLLM_ALLOW_RUNTIME_LORA_UPDATING=True when runtime updates are on (vLLM then serves
    /v1/load_lora_adapter and /v1/unload_lora_adapter)."""
    if lora is None or not lora.runtime_updates:
        return []
    return [{"name": RUNTIME_UPDATES_ENV, "value": "True"}]
