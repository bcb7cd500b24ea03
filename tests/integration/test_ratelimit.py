"""Rate limits: token buckets in process and in a real Redis, and the fall back between them."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from gateway.pipeline.ratelimit import (
    MIN_SWEEP,
    REDIS_RETRY_AFTER_S,
    Limits,
    LocalBuckets,
    RateLimiter,
)
from loadgen.harness.redis_servers import RedisServer


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_local_buckets_refill_at_the_limit_per_minute() -> None:
    clock = FakeClock()
    buckets = LocalBuckets(clock)
    limits = Limits(requests_per_min=2, tokens_per_min=600)
    assert buckets.acquire("acme", limits, 100) == 0.0
    assert buckets.acquire("acme", limits, 100) == 0.0
    # the requests bucket is empty: one request comes back every 30 s
    assert buckets.acquire("acme", limits, 100) == pytest.approx(30.0)
    assert buckets.acquire("globex", limits, 100) == 0.0  # per tenant
    clock.now += 30.0
    assert buckets.acquire("acme", limits, 100) == 0.0
    # tokens: 600 - 300 used + 300 refilled over 30 s = 600, capped at 600; ask for 700 -> never
    # enough now; the wait is for the missing 100 tokens at 10 tokens/s
    clock.now += 60.0
    assert buckets.acquire("acme", Limits(tokens_per_min=600), 700) == pytest.approx(10.0)
    # a refused request charges neither bucket
    assert buckets.acquire("acme", limits, 600) == 0.0
    assert buckets.acquire("acme", limits, 1) == pytest.approx(0.1)


def test_usage_settles_the_estimate_and_may_leave_a_debt() -> None:
    clock = FakeClock()
    buckets = LocalBuckets(clock)
    limits = Limits(tokens_per_min=600)
    assert buckets.acquire("acme", limits, 100) == 0.0
    buckets.adjust("acme", 600, 900)  # the request really used 1,000 tokens: 400 in debt
    assert buckets.acquire("acme", limits, 100) == pytest.approx(50.0)  # (100 + 400) / 10 per s
    buckets.adjust("acme", 600, -5000)  # a refund never overfills the bucket
    assert buckets.acquire("acme", limits, 600) == 0.0


def test_local_buckets_are_bounded_by_the_tenants_not_yet_refilled() -> None:
    """A full bucket is an absent one: tenants that went quiet (or were revoked) leave nothing
    behind once refilled, whatever the number of tenants ever seen; one still in debt stays."""
    clock = FakeClock()
    buckets = LocalBuckets(clock)
    limits = Limits(requests_per_min=60, tokens_per_min=6000)
    assert buckets.acquire("debtor", limits, 100) == 0.0
    buckets.adjust("debtor", 6000, 11_900)  # used 12,000: 6,000 in debt, full again in 120 s
    num_tenants = 4 * MIN_SWEEP
    for t in range(num_tenants):  # each one request, then quiet
        assert buckets.acquire(f"tenant-{t}", limits, 100) == 0.0
    # all just debited: none is full yet, so none may go (two buckets each)
    assert len(buckets) == 2 * num_tenants + 2
    clock.now += 61.0  # every quiet tenant's buckets are full again; the debtor's tokens are not
    for t in range(num_tenants):  # as many new ones: the entries double, a sweep runs
        assert buckets.acquire(f"new-{t}", limits, 100) == 0.0
    # the quiet tenants' buckets went at that sweep: left are the new tenants' (still
    # refilling) and the debtor's tokens bucket (its requests bucket was full again)
    assert len(buckets) == 2 * num_tenants + 1
    assert buckets.acquire("debtor", Limits(tokens_per_min=6000), 6000) == pytest.approx(59.0)
    assert buckets.acquire("tenant-0", limits, 6000) == 0.0  # forgotten means full, not empty


@pytest.mark.redis
async def test_two_limiters_sharing_redis_share_one_budget(redis_url: str) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    first, second = RateLimiter(redis_url), RateLimiter(redis_url)
    try:
        limits = Limits(requests_per_min=3, tokens_per_min=1000)
        assert await first.acquire(tenant, limits, 100) == 0.0
        assert await second.acquire(tenant, limits, 100) == 0.0
        assert await first.acquire(tenant, limits, 100) == 0.0
        wait = await second.acquire(tenant, limits, 100)
        assert 15.0 < wait <= 20.0  # one request per 20 s comes back
        assert await first.acquire(tenant, limits, 100) > 15.0
        # tokens: 700 left; the usage said 500 more than the estimate -> 200 left
        await first.adjust(tenant, 1000, 500)
        other = f"{tenant}-b"
        assert await second.acquire(other, Limits(tokens_per_min=1000), 900) == 0.0
        await second.adjust(other, 1000, 300)  # -200 now
        wait = await first.acquire(other, Limits(tokens_per_min=1000), 100)
        assert 16.0 < wait <= 18.0  # (100 + 200) tokens at 1000/60 per s
        assert first.num_redis_failures == second.num_redis_failures == 0
    finally:
        await first.close()
        await second.close()


@pytest.mark.redis
async def test_without_redis_the_limiter_falls_back_within_its_deadline(
    fresh_redis: RedisServer,
) -> None:
    clock = FakeClock()
    limiter = RateLimiter(fresh_redis.url, timeout_s=0.2, clock=clock)
    limits = Limits(requests_per_min=2)
    try:
        assert await limiter.acquire("acme", limits, 0) == 0.0  # in Redis
        fresh_redis.stop()
        started = time.monotonic()
        assert await limiter.acquire("acme", limits, 0) == 0.0  # local: a full bucket
        assert time.monotonic() - started < 1.0
        assert limiter.num_redis_failures == 1
        assert await limiter.acquire("acme", limits, 0) == 0.0
        assert await limiter.acquire("acme", limits, 0) > 0  # the local limit holds
        assert limiter.num_redis_failures == 1  # Redis is not tried again for a while
        fresh_redis.start()
        clock.now += REDIS_RETRY_AFTER_S
        # back on Redis (a new, empty one): the local bucket, still empty, would refuse
        assert await limiter.acquire("acme", limits, 0) == 0.0
        assert await limiter.acquire("acme", limits, 0) == 0.0
        assert await limiter.acquire("acme", limits, 0) > 0
        assert limiter.num_redis_failures == 1
    finally:
        await limiter.close()


async def test_a_redis_that_does_not_answer_costs_one_deadline() -> None:
    # a listening socket that never answers: connect succeeds, the reply never comes
    accepted: list[asyncio.StreamWriter] = []

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    limiter = RateLimiter(f"redis://127.0.0.1:{port}", timeout_s=0.2)
    try:
        started = time.monotonic()
        assert await limiter.acquire("acme", Limits(requests_per_min=1), 0) == 0.0
        assert 0.15 < time.monotonic() - started < 1.0
        assert limiter.num_redis_failures == 1
        started = time.monotonic()
        assert await limiter.acquire("acme", Limits(requests_per_min=1), 0) > 0
        assert time.monotonic() - started < 0.05  # no second deadline: straight to local
    finally:
        await limiter.close()
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()
