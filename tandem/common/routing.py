"""The router's policy: scoring weights, the prefill/decode split, admission and timeouts.

One definition for both sides: the router reads these from its config file (`RouterConfig`), and a
ServingCluster's `spec.router` carries the very same models, so the CRD schema, docs/api.md and
the rendered router config cannot drift apart. Field docstrings are the CRD's descriptions.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tandem.common.settings import SettingsModel

# The engines' --max-num-batched-tokens unless a pool sets its own (PoolSpec.maxNumBatchedTokens).
DEFAULT_STEP_TOKENS = 8192


class SloClass(SettingsModel):
    """The TTFT and TPOT targets of requests from a priority level up (the `predictive` policy)."""

    min_priority: int = Field(-100, ge=-100, le=100, alias="minPriority")
    """The class covers priorities from this value up to the next class's `minPriority`."""
    ttft_ms: float = Field(2000.0, gt=0, alias="ttftMs")
    """Time to first token a request of the class should meet."""
    tpot_ms: float = Field(100.0, gt=0, alias="tpotMs")
    """Time per output token (mean gap after the first) a request of the class should meet."""
    sheddable: bool = False
    """A request of the class is refused (429 with Retry-After) when no placement is predicted
    to meet its targets, instead of slowing every other request."""


class PredictiveConfig(SettingsModel):
    """The `predictive` policy: SLO classes, and the seeds of the cost models it learns online per
    engine (the H200 Llama-3.1-8B timing profile's figures unless set)."""

    slo_classes: list[SloClass] = Field(
        default_factory=lambda: [SloClass()], alias="sloClasses", min_length=1
    )
    """Targets per priority level; trusted clients may set their own (`x-slo-ttft-ms`,
    `x-slo-tpot-ms`)."""
    prefill_base_ms: float = Field(6.3, ge=0, alias="prefillBaseMs")
    """Seed: fixed cost of a prefill request."""
    prefill_ms_per_kilo_token: float = Field(22.2, gt=0, alias="prefillMsPerKiloToken")
    """Seed: prefill time per 1,000 tokens (queued ahead or own)."""
    prefill_ms_per_mega_pair: float = Field(1.9, ge=0, alias="prefillMsPerMegaPair")
    """Seed: prefill time per million attention pairs (a prompt's quadratic part: u uncached
    tokens after c cached ones make u · (c + u / 2) pairs)."""
    handoff_base_ms: float = Field(7.0, ge=0, alias="handoffBaseMs")
    """Seed: fixed cost of a KV handoff (the pull's latency and the decode engine's first step)."""
    handoff_ms_per_kilo_token: float = Field(2.9, ge=0, alias="handoffMsPerKiloToken")
    """Seed: KV pull time per 1,000 prompt tokens."""
    step_base_ms: float = Field(6.3, gt=0, alias="stepBaseMs")
    """Seed: fixed cost of a decode step."""
    step_ms_per_stream: float = Field(0.022, ge=0, alias="stepMsPerStream")
    """Seed: decode step time per stream in the batch."""
    step_ms_per_kilo_context: float = Field(0.028, ge=0, alias="stepMsPerKiloContext")
    """Seed: decode step time per 1,000 tokens of context in the batch."""
    prefill_chunk_tokens: int | None = Field(None, ge=1, alias="prefillChunkTokens")
    """The decode (and colocated) engines' max_num_batched_tokens: the most prompt tokens one
    step computes. Unset: the decode pool's budget in a ServingCluster, 8192 elsewhere."""
    prefill_pool_chunk_tokens: int | None = Field(None, ge=1, alias="prefillPoolChunkTokens")
    """The same for the engines that only prefill. Unset: the prefill pool's budget in a
    ServingCluster, `prefillChunkTokens` elsewhere."""
    forget: float = Field(0.98, gt=0.5, le=1, alias="forgetFactor")
    """Weight of a cost sample after each newer one (an effective window of 1 / (1 - forget))."""
    interference_budget: float = Field(0.3, ge=0, le=0.9, alias="interferenceBudget")
    """The part of a decode engine's time that the prefills placed on it may take (P/D), beyond
    which a request is prefilled in the prefill pool unless only local meets its TTFT target:
    a step of δ seconds becomes δ / (1 - share) per output token."""
    interference_window_seconds: float = Field(1.0, gt=0, alias="interferenceWindowSeconds")
    """The window over which an engine's prefill share is measured."""
    reprobe_seconds: float = Field(10.0, ge=0, alias="reprobeSeconds")
    """An engine idle in the router's figures and sent no request for this long gets the next
    one it can take, whatever its prediction (its models learn only from work placed on it);
    0 turns re-probing off."""
    meet_probability: float = Field(0.8, gt=0, lt=1, alias="meetProbability")
    """A placement counts as meeting a target when it is predicted to with at least this
    probability; a sheddable request with no such placement is refused."""

    def chunk_tokens(self, prefill_only: bool) -> int:
        """C, the step budget the cost models assume on an engine: `prefillPoolChunkTokens` on
        one that only prefills when set, else `prefillChunkTokens`, else vLLM's budget as the
        operator renders it by default."""
        if prefill_only and self.prefill_pool_chunk_tokens is not None:
            return self.prefill_pool_chunk_tokens
        return self.prefill_chunk_tokens or DEFAULT_STEP_TOKENS


