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
from cachemap.redis.schema import block_keys, replica_id
from loadgen.harness.redis_servers import RedisServer
from tests.busy_loop import lent_connections

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


async def test_a_placement_with_its_leaders_marker_matches_as_one_alone(
    directory: RedisDirectory,
) -> None:
    """`LEAD_PLACE` (a fan-out leader's marker and its placement in one call) writes what
    `LEAD` and `PLACE` write: on one Redis and on a cluster (both keys in the chain's slot)."""
    blocks, alone = chain(12), chain(12)
    for c in (blocks, alone):
        await directory.record("r1", c[:4])
    place = directory.place_args("r1")
    await directory.markers.lead(blocks[4:], "pending|gw:1|r1|1.0", 10.0, place=place)
    await directory.markers.lead(alone[4:], "pending|gw:2|r1|1.0", 10.0)
    await directory.place("r1", alone[4:])
    for c in (blocks, alone):
        assert (await directory.lookup_detail(c))["r1"] == (12, 0.0)
        found = await directory.lookup_full(c, writers=True)
        assert (found.writer_depth, found.writer_from) == (12, 4)
    await directory.markers.lead(blocks[4:], "pending|gw:3|r1|1.0", 10.0, place=place)
    found = await directory.lookup_full(blocks, writers=True)
    assert found.writer == "pending|gw:1|r1|1.0"  # the first leader's marker stays


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
            [("r1", c[:3], None, None) for c in chains],
            [("r2", c) for c in chains],
        )
        for c in chains:
            found = await directory.lookup_detail(c)
            assert found["r1"][0] == 3 and found["r1"][1] > 0
            assert found["r2"] == (6, 0.0)  # in flight: no last use


async def test_the_write_behinds_rounds_go_down_a_connection_of_their_own(
    fresh_redis: RedisServer,
) -> None:
    """On a single Redis the write-behind's rounds (records, placements) are written down the
    directory's own connection for them (`LookupLane.commands`), taken from the client's pool
    once, not a pooled pipeline a round (a connection taken and given back, the retry wrapper,
    the send's `wait_for`: issue 39's tier CPU); what they write is the same, and a Redis that
    lost the scripts has them loaded again."""
    client = await open_redis(fresh_redis.url)
    d = RedisDirectory(client, capacity_blocks=1_000_000)
    await d.refresh_generations()
    d.register(["r1", "r2"])
    try:
        chains = [chain(1_200) for _ in range(3)]  # each a batch of three rounds
        flights = [chain(6) for _ in range(3)]
        await d.record_many([("r1", chain(1), None, None)], [("r2", chain(1))])  # loaded
        with lent_connections(client.connection_pool) as taken:
            for c, flight in zip(chains, flights, strict=True):
                await d.record_many([("r1", c, None, None)], [("r2", flight)])
        assert taken[0] == 0  # the first record's connection, kept
        await client.script_flush()  # Redis forgets every script
        chains.append(chain(300))
        await d.record_many([("r1", chains[-1], None, None)], [("r2", flights[0])])
        for c in chains:
            assert await d.lookup(c) == {"r1": len(c)}
        assert await d.lookup(flights[0]) == {"r2": 6}
    finally:
        await d.close()


def _script_calls(sync: redis.Redis) -> dict[str, int]:
    """Commands Redis ran since the last reset (a script's own calls counted), by name."""
    return {
        name.removeprefix("cmdstat_"): int(stat["calls"])
        for name, stat in sync.info("commandstats").items()
        if not name.startswith("cmdstat_config")
    }


