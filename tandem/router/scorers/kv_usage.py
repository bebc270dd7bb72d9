"""KV-usage scorer: engines with free KV-cache memory score higher (fewer preemptions ahead)."""

from __future__ import annotations


def kv_usage_score(kv_usage: float) -> float:
    """kv = 1 - clamp(vllm:kv_cache_usage_perc, 0, 1)

    Example: an engine at 85% KV usage scores 0.15; an empty one 1.0.
    """
    return 1.0 - min(max(kv_usage, 0.0), 1.0)
