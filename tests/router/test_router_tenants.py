"""Tenant fairness, shedding and token buckets of the admission queue (pure, in one event loop)."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from tandem.common.tenancy import TenancyConfig
from tandem.router.admission import Admission, QueueFull
from tandem.router.tenants import ANONYMOUS, TenantDirectory, TokenBucket


async def _served_order(admission: Admission, arrivals: list[tuple[int, str]]) -> list[str]:
    """Queues `arrivals` ((priority, tenant)) behind one held slot, then releases slot by slot."""
    assert admission.try_acquire()
    order: list[str] = []

    async def one(priority: int, tenant: str) -> None:
        await admission.acquire(priority, 0.0, tenant)
        order.append(tenant)

    tasks = [asyncio.create_task(one(p, t)) for p, t in arrivals]
    await asyncio.sleep(0)
    holder = ""
    for served in range(len(arrivals)):
        admission.release(holder)
        await asyncio.sleep(0)
        holder = order[served]
    await asyncio.gather(*tasks)
    return order


async def test_a_level_alternates_between_tenants_by_weight() -> None:
    weights = {"loud": 1.0, "quiet": 1.0, "heavy": 2.0}
    admission = Admission(1, 100, weight=lambda tenant: weights.get(tenant, 1.0))
    order = await _served_order(admission, [(0, "loud")] * 10 + [(0, "quiet")] * 3)
    # The quiet tenant's three requests, queued behind ten of the loud one's, go every other slot.
    assert order[:6] == ["loud", "quiet", "loud", "quiet", "loud", "quiet"]
    admission = Admission(1, 100, weight=lambda tenant: weights.get(tenant, 1.0))
    order = await _served_order(admission, [(0, "loud")] * 9 + [(0, "heavy")] * 9)
    assert order[:9].count("heavy") == 6  # weight 2 of 3


async def test_priority_stays_strict_across_tenants() -> None:
    admission = Admission(1, 100)
    order = await _served_order(admission, [(5, "batch")] * 3 + [(-5, "chat")] * 2)
    assert order == ["chat", "chat", "batch", "batch", "batch"]


async def test_a_full_queue_drops_the_sheddable_level_first() -> None:
    admission = Admission(1, 3, sheddable=lambda priority: priority >= 10)
    assert admission.try_acquire()
    shed = [asyncio.create_task(admission.acquire(10, 0.0, "bulk")) for _ in range(3)]
    await asyncio.sleep(0)
    urgent = asyncio.create_task(admission.acquire(0, 0.0, "chat"))
    await asyncio.sleep(0.01)
    dropped = [t for t in shed if t.done()]
    assert len(dropped) == 1
    assert dropped[0] is shed[2]
    error = dropped[0].exception()
    assert isinstance(error, QueueFull)
    assert error.dropped
    assert error.retry_after_s >= 1
    # A sheddable arrival on a full queue is refused itself: nothing ranks below it.
    with pytest.raises(QueueFull):
        await admission.acquire(10, 0.0, "bulk")
    admission.release()
    await urgent
    assert admission.waiting == 2
    assert admission.dropped == 1
    for task in shed[:2]:
        task.cancel()
    await asyncio.gather(*shed[:2], return_exceptions=True)
    assert admission.waiting == 0


async def test_a_full_level_drops_the_tenant_most_over_its_share() -> None:
    admission = Admission(1, 4)
    assert admission.try_acquire()
    loud = [asyncio.create_task(admission.acquire(0, 0.0, "loud")) for _ in range(4)]
    await asyncio.sleep(0)
    quiet = asyncio.create_task(admission.acquire(0, 0.0, "quiet"))
    await asyncio.sleep(0.01)
    assert loud[3].done()
    assert isinstance(loud[3].exception(), QueueFull)
    # The loud tenant cannot push the quiet one out: 1 waiting of weight 1 is not over a share.
    with pytest.raises(QueueFull):
        await admission.acquire(0, 0.0, "loud")
    admission.release()
    await asyncio.sleep(0.01)
    assert loud[0].done()
    assert not quiet.done()
    admission.release("loud")
    await asyncio.sleep(0.01)
    assert quiet.done()
    assert quiet.exception() is None
    for task in loud[1:3]:
        task.cancel()
    await asyncio.gather(*loud[1:3], return_exceptions=True)
    assert admission.waiting == 0


async def test_one_tenant_is_a_plain_priority_queue() -> None:
    admission = Admission(1, 100)
    order = await _served_order(admission, [(1, ""), (0, ""), (1, ""), (0, "")])
    assert order == ["", "", "", ""]
    assert admission.in_flight == 1


def test_token_bucket_refills_and_allows_debt_on_a_full_bucket() -> None:
    from tandem.common.tenancy import TokenRate

    bucket = TokenBucket(TokenRate(tokensPerSecond=100, burstTokens=500), now=0.0)
    assert bucket.take(400, 0.0) == 0
    assert bucket.take(400, 0.0) == 3  # 100 left, 400 needed: 3 s at 100/s
    assert bucket.take(400, 3.0) == 0
    big = TokenBucket(TokenRate(tokensPerSecond=100, burstTokens=500), now=0.0)
    assert big.take(2000, 0.0) == 0  # larger than the bucket: passes on a full one
    assert big.take(10, 1.0) == 15  # 1500 in debt, +100: 1410 short of 10 at 100/s


def test_tenant_of_a_key_a_header_or_nobody() -> None:
    key = "sk-team-a"
    digest = hashlib.sha256(key.encode()).hexdigest()
    directory = TenantDirectory(
        TenancyConfig.model_validate(
            {
                "tenants": [
                    {
                        "name": "team-a",
                        "keySha256": [digest],
                        "weight": 3,
                        "rate": {"tokensPerSecond": 10, "burstTokens": 20},
                    },
                ],
                "defaultRate": {"tokensPerSecond": 1000},
            }
        ),
        clock=lambda: 0.0,
    )
    assert directory.identify({"authorization": f"Bearer {key}"}, trusted=False) == "team-a"
    other = hashlib.sha256(b"sk-other").hexdigest()[:12]
    assert directory.identify({"authorization": "Bearer sk-other"}, False) == f"key-{other}"
    assert directory.identify({"x-tandem-tenant": "batch"}, trusted=False) == ANONYMOUS
    assert directory.identify({"x-tandem-tenant": "batch"}, trusted=True) == "batch"
    assert directory.weight("team-a") == 3
    assert directory.weight("batch") == 1
    assert directory.charge("team-a", 10, {"max_tokens": 10}) == 0
    assert directory.charge("team-a", 10, {"max_tokens": 10}) == 2
    assert directory.charge("batch", 1000, {}) == 0  # 1000 + 256 assumed: debt on a full bucket
    off = TenantDirectory(TenancyConfig(enabled=False))
    assert off.identify({"authorization": f"Bearer {key}"}, True) == ""
    assert off.charge("", 10**9, {}) == 0


async def test_a_tenant_within_its_share_never_waits_behind_anothers_backlog() -> None:
    admission = Admission(4, 100)
    for _ in range(4):
        assert admission.try_acquire("loud")
    backlog = [asyncio.create_task(admission.acquire(0, 0.0, "loud")) for _ in range(3)]
    await asyncio.sleep(0)
    assert admission.guaranteed_share("quiet") == 2  # floor(4 · 1 / 2)
    await admission.acquire(0, 0.0, "quiet")
    await admission.acquire(0, 0.0, "quiet")  # two beyond max_in_flight, at once
    assert admission.in_flight == 6
    third = asyncio.create_task(admission.acquire(0, 0.0, "quiet"))
    await asyncio.sleep(0)
    assert not third.done()
    admission.release("loud")  # 5 still held: nobody moves up
    await asyncio.sleep(0)
    assert admission.in_flight == 5
    assert admission.waiting == 4
    admission.release("loud")
    admission.release("quiet")  # 3 held: one waiter moves up, the earlier head of two level tags
    await asyncio.sleep(0)
    assert backlog[0].done()
    assert not third.done()
    admission.release("loud")  # then the quiet tenant's, whose finish tag is behind
    await asyncio.sleep(0)
    assert third.done()
    assert admission.in_flight == 4
    for task in backlog:
        task.cancel()
    await asyncio.gather(*backlog, return_exceptions=True)
    assert admission.waiting == 0
