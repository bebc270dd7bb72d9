"""The LoRA adapters a ServingCluster serves, and each pool's adapter slots."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tandem.operator.api_model import CrossFieldRule, SpecModel

LoraRank = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]
"""The ranks vLLM accepts for `--max-lora-rank`."""


class LoraAdapter(SpecModel):
    """A LoRA adapter of the model, served under its own name."""

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][-A-Za-z0-9_.]*$")
    """The model name clients send to reach the adapter."""
    source: str = Field(
        min_length=1, max_length=1024, pattern=r"^(/.+|[-A-Za-z0-9_.]+/[-A-Za-z0-9_.]+)$"
    )
    """A Hugging Face repository id (`org/adapter`), downloaded by the engines like the model, or
    an absolute path inside the engine container (an adapter on the model volume:
    `<model.cache.mountPath>/...`)."""


class LoraCapacity(SpecModel):
    """LoRA adapter slots of a pool's engines; unset fields take the cluster's `lora` settings."""

    max_loras: int | None = Field(None, ge=1, alias="maxLoras")
    """Adapters one batch may use at once (vLLM `--max-loras`, GPU slots)."""
    max_lora_rank: LoraRank | None = Field(None, alias="maxLoraRank")
    """The largest adapter rank served (vLLM `--max-lora-rank`)."""
    max_cpu_loras: int | None = Field(None, ge=1, alias="maxCpuLoras")
    """Adapters kept in CPU memory, ready to swap in (vLLM `--max-cpu-loras`, >= maxLoras)."""


class LoraSpec(SpecModel):
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
