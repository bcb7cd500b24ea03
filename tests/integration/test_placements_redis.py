"""Placements in flight and homes in the lookup's round trip (issue 39 items 2 and 3), against a
real redis-server and a real 3-master Redis Cluster through the `RedisDirectory` a gateway
opens."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import redis

from cachemap.affinity import MAX_WALK_BLOCKS, Home
from cachemap.keys import BlockHash, chain_hashes, root_hash
from cachemap.redis.client import open_redis
from cachemap.redis.directory import RedisDirectory
from loadgen.harness.redis_servers import RedisServer

pytestmark = pytest.mark.redis


@pytest.fixture(params=("redis", "cluster"))
async def directory(
    request: pytest.FixtureRequest, redis_url: str, redis_cluster_url: str
) -> AsyncIterator[RedisDirectory]:
    client = await open_redis(redis_url if request.param == "redis" else redis_cluster_url)
    shared = RedisDirectory(client)
    await shared.start()
    shared.register(["r1", "r2"])
    yield shared
    await shared.close()


def chain(n: int) -> list[BlockHash]:
    name = uuid.uuid4().hex
    return chain_hashes(name.encode() * (16 * n), root_hash(b"salt", name), 256)[:n]


async def test_a_placement_extends_its_replicas_match_until_its_record_lands(
    directory: RedisDirectory,
) -> None:
    blocks = chain(12)
    await directory.record("r1", blocks[:4])
    await directory.place("r2", blocks[:8])
    found = await directory.lookup_detail(blocks)
    assert found["r2"] == (8, 0.0)  # matched by the placement: no last use to expire
    assert found["r1"][0] == 4 and found["r1"][1] > 0
    await directory.place("r1", blocks[4:10])  # r1 held 4: the rest is in flight
    assert (await directory.lookup_detail(blocks))["r1"][0] == 10
    await directory.record("r1", blocks[:10])  # its first token: a real entry, a last use
    depth, used = (await directory.lookup_detail(blocks))["r1"]
    assert depth == 10 and used > 0
    await directory.forget("r2")  # a restart epoch: its placements stop matching too
    assert "r2" not in await directory.lookup_detail(blocks)


async def test_a_placement_expires(directory: RedisDirectory) -> None:
    blocks = chain(3)
    await directory.place("r1", blocks, ttl_s=0.001)
    clock = directory.clock
    directory.clock = lambda: clock() + 0.05  # the script compares with the caller's now
    try:
        assert await directory.lookup_detail(blocks) == {}
    finally:
        directory.clock = clock


async def test_the_lookup_reads_the_home_as_the_home_script_does(
    directory: RedisDirectory,
) -> None:
    blocks = chain(MAX_WALK_BLOCKS + 8)
    assert (await directory.lookup_full(blocks[:6], homes=MAX_WALK_BLOCKS)).home is None
    await directory.homes.record(blocks[:5], "http://r1", None, 60.0)
    full = await directory.lookup_full(blocks[:9], homes=MAX_WALK_BLOCKS)
    assert full.home == (5, "http://r1")
    assert await directory.homes.lookup(blocks[:9]) == Home("http://r1", 5, blocks[4])
    assert (await directory.lookup_full(blocks[:9])).home is None, "not asked"
    # the walk back is bounded alike: a home further back than MAX_WALK_BLOCKS is not found
    assert (await directory.lookup_full(blocks, homes=MAX_WALK_BLOCKS)).home is None
    assert await directory.homes.lookup(blocks) is None


async def test_a_lookup_with_its_home_is_one_redis_command(fresh_redis: RedisServer) -> None:
    client = await open_redis(fresh_redis.url)  # a server of its own: nothing else talks to it
    d = RedisDirectory(client)
    await d.refresh_generations()
    d.register(["r1"])
    blocks = chain(16)
    await d.record("r1", blocks[:10])
    await d.homes.record(blocks[:10], "http://r1", None, 60.0)
    sync = redis.Redis.from_url(fresh_redis.url)
    try:
        await d.lookup_full(blocks, homes=MAX_WALK_BLOCKS)  # the script is loaded
        sync.config_resetstat()
        full = await d.lookup_full(blocks, homes=MAX_WALK_BLOCKS)
        assert full.detail["r1"][0] == 10 and full.home == (10, "http://r1")
        stats = sync.info("commandstats")
        assert stats["cmdstat_evalsha"]["calls"] == 1
        assert not {k for k in stats if k.startswith("cmdstat_") and k not in (
            "cmdstat_evalsha", "cmdstat_hgetall", "cmdstat_get"
        ) and not k.startswith("cmdstat_config")}  # fmt: skip
    finally:
        sync.close()
        await d.close()


async def test_records_and_placements_share_one_pipeline_and_survive_a_script_flush(
    directory: RedisDirectory,
) -> None:
    """The write-behind's records and placements go down one pipeline (`record_many`'s
    `places`; issue 39's tier CPU: one pooled command each cost the client ~twice the CPU):
    written in order, every chain in one call each, on one Redis and on a cluster's masters
    — and a Redis that lost the scripts (a restart, `SCRIPT FLUSH`) has them loaded again."""
    chains = [chain(6) for _ in range(6)]
    for flushed in (False, True):
        if flushed:
            await directory.client.script_flush()  # every master forgets every script
            chains = [chain(6) for _ in range(6)]
        await directory.record_many(
            [("r1", c[:3], None) for c in chains],
            [("r2", c) for c in chains],
        )
        for c in chains:
            found = await directory.lookup_detail(c)
            assert found["r1"][0] == 3 and found["r1"][1] > 0
            assert found["r2"] == (6, 0.0)  # in flight: no last use
