"""Queue scorer: engines with fewer queued requests score higher, relative to the busiest candidate."""

from __future__ import annotations


def queue_score(load: float, max_load: float) -> float:
    """queue = 1 - load / (max_load + 1)

    `load` = the engine's load (`Engine.load`): max(router requests before their first byte,
    engine `vllm:num_requests_waiting`) + runningWeight * max(router requests past it, engine
    `vllm:num_requests_running`);
    `max_load` is the largest load among the candidates. An idle engine scores 1; the busiest
    scores 1/(max_load+1). Example: loads 0, 3, 7 -> 1.0, 0.625, 0.125.
    """
    return 1.0 - max(load, 0.0) / (max(max_load, 0.0) + 1.0)
