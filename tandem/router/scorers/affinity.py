"""Affinity scorer: a stable preference of each prefix for some engines, the same on every replica."""

from __future__ import annotations

from tandem.router.rendezvous import weight


def affinity_score(first_block_key: int, engine_id: str) -> float:
    """affinity = weight(first block key of the request, engine id)   (rendezvous hashing, in [0, 1))

    Where no engine holds a prefix yet, the other scorers see only load and cache sizes, which
    differ between router replicas (each counts its own in-flight requests); this term does not, so
    replicas that meet a new prefix at the same moment lean towards the same engine and it is
    prefilled once. Every request sharing the first block shares the preference. Example: a prefix
    whose first block weighs 0.91 on engine a and 0.12 on b adds 0.79 * affinityWeight to a's score.
    """
    return weight(first_block_key, engine_id)