async def test_a_placement_is_one_write_and_its_record_writes_each_block_once(
    fresh_redis: RedisServer,
) -> None:
    """Issue 39's tier CPU: a placement wrote a field on every block (HSET, PTTL, PEXPIRE each)
    and its record then read and deleted each one (HDEL): seven commands per new block, the
    largest per-request cost of Redis at a low hit ratio. Now a flight is one field on its
    first block's `:p` key, and the record of its blocks runs HGET, HSET and PEXPIRE once
    each per block, nothing more; the lookup walks the flight as before."""
    client = await open_redis(fresh_redis.url)
    d = RedisDirectory(client)
    await d.refresh_generations()
    d.register(["r1", "r2"])
    blocks = chain(64)
    await d.record("r1", blocks[:8])
    await d.lookup(blocks)  # the lookup script is loaded
    sync = redis.Redis.from_url(fresh_redis.url)
    try:
        await d.place("r1", blocks[8:])  # the script is loaded, then measured
        await d.place("r2", blocks[:4])
        sync.config_resetstat()
        await d.place("r1", blocks[8:])
        calls = _script_calls(sync)
        assert calls.pop("evalsha") == 1
        assert sum(calls.values()) <= 3, calls  # HSET, PTTL, PEXPIRE: not one per block
        found = await d.lookup_detail(blocks)
        assert found["r1"] == (64, 0.0) and found["r2"] == (4, 0.0)
        sync.config_resetstat()
        await d.record("r1", blocks)  # the first token: 56 blocks new to the replica
        calls = _script_calls(sync)
        assert calls.get("hdel", 0) == 0 and calls.get("pttl", 0) == 0, calls
        assert calls["hset"] <= 64 + 2 and calls["pexpire"] <= 64, calls  # + the count's
        depth, used = (await d.lookup_detail(blocks))["r1"]
        assert depth == 64 and used > 0  # the entries now, with their last use
    finally:
        sync.close()
        await d.close()


async def test_a_record_that_writes_nothing_refreshes_no_ttl(fresh_redis: RedisServer) -> None:
    """A block's key lives at least a TTL past the last use it holds (every write sets its
    expiry), so a record that keeps a later use already there need not touch the key."""
    client = await open_redis(fresh_redis.url)
    d = RedisDirectory(client)
    await d.refresh_generations()
    d.register(["r1"])
    blocks = chain(16)
    await d.record("r1", blocks)
    sync = redis.Redis.from_url(fresh_redis.url)
    try:
        sync.config_resetstat()
        await d.record_many([("r1", blocks, d.clock() - 5.0, None)])  # older than what is there
        calls = _script_calls(sync)
        assert calls.get("pexpire", 0) == 0 and calls["hget"] == 16 + 2, calls  # + the count's
        key = b"kvg:{" + blocks[3][:6].hex().encode() + b"}:" + blocks[3][6:]
        assert sync.pttl(key) > (d.ttl_s - 60) * 1000
    finally:
        sync.close()
        await d.close()


async def test_flights_chain_and_stop_where_the_looked_up_chain_leaves_them(
    directory: RedisDirectory,
) -> None:
    """A flight placed past another (the second request saw the first's flight as held) goes
    on from it; a chain that shares only a flight's first blocks matches those; a flight's
    replica restarted (an epoch) or its time passed: no match."""
    blocks, other = chain(12), chain(12)
    await directory.place("r1", blocks[:5])
    await directory.place("r1", blocks[5:9])
    assert (await directory.lookup_detail(blocks))["r1"] == (9, 0.0)
    await directory.place("r2", blocks)
    # the same first three blocks, then another text: the flight agrees as far as the chain does
    fork = chain_hashes(b"x" * 768 + b"y" * 2560, root_hash(b"salt", "fork"), 256)[:10]
    base = chain_hashes(b"x" * 768 + b"z" * 2560, root_hash(b"salt", "fork"), 256)[:10]
    assert fork[:3] == base[:3] and fork[3] != base[3]
    await directory.place("r2", base)
    assert (await directory.lookup_detail(fork))["r2"] == (3, 0.0)
    assert await directory.lookup_detail(other) == {}
    await directory.forget("r1")
    assert "r1" not in await directory.lookup_detail(blocks)


async def test_a_layout_2_gateways_per_block_placements_still_match(
    directory: RedisDirectory,
) -> None:
    """A rolling upgrade: a gateway of the commit before writes a placement as a field
    "<rid>+" on every block; this code's lookup still walks it, and once the blocks are
    recorded their entries outrank it (the record leaves the field to its own expiry: reading
    it on every block took an HMGET, ~0.5 µs a block of Redis's more than an HGET)."""
    blocks = chain(6)
    rid = replica_id("r1")
    value = f"{directory.meta.gen(rid)}:{int((directory.clock() + 10) * 1000)}"
    for key in block_keys(blocks):
        await directory.client.hset(key, rid + "+", value)
    assert (await directory.lookup_detail(blocks))["r1"] == (6, 0.0)
    await directory.record("r1", blocks)
    found = await directory.lookup_full(blocks)
    depth, last_use = found.detail["r1"]
    assert depth == 6 and last_use > 0  # the entries' last use, not a placement's none
    assert found.held["r1"].depth == 6
