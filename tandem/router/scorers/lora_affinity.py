"""LoRA affinity scorer: an engine already running the request's adapter, then one with a free
adapter slot, then one where the request would wait for a slot."""

from __future__ import annotations

from collections.abc import Collection

ACTIVE = 1.0
ROOM = 0.5
WAIT = 0.0


def lora_affinity_score(adapter: str, active: Collection[str], max_loras: int | None) -> float:
    """lora_affinity = 1    the adapter is active on the engine (`active`: running there)
                     = 0.5  it is not, but fewer than `max_loras` adapters are active: it is
                            loaded into a free slot at once
                     = 0    every slot holds another adapter: the request waits for one
    `max_loras` None (the engine reports no LoRA slots) scores 0.5 everywhere, so the term then
    ranks nothing. vLLM schedules a request whose adapter is not among the running batch's only
    while the batch uses fewer than --max-loras adapters; on real vLLM 0.32 with --max-loras 1,
    a request for a second adapter waited for the first adapter's request to finish (2.6 s against
    0.9 s, docs/protocols.md). Example: slots 2, active {a, b}: a -> 1, c -> 0; active {a}: c -> 0.5.
    """
    if adapter in active:
        return ACTIVE
    if max_loras is None or len(active) < max_loras:
        return ROOM
    return WAIT
