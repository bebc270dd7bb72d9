"""What the router knows of one engine for prediction: its learned costs and its own open work.

`queued_tokens` (and `queued_pairs`, their attention pairs) are the uncached prompt tokens of this
router's requests sent to the engine whose prefill has not finished (first byte for a local route,
the prefill answer for P/D);
`streams`, `stream_tokens` and `stream_output_tokens` describe this router's requests decoding
there (count, prompt plus half their predicted output, and predicted output);
`tpot_targets` counts those streams per TPOT target, so the tightest is known in O(classes).
`prefill_share` is the part of the engine's time that the prefills this router placed there take,
an exponentially decayed sum of their predicted compute seconds s_i over a window w:

    share(t) = Σ s_i · exp(-(t - t_i) / w) / w

(a steady rate of r prefill seconds per second gives share → r). On a decode engine it is the
interference its running streams suffer: a step of δ seconds becomes δ / (1 - share) per token.
The squared log errors are exponentially weighted means of ln(observed / predicted)², the sigma of
`slo.meet_probability`.
"""

from __future__ import annotations

import math

from tandem.router.predict.cost_model import EngineCosts

ERROR_WEIGHT = 0.05  # per observation: a window of about 20 requests
INITIAL_SQUARED_LOG_ERROR = 0.25  # sigma = 0.5 until the engine has been observed
MIN_SIGMA = 0.05


class EngineLedger:
    __slots__ = (
        "_share_at",
        "_share_sum",
        "costs",
        "queued_pairs",
        "queued_tokens",
        "share_window_s",
        "stream_output_tokens",
        "stream_tokens",
        "streams",
        "tpot_squared_log_error",
        "tpot_targets",
        "ttft_squared_log_error",
    )

    def __init__(self, costs: EngineCosts, share_window_s: float) -> None:
        self.costs = costs
        self.share_window_s = share_window_s
        self._share_sum = 0.0  # Σ s_i · exp(-(t - t_i) / w) at time _share_at
        self._share_at = 0.0
        self.queued_tokens = 0.0
        self.queued_pairs = 0.0
        self.streams = 0
        self.stream_tokens = 0.0
        self.stream_output_tokens = 0.0
        self.tpot_targets: dict[float, int] = {}
        self.ttft_squared_log_error = INITIAL_SQUARED_LOG_ERROR
        self.tpot_squared_log_error = INITIAL_SQUARED_LOG_ERROR

    def prefill_share(self, now: float) -> float:
        """share(now) (module docstring)."""
        if self._share_sum <= 0.0:
            return 0.0
        window = self.share_window_s
        return self._share_sum * math.exp((self._share_at - now) / window) / window

    def add_prefill(self, now: float, compute_s: float) -> None:
        """A prefill of `compute_s` predicted seconds placed on the engine at `now`."""
        window = self.share_window_s
        self._share_sum = self.prefill_share(now) * window + compute_s
        self._share_at = now

    def tightest_tpot_s(self) -> float | None:
        return min(self.tpot_targets) if self.tpot_targets else None

    def ttft_sigma(self) -> float:
        return max(math.sqrt(self.ttft_squared_log_error), MIN_SIGMA)

    def tpot_sigma(self) -> float:
        return max(math.sqrt(self.tpot_squared_log_error), MIN_SIGMA)

    def add_stream(self, tokens: float, output_tokens: float, tpot_target_s: float) -> None:
        self.streams += 1
        self.stream_tokens += tokens
        self.stream_output_tokens += output_tokens
        self.tpot_targets[tpot_target_s] = self.tpot_targets.get(tpot_target_s, 0) + 1

    def end_stream(self, tokens: float, output_tokens: float, tpot_target_s: float) -> None:
        self.streams -= 1
        self.stream_tokens -= tokens
        self.stream_output_tokens -= output_tokens
        left = self.tpot_targets[tpot_target_s] - 1
        if left:
            self.tpot_targets[tpot_target_s] = left
        else:
            del self.tpot_targets[tpot_target_s]
        if not self.streams:  # no drift of float sums across an idle moment
            self.stream_tokens = self.stream_output_tokens = 0.0
