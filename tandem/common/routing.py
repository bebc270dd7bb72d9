"""The router's policy: scoring weights, the prefill/decode split, admission and timeouts.

One definition for both sides: the router reads these from its config file (`RouterConfig`), and a
ServingCluster's `spec.router` carries the very same models, so the CRD schema, docs/api.md and
the rendered router config cannot drift apart. Field docstrings are the CRD's descriptions.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tandem.common.settings import SettingsModel


class ScoringConfig(SettingsModel):
    """Router scorer weights: an endpoint's score is the weighted sum of its scorer values."""

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
