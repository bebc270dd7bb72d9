"""Prefix-hit scorer: the fraction of the request's full blocks already cached on the engine."""

from __future__ import annotations


def prefix_score(hit_blocks: int, total_blocks: int) -> float:
    """prefix = hit_blocks / total_blocks   (0 when the prompt has no full block).

    `hit_blocks` is the number of leading blocks of the prompt the engine holds (exact index from
    KV events, or approximate index from routing history). Example: 6 of 8 blocks cached -> 0.75.
    """
    if total_blocks <= 0:
        return 0.0
    return min(hit_blocks, total_blocks) / total_blocks
