"""Tenants: who sent a request (`TenantDirectory.identify`), their weights, and their token buckets.

A token bucket of rate r and capacity b holds level(t) = min(b, level(t0) + r · (t - t0)); a
request charged c = prompt tokens + max output tokens passes when level ≥ min(c, b), which takes
c (the level may go negative: a request larger than the bucket passes on a full one and leaves
debt), and otherwise waits

    retry_after = ceil((min(c, b) - level) / r)  seconds (at least 1).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from tandem.common.tenancy import TenancyConfig, TokenRate

ANONYMOUS = "anonymous"
OTHER_TENANTS = "other"
_MAX_TENANT_CHARS = 64
# Tenants named by a trusted header or by an unknown key are unbounded; past this many distinct
# ones beyond the configured tenants, metrics count them together under OTHER_TENANTS.
MAX_METRIC_TENANTS = 100


class TokenBucket:
    def __init__(self, rate: TokenRate, now: float):
        self.rate = rate.tokens_per_second
        self.capacity = rate.capacity
        self.level = self.capacity
        self._stamp = now

    def take(self, charge: float, now: float) -> int:
        """0 when `charge` passes (and is taken); otherwise the seconds until it would."""
        self.level = min(self.capacity, self.level + (now - self._stamp) * self.rate)
        self._stamp = now
        need = min(charge, self.capacity)
        if self.level >= need:
            self.level -= charge
            return 0
        return max(1, math.ceil((need - self.level) / self.rate))


def output_tokens_asked(body: Mapping[str, Any], assumed: int) -> int:
    """max_completion_tokens or max_tokens times n, else `assumed` times n."""
    asked = body.get("max_completion_tokens") or body.get("max_tokens")
    n = body.get("n") or 1
    per_choice = asked if isinstance(asked, int) else assumed
    return per_choice * (n if isinstance(n, int) else 1)


class TenantDirectory:
    """The tenants of one router: identification, weights and (per tenant) a token bucket."""

    def __init__(self, config: TenancyConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.enabled = config.enabled
        self.header = config.header.lower()
        self._by_digest = {
            digest.lower(): tenant.name for tenant in config.tenants for digest in tenant.key_sha256
        }
        self._specs = {tenant.name: tenant for tenant in config.tenants}
        self._buckets: dict[str, TokenBucket] = {}
        self._clock = clock
        self._labelled: set[str] = set()

    def metric_label(self, tenant: str) -> str:
        """The tenant's value of the `tenant` metric label: its name for a configured tenant,
        the anonymous tenant and the first MAX_METRIC_TENANTS others seen, else OTHER_TENANTS
        (a bound on the series a client can create)."""
        if tenant in self._specs or tenant == ANONYMOUS or tenant in self._labelled:
            return tenant
        if len(self._labelled) < MAX_METRIC_TENANTS:
            self._labelled.add(tenant)
            return tenant
        return OTHER_TENANTS

    def identify(self, headers: Mapping[str, str], trusted: bool) -> str:
        """The request's tenant (TenancyConfig's docstring); "" when tenancy is off."""
        if not self.enabled:
            return ""
        if trusted:
            named = headers.get(self.header, "").strip()
            if named:
                return named[:_MAX_TENANT_CHARS]
        scheme, _, key = headers.get("authorization", "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            return ANONYMOUS
        digest = hashlib.sha256(key.encode()).hexdigest()
        return self._by_digest.get(digest) or f"key-{digest[:12]}"

    def weight(self, tenant: str) -> float:
        spec = self._specs.get(tenant)
        return spec.weight if spec is not None else self.config.default_weight

    def _rate(self, tenant: str) -> TokenRate | None:
        spec = self._specs.get(tenant)
        if spec is not None and spec.rate is not None:
            return spec.rate
        return self.config.default_rate

    def charge(self, tenant: str, prompt_tokens: int, body: Mapping[str, Any]) -> int:
        """Takes the request's tokens from its tenant's bucket: 0 when it may go on, otherwise
        the Retry-After seconds of its 429."""
        if not self.enabled:
            return 0
        bucket = self._buckets.get(tenant)
        if bucket is None:
            rate = self._rate(tenant)
            if rate is None:
                return 0
            bucket = self._buckets[tenant] = TokenBucket(rate, self._clock())
        cost = prompt_tokens + output_tokens_asked(body, self.config.assumed_output_tokens)
        return bucket.take(cost, self._clock())
