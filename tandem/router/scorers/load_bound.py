"""Load bound: engines far busier than the pool's mean are not candidates, whatever their prefix hit."""

from __future__ import annotations

import math
from collections.abc import Sequence


def within_load_bound(loads: Sequence[float], factor: float, slack: float = 1.0) -> list[bool]:
    """keep_i = load_i <= factor * mean(load) + slack

    Bounded-load consistent hashing's rule: a hot prefix may load its engine up to `factor` times
    the mean (+ `slack` requests, so a lightly loaded pool does not pay a cache miss to move one
    queued request), after which requests spill to other engines and those build the prefix too.
    The least-loaded engine always passes. Example: loads 9, 1, 2 with factor 1.5 and slack 1 ->
    mean 4, bound 7 -> [False, True, True].
    """
    if not loads:
        return []
    if math.isinf(factor):  # no bound (a session's default)
        return [True] * len(loads)
    bound = factor * (sum(loads) / len(loads)) + slack
    return [d <= bound for d in loads]
