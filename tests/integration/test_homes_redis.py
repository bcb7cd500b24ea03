"""Conversations' homes in Redis (`cachemap.redis.stores.HomeStore`), so N gateways keep the same
affinity: the story of tests/cachemap/test_affinity.py against a real redis-server and a real
3-master Redis Cluster, each through the `RedisDirectory` a gateway opens."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from cachemap.affinity import MAX_WALK_BLOCKS, Home
from cachemap.keys import BlockHash, chain_hashes, root_hash
from cachemap.redis.client import open_redis
from cachemap.redis.directory import RedisDirectory

pytestmark = pytest.mark.redis


@pytest.fixture(params=("redis", "cluster"))
async def directory(
    request: pytest.FixtureRequest, redis_url: str, redis_cluster_url: str
) -> AsyncIterator[RedisDirectory]:
    client = await open_redis(redis_url if request.param == "redis" else redis_cluster_url)
    shared = RedisDirectory(client)
    await shared.start()
    yield shared
    await shared.close()


def conversation(n: int) -> list[BlockHash]:
    """A chain of `n` blocks unique to the test (the servers are shared)."""
    name = uuid.uuid4().hex
    data = name.encode() * n
    return chain_hashes(data[: 16 * n], root_hash(b"salt", name), 16)


async def test_a_turn_finds_its_previous_turns_replica_and_a_record_supersedes_it(
    directory: RedisDirectory,
) -> None:
    homes = directory.homes
    a = conversation(8)
    assert await homes.lookup(a[:3]) is None
    await homes.record(a[:3], "http://r1", None, 60.0)
    home = await homes.lookup(a[:5])
    assert home == Home("http://r1", 3, a[2])
    await homes.record(a[:5], "http://r2", home, 60.0)
    assert await homes.lookup(a) == Home("http://r2", 5, a[4])
    assert await homes.lookup(a[:4]) is None, "the superseded home is gone"
    assert await homes.lookup([]) is None


async def test_a_home_expires_with_its_ttl(directory: RedisDirectory) -> None:
    homes = directory.homes
    a = conversation(4)
    await homes.record(a[:2], "http://r1", None, 0.05)
    deadline = asyncio.get_running_loop().time() + 5.0
    while await homes.lookup(a) is not None:  # Redis expires it (PX): poll, bounded
        assert asyncio.get_running_loop().time() < deadline, "the home never expired"
        await asyncio.sleep(0.02)


async def test_the_walk_back_is_bounded_as_in_process(directory: RedisDirectory) -> None:
    homes = directory.homes
    a = conversation(MAX_WALK_BLOCKS + 3)
    await homes.record(a[:3], "http://r1", None, 60.0)
    assert await homes.lookup(a[: MAX_WALK_BLOCKS + 2]) == Home("http://r1", 3, a[2])
    assert await homes.lookup(a) is None
