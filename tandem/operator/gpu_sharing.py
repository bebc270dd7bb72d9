"""Engines on shared GPUs (split memory): the GPU resource they ask for and their memory share."""

from __future__ import annotations

from tandem.operator.api_engine import EngineSpec, PoolSpec

WHOLE_GPU = "nvidia.com/gpu"


def gpu_resource(engine: EngineSpec) -> str:
    """The extended resource an engine's GPUs are counted in: a whole GPU, or a slice of one."""
    sharing = engine.gpu_sharing
    return sharing.resource_name if sharing is not None and sharing.enabled else WHOLE_GPU


def gpu_memory_utilization(engine: EngineSpec, pool: PoolSpec) -> float:
    """--gpu-memory-utilization: the pool's own value, else the sharing's memory fraction when
    sharing is on, else the engine's."""
    if pool.gpu_memory_utilization is not None:
        return pool.gpu_memory_utilization
    sharing = engine.gpu_sharing
    if sharing is not None and sharing.enabled:
        return sharing.memory_fraction
    return engine.gpu_memory_utilization
