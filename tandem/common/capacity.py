"""What one engine can serve: prefill and decode tokens per second from its step-time coefficients.

Both the operator's planner (which must not import the emulator) and the emulator-based replay
read these formulas; the emulator's timing profile (tandem/emulator/profile.py) supplies the
coefficients, and `H200_LLAMA_8B` copies those of its shipped H200 profile (a test keeps the two
equal).
"""

from __future__ import annotations

import math

from pydantic import ConfigDict, Field

from tandem.common.settings import SettingsModel


class StepCost(SettingsModel):
    """Seconds of one engine step over a batch (the emulator's StepTiming formula):

    t = base_s + per_token_s * scheduled tokens
        + per_attention_pair_s * sum over prefill chunks of chunk_len * (cached_ctx + chunk_len / 2)
        + per_decode_seq_s * decode seqs + per_context_token_s * context tokens of decode seqs
        + per_prefill_token_s * prefill chunk tokens + per_prefill_seq_s * prefill chunks
    """

    model_config = ConfigDict(frozen=True)

    base_s: float = Field(0.00633, ge=0, alias="baseSeconds")
    """Fixed cost of a step."""
    per_token_s: float = Field(2.219e-05, ge=0, alias="perTokenSeconds")
    """Cost of each scheduled token (prompt chunk tokens, one per decode sequence)."""
    per_attention_pair_s: float = Field(1.914e-09, ge=0, alias="perAttentionPairSeconds")
    """Cost of each (query token, context token) pair of a prefill chunk."""
    per_decode_seq_s: float = Field(0.0, ge=0, alias="perDecodeSeqSeconds")
    """Cost of each decoding sequence."""
    per_context_token_s: float = Field(2.769e-08, ge=0, alias="perContextTokenSeconds")
    """Cost of each context token a decoding sequence reads."""
    per_prefill_token_s: float = Field(0.0, ge=0, alias="perPrefillTokenSeconds")
    """Extra cost of each prompt token (on top of perTokenSeconds)."""
    per_prefill_seq_s: float = Field(0.0, ge=0, alias="perPrefillSeqSeconds")
    """Cost of each prompt chunk in the step."""

    def scaled(self, factor: float) -> StepCost:
        """Every coefficient times `factor` (a measured engine `factor` times slower than seeded)."""
        return StepCost(
            base_s=self.base_s * factor,
            per_token_s=self.per_token_s * factor,
            per_attention_pair_s=self.per_attention_pair_s * factor,
            per_decode_seq_s=self.per_decode_seq_s * factor,
            per_context_token_s=self.per_context_token_s * factor,
            per_prefill_token_s=self.per_prefill_token_s * factor,
            per_prefill_seq_s=self.per_prefill_seq_s * factor,
        )


# The H200 profile's step (tandem/emulator/profiles/h200-llama-3.1-8b.yaml) and its KV capacity in
# tokens (51000 blocks of 16 at gpu-memory-utilization 0.9, max-num-batched-tokens 8192).
H200_LLAMA_8B = StepCost()
H200_LLAMA_8B_KV_TOKENS = 51000 * 16


def prefill_step_s(cost: StepCost, batch_tokens: float, prompt_tokens: float) -> float:
    """One prefill step of `batch_tokens` tokens from prompts of `prompt_tokens` uncached tokens:

    t = base_s + (per_token_s + per_prefill_token_s) * b + per_attention_pair_s * b * L / 2
        + per_prefill_seq_s * max(1, b / L)
    (b / L whole prompts of L tokens each attend over L^2 / 2 pairs; a prompt chunked over several
    steps has the same pairs in total).
    """
    return (
        cost.base_s
        + (cost.per_token_s + cost.per_prefill_token_s) * batch_tokens
        + cost.per_attention_pair_s * batch_tokens * prompt_tokens / 2
        + cost.per_prefill_seq_s * max(1.0, batch_tokens / max(prompt_tokens, 1.0))
    )