class ScoringConfig(SettingsModel):
    """Router placement: the weighted sum of scorer values (`weighted`), or predicted TTFT, TPOT
    and output length against SLO targets (`predictive`)."""

    policy: Literal["weighted", "predictive"] = "weighted"
    """weighted: the scorers' weighted sum and the uncached-length rule for P/D; predictive: the
    placement most likely to meet the request's SLO targets, then the cheapest, and P/D only
    where it is predicted to help (docs/router.md, "Predictive placement")."""
    predictive: PredictiveConfig = Field(default_factory=PredictiveConfig)
    """Settings of the `predictive` policy."""
    prefix_weight: float = Field(3.0, ge=0, alias="prefixWeight")
    """Weight of the prefix-cache hit fraction."""
    queue_weight: float = Field(2.0, ge=0, alias="queueWeight")
    """Weight of the (inverted) queue depth."""
    kv_usage_weight: float = Field(1.0, ge=0, alias="kvUsageWeight")
    """Weight of the (inverted) KV-cache usage."""
    spread_weight: float = Field(0.5, ge=0, alias="spreadWeight")
    """Weight that pulls new prefixes towards engines whose cache the index knows least about."""
    affinity_weight: float = Field(1.0, ge=0, alias="affinityWeight")
    """Weight of the rendezvous-hash preference of the request's first block for an engine, so
    router replicas that meet a new prefix at once place it on the same engine."""
    lora_affinity_weight: float = Field(2.0, ge=0, alias="loraAffinityWeight")
    """Weight of the LoRA adapter's placement for a request to an adapter: running on the engine
    (1) beats a free adapter slot there (0.5) beats waiting for a slot (0)."""
    running_weight: float = Field(0.25, ge=0, le=1, alias="runningWeight")
    """How much a decoding request counts in an engine's load, relative to a queued one."""
    load_bound_factor: float = Field(1.5, ge=1, alias="loadBoundFactor")
    """An endpoint whose load exceeds this multiple of the pool's mean load plus `loadBoundSlack`
    is skipped, so a hot prefix cannot pile every request onto one pod."""
    session_load_bound_factor: float | None = Field(None, ge=1, alias="sessionLoadBoundFactor")
    """The load bound for requests of a session (`loadBoundFactor` or more). Unset, a session stays
    on its engine while the engine is healthy: a session that moves prefills its whole
    conversation again, and one session adds at most one request at a time to its engine."""
    load_bound_slack: float = Field(1.0, ge=0, alias="loadBoundSlack")
    """Requests added to the load bound: a lightly loaded pool should not pay a prefix miss to
    move one request."""


class DisaggregationConfig(SettingsModel):
    """When a request is prefilled on a prefill pod first (P/D) or goes straight to a decode pod."""

    mode: Literal["auto", "always", "never"] = "auto"
    """auto: by uncached prompt length; always: every request; never: decode pods only (no prefill
    pool is rendered)."""
    min_uncached_tokens: int = Field(256, ge=0, alias="minUncachedTokens")
    """In auto mode, prompts with fewer uncached tokens go straight to a decode pod."""
    max_prefill_queue: int = Field(32, ge=1, alias="maxPrefillQueue")
    """In auto mode, when every prefill pod has at least this load (queued requests plus a
    fraction of running ones), decode pods prefill locally instead of waiting."""


class AdmissionConfig(SettingsModel):
    """The router's bounded queue with priorities; a full queue answers 429 with Retry-After."""

    max_queue: int = Field(512, ge=1, alias="maxQueue")
    """Requests that may wait for a slot."""
    max_in_flight: int = Field(1024, ge=1, alias="maxInFlight")
    """Requests in flight across all engines before new ones wait."""
    priority_header: str = Field("x-priority", alias="priorityHeader", min_length=1)
    """Request header carrying an integer priority from -100 to 100: lower values are served
    first (as vLLM's `priority`), 0 when absent."""
    session_header: str = Field("x-session-id", alias="sessionHeader", min_length=1)
    """Request header carrying a session id: a session goes to the healthy decode engine with the
    highest rendezvous-hash weight for it within the session load bound
    (`scoring.sessionLoadBoundFactor`), the same on every router replica."""
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, alias="maxBodyBytes")
    """Largest accepted request body."""
    max_queue_per_priority: int | None = Field(None, ge=1, alias="maxQueuePerPriority")
    """Requests that may wait at one priority level; unset = `maxQueue`."""
    engine_wait_s: float = Field(0.0, ge=0, le=3600, alias="engineWaitSeconds")
    """While no decode engine is ready (a pool scaled to zero and waking, engines restarting), a
    request holds its admission slot and waits up to this long for one, then gets 503 with
    Retry-After; 0 answers 503 at once. Set from `autoscaling.scaleToZero.wakeTimeoutSeconds`
    when scale-to-zero is on."""


class TimeoutConfig(SettingsModel):
    """Per-request limits of the router, in seconds."""

    connect_s: float = Field(2.0, gt=0, alias="connectSeconds")
    """Connecting to an engine."""
    prefill_s: float = Field(120.0, gt=0, alias="prefillSeconds")
    """A whole prefill request."""
    decode_idle_s: float = Field(60.0, gt=0, alias="decodeIdleSeconds")
    """Longest silence between two chunks of a decode stream."""
    request_s: float = Field(600.0, gt=0, alias="requestSeconds")
    """A whole request, admission queue included."""
    shutdown_s: float = Field(20.0, ge=0, alias="shutdownSeconds")
    """On SIGTERM the router stops listening and closes idle connections; requests being served
    get this long to finish (the rendered router pod: a 5 s preStop, then this, within its 30 s
    grace period)."""
