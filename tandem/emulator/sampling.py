"""What `logit_bias` and `min_tokens` change in the emulator's token choice.

The emulator has no logits: its tokens come from a deterministic stream over the output
vocabulary. vLLM adds each bias (clamped to [-100, 100]) to its token's logit, which at the bounds
decides the choice in practice, so the emulator honours the bounds and nothing in between:

    a bias of +100 selects its token (the lowest such id, as argmax breaks ties)
    a bias of -100 bans its token
    while fewer than `min_tokens` tokens were produced, the stop tokens (the request's
    stop_token_ids and EOS unless ignore_eos) are banned too, as vLLM's min-tokens logits
    processor masks them

A banned token the stream chose is replaced by the first allowed token of the output vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# vLLM clamps every bias to this bound; at it the biased token wins (or never wins) in practice
DECISIVE_BIAS = 100.0


class TokenRule:
    """The bias bounds and the min-tokens mask of one request (module docstring)."""

    __slots__ = ("_banned", "_banned_while_short", "forced", "min_tokens")

    def __init__(
        self, logit_bias: Mapping[int, float], stop_token_ids: Sequence[int], min_tokens: int
    ) -> None:
        forced = [t for t, bias in logit_bias.items() if bias >= DECISIVE_BIAS]
        self.forced = min(forced) if forced else None
        self._banned = frozenset(t for t, bias in logit_bias.items() if bias <= -DECISIVE_BIAS)
        self._banned_while_short = self._banned | frozenset(stop_token_ids)
        self.min_tokens = min_tokens

    @staticmethod
    def of(
        logit_bias: Mapping[int, float], stop_token_ids: Sequence[int], min_tokens: int
    ) -> TokenRule | None:
        """The rule, or None when it would change no choice (the common case, kept off the
        scheduler's per-token path)."""
        decisive = any(abs(bias) >= DECISIVE_BIAS for bias in logit_bias.values())
        if not decisive and not (min_tokens and stop_token_ids):
            return None
        return TokenRule(logit_bias, stop_token_ids, min_tokens)

    def choose(self, streamed: int, produced: int, vocabulary: Sequence[int]) -> int:
        """The token to emit instead of `streamed`, the stream's choice, after `produced` output
        tokens."""
        banned = self._banned_while_short if produced < self.min_tokens else self._banned
        if self.forced is not None and self.forced not in banned:
            return self.forced
        if streamed not in banned:
            return streamed
        return next((t for t in vocabulary if t not in banned), streamed)
