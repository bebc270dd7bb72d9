"""Tenants of a router or gateway: who they are, their share of each model's queue, their token rate.

One definition for the router's config file and a ServingCluster's `spec.router.tenancy` (as
`tandem.common.routing` is for the routing policy); field docstrings are the CRD's descriptions.
"""

from __future__ import annotations

from pydantic import Field

from tandem.common.settings import SettingsModel

TENANT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,62}$"


class TokenRate(SettingsModel):
    """A token bucket: `tokensPerSecond` refill, `burstTokens` capacity. A request is charged its
    prompt tokens plus its max output tokens when admitted."""

    tokens_per_second: float = Field(gt=0, alias="tokensPerSecond")
    """Sustained rate of prompt plus max output tokens."""
    burst_tokens: int | None = Field(None, ge=1, alias="burstTokens")
    """Bucket capacity; unset = ten seconds at `tokensPerSecond`. A request larger than the bucket
    is admitted on a full bucket and leaves it in debt (never refused for good)."""

    @property
    def capacity(self) -> float:
        return float(self.burst_tokens) if self.burst_tokens else 10.0 * self.tokens_per_second

    def divided(self, n: int) -> TokenRate:
        """One of n equal parts of the rate and of the bucket."""
        return TokenRate(
            tokens_per_second=self.tokens_per_second / n,
            burst_tokens=max(1, round(self.capacity / n)),
        )


class TenantSpec(SettingsModel):
    """One named tenant: the keys that identify it, its weight and its optional token rate."""

    name: str = Field(pattern=TENANT_NAME_PATTERN)
    """The tenant's name (metrics label, and the value a trusted client's tenant header carries)."""
    key_sha256: list[str] = Field(default_factory=list, alias="keySha256")
    """Hex SHA-256 digests of the API keys that belong to the tenant (`printf %s KEY | sha256sum`):
    the digests, not the keys, so the rendered config holds no secret."""
    weight: float = Field(1.0, gt=0, le=1000)
    """Share of each model's queue relative to the other tenants waiting at the same priority."""
    rate: TokenRate | None = None
    """Token-rate limit of the tenant; unset = `defaultRate`."""


class TenancyConfig(SettingsModel):
    """Tenant fairness and token-rate limits in the router's admission queue.

    A request's tenant: a trusted client's tenant header, else the tenant whose `keySha256` lists
    its bearer key, else `key-<first 12 hex digits of the key's SHA-256>` (every key its own
    tenant), else `anonymous`. Within a priority level the waiting requests of different tenants
    are served in weighted fair shares (docs/router.md, "Tenants").
    """

    enabled: bool = True
    """Fair shares between tenants; off, a priority level is served first come first served and
    no rate limit applies."""
    header: str = Field("x-tandem-tenant", min_length=1)
    """Request header naming the tenant, honoured from trusted clients only (a gateway in front,
    an admin key)."""
    tenants: list[TenantSpec] = Field(default_factory=list)
    """Named tenants; any other tenant has weight `defaultWeight` and rate `defaultRate`."""
    default_weight: float = Field(1.0, gt=0, le=1000, alias="defaultWeight")
    """Weight of a tenant not listed in `tenants`."""
    default_rate: TokenRate | None = Field(None, alias="defaultRate")
    """Token-rate limit of each tenant without its own `rate`; unset = none."""
    assumed_output_tokens: int = Field(256, ge=0, alias="assumedOutputTokens")
    """Output tokens charged to the bucket for a request that sets no `max_tokens`."""

    def divided(self, n: int) -> TenancyConfig:
        """The tenancy of one router process of n sharing a port: every token rate split n ways
        (the kernel spreads connections evenly over the processes)."""
        if n == 1:
            return self
        return self.model_copy(
            update={
                "default_rate": self.default_rate.divided(n) if self.default_rate else None,
                "tenants": [
                    t.model_copy(update={"rate": t.rate.divided(n) if t.rate else None})
                    for t in self.tenants
                ],
            }
        )
