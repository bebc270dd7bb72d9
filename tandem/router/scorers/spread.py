"""Spread scorer: engines holding fewer cached blocks score higher, so new prefixes spread out."""

from __future__ import annotations


def spread_score(cached_blocks: int, max_cached_blocks: int) -> float:
    """spread = 1 - cached_blocks / (max_cached_blocks + 1)

    `cached_blocks` is how many blocks the prefix index holds for the engine, `max_cached_blocks`
    the largest count among the candidates. Without it a burst of new prefixes lands on whichever
    engine is idle at that instant, and those prefixes stay together for their whole life; with it a
    new prefix goes where cache memory is least claimed (SGLang's cache-aware policy does the same
    with its smallest radix tree). Example: 100, 400, 0 blocks -> 0.75, 0.0025, 1.0.
    """
    return 1.0 - max(cached_blocks, 0) / (max(max_cached_blocks, 0) + 1.0)
