"""The gateway's directory (`gateway.directory.routing.RoutingDirectory`) as `kvgate serve`
composes it — the local fallback index and the shared Redis directory — against a real
redis-server: the seams between the two stores."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest

from cachemap.keys import BlockHash, chain_hashes, root_hash
from cachemap.redis.client import open_redis
from cachemap.redis.directory import RedisDirectory
from gateway.directory.routing import RoutingDirectory
from gateway.server.app import build
from tests.conftest import gateway_settings

pytestmark = pytest.mark.redis


def chain(name: str, n: int) -> list[BlockHash]:
    data = (name * 256 * n).encode()[: 256 * n]
    return chain_hashes(data, root_hash(b"salt", name), 256)


async def later_than(t_s: float) -> None:
    """Return once the wall clock (the directory's) has passed `t_s` by 2 ms: a bounded
    wait, because the test needs two events at distinct instants (not a synchronisation)."""
    for _ in range(1000):
        if time.time() > t_s + 0.002:
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the clock did not advance")


async def composed(redis_url: str, replicas: list[str]) -> RoutingDirectory:
    """The directory exactly as `gateway.server.app` builds and starts it."""
    settings = gateway_settings(replicas, redis_url=redis_url, redis_deadline_s=0.5)
    directory = build(settings).directory
    directory.shared = RedisDirectory(
        await open_redis(redis_url),
        capacity_blocks=settings.directory_capacity_blocks,
        ttl_s=settings.directory_ttl_s,
    )
    directory.register(replicas)
    await directory.start()
    return directory


@pytest.fixture
async def replica() -> AsyncIterator[str]:
    yield f"http://{uuid.uuid4().hex[:8]}:8000"


async def test_an_expiry_from_a_shared_lookup_keeps_what_the_local_index_used_since(
    redis_url: str, replica: str
) -> None:
    """Item 13: reconciliation expires, on both stores, what was last used at or before the
    shared lookup's last-use time. That time must mean the same instant in the local index,
    or the fallback routing relies on while Redis is away is wiped by every over-estimate."""
    d = await composed(redis_url, [replica])
    try:
        older, newer = chain(f"{replica}-older", 4), chain(f"{replica}-newer", 4)
        await d.record(replica, older)
        await later_than(time.time())  # stored times have 1 ms resolution
        await d.record(replica, newer)
        await d.flushed()
        looked = await d.lookup(older)
        assert not looked.degraded and looked.overlap == {replica: 4}
        await d.expire(replica, looked.last_use[replica])  # an over-estimate on `older`
        await d.flushed()
        assert (await d.lookup(older)).overlap == {}
        # the local index dropped the same entries, and kept the chain used after them: what
        # the fallback routes on while Redis is away
        assert await d.local.lookup(older) == {}
        assert await d.local.lookup(newer) == {replica: 4}
        assert (await d.lookup(newer)).overlap == {replica: 4}
    finally:
        await d.close()