def prefill_steps_per_prompt(prompt_tokens: float, max_batched_tokens: int) -> float:
    """Steps one prompt of L tokens spans when every step is full: 1 + L / b (it needs L / b
    steps of b tokens, and straddles a step boundary with probability L / b)."""
    return 1 + prompt_tokens / max_batched_tokens


def prefill_wait_s(utilization: float, step_s: float, variability: float) -> float:
    """Mean queueing before a prompt's first step (Kingman's G/D/1 approximation):
    W = variability * rho / (1 - rho) * step / 2, where variability is the squared coefficient
    of variation of the arrivals (1 for Poisson; a bursty trace has far more)."""
    rho = min(max(utilization, 0.0), 0.999)
    return variability * rho / (1 - rho) * step_s / 2


def prefill_utilization_at_ttft(
    service_s: float, step_s: float, target_ttft_s: float, variability: float, tail: float
) -> float:
    """The highest utilisation rho at which a prefill engine keeps TTFT under its target.

    TTFT = service + tail * W (a quantile of a roughly exponential wait is `tail` times its mean:
    ln(1 / (1 - q)), 2.3 for p90), with W from prefill_wait_s. Solving TTFT = target:
    rho = 2 s / (2 s + tail * variability * step), slack s = target - service; 0 when even an
    empty engine misses the target.
    """
    slack = target_ttft_s - service_s
    if slack <= 0:
        return 0.0
    return 2 * slack / (2 * slack + tail * variability * step_s)


def prefill_capacity(
    cost: StepCost,
    prompt_tokens: float,
    max_batched_tokens: int,
    target_ttft_s: float,
    variability: float = 1.0,
    tail: float = math.log(10),
) -> tuple[float, float]:
    """(tokens/s of one saturated prefill engine, utilisation rho it may run at for the TTFT target).

    Saturated, every step is full: throughput = b / prefill_step_s(b, L), b = max_batched_tokens.
    One prompt's service is prefill_steps_per_prompt full steps; rho is
    prefill_utilization_at_ttft of that service.
    """
    length = max(prompt_tokens, 1.0)
    step = prefill_step_s(cost, max_batched_tokens, length)
    service = prefill_steps_per_prompt(length, max_batched_tokens) * step
    rho = prefill_utilization_at_ttft(service, step, target_ttft_s, variability, tail)
    return max_batched_tokens / step, rho


def decode_step_s(cost: StepCost, seqs: float, context_tokens: float) -> float:
    """One decode step of `seqs` sequences of `context_tokens` each:
    t = base_s + (per_token_s + per_decode_seq_s + per_context_token_s * ctx) * seqs."""
    return cost.base_s + (
        cost.per_token_s + cost.per_decode_seq_s + cost.per_context_token_s * context_tokens
    ) * max(seqs, 0.0)


def decode_capacity(
    cost: StepCost,
    context_tokens: float,
    target_itl_s: float,
    kv_tokens: float,
    max_num_seqs: int,
) -> tuple[float, float]:
    """(output tokens/s, batch) of one decode engine at its ITL target, within its KV cache.

    batch = min(B_itl, B_kv, max_num_seqs), at least 1, where
      B_itl = (target_itl - base_s) / (per_token_s + per_decode_seq_s + per_context_token_s * ctx)
              (the largest batch whose step stays within the ITL target),
      B_kv  = kv_tokens / ctx (sequences of ctx tokens that fit the usable KV cache);
    tokens/s = batch / decode_step_s(batch, ctx).
    """
    ctx = max(context_tokens, 1.0)
    per_seq = cost.per_token_s + cost.per_decode_seq_s + cost.per_context_token_s * ctx
    by_itl = (target_itl_s - cost.base_s) / per_seq if per_seq > 0 else float(max_num_seqs)
    batch = max(1.0, min(by_itl, kv_tokens / ctx, float(max_num_seqs)))
    return batch / decode_step_s(cost, batch, ctx), batch
