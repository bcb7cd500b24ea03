"""The event index in Redis: one owner writes what the events say (`EventWriter`), any gateway
reads it (`EventReader`) — against a real redis-server and a real 3-master Redis Cluster.
Domains are unique per test, so the tests share the servers."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvloop
from redis.asyncio.cluster import RedisCluster

from cachemap.events import (
    CPU,
    GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventIndex,
    precise_keys,
)
from cachemap.redis.client import AnyRedis, open_redis
from cachemap.redis.event_scripts import DOMAINS_KEY, feed_key, map_key
from cachemap.redis.events import EventReader, EventWriter, Leases
from cachemap.redis.lookups import LaneClosed, LookupLane
from cachemap.redis.schema import block_keys, replica_id
from cachemap.tokenizer import ModelTokenizer
from gateway.events.precise import PreciseKeys, PreciseStats, PromptTokens
from loadgen.engine.tokenizer import MODEL_DIR
from loadgen.harness.redis_servers import RedisServer
from tests.busy_loop import HOLD, CommandCalls, RedisHolder, hog, until_ran

pytestmark = pytest.mark.redis

SALT = "tenant-salt"
PROMPT = list(range(1000, 1000 + 16 * 6))  # six 16-token blocks
MORE = list(range(5000, 5000 + 16 * 2))  # a continuation of two blocks


@pytest.fixture(params=["redis", "cluster"])
async def client(
    request: pytest.FixtureRequest, redis_url: str, redis_cluster_url: str
) -> AsyncIterator[AnyRedis]:
    url = redis_url if request.param == "redis" else redis_cluster_url
    redis = await open_redis(url, cluster=request.param == "cluster")
    yield redis
    await redis.aclose()


@pytest.fixture
def domain() -> str:
    return f"http://{uuid.uuid4().hex[:8]}:8000"


def stored(first: int, ids: list[int], parent: int | None = None, tier: int = GPU) -> BlockStored:
    hashes = [first + i for i in range(len(ids) // 16)]
    return BlockStored(hashes, parent, ids, 16, tier, SALT if parent is None else None)


async def owned(client: AnyRedis, domain: str, first: int, ids: list[int]) -> EventWriter:
    """An owner that adopted `domain` and wrote one chain of `ids` (engine hashes from
    `first`) at seq 1."""
    writer = EventWriter(client, block_size=16)
    await writer.adopt(domain)
    writer.apply(domain, stored(first, ids))
    await writer.commit(domain, 1, wiped=False)
    await writer.flush()
    return writer


async def test_an_owners_writes_are_every_readers_matches(client: AnyRedis, domain: str) -> None:
    writer = EventWriter(client, block_size=16)
    assert await writer.adopt(domain) is None  # never written
    writer.apply(domain, stored(100, PROMPT))
    writer.apply(domain, stored(200, MORE, parent=105))  # the parent's own key from the map
    await writer.commit(domain, 2, wiped=False)
    await writer.flush()
    keys = precise_keys(PROMPT + MORE, SALT, 16)
    reader = EventReader(client)
    assert (await reader.lookup(keys))[domain].depth == 8
    assert reader.live(domain)
    # the last block moves to CPU: held, but on no GPU
    writer.apply(domain, stored(201, MORE[16:], parent=200, tier=CPU))
    writer.apply(domain, BlockRemoved([201], GPU))
    # an eviction in the middle breaks the chain there
    writer.apply(domain, BlockRemoved([103], GPU))
    await writer.flush()
    match = (await reader.lookup(keys))[domain]
    assert (match.depth, match.offloaded) == (3, 0)
    assert writer.num_blocks(domain, GPU) == 6 and writer.num_blocks(domain, CPU) == 1


async def test_a_wipe_stops_every_match_once_committed_then_is_cleaned(
    client: AnyRedis, domain: str
) -> None:
    writer = EventWriter(client, block_size=16)
    await writer.adopt(domain)
    reader = EventReader(client)
    writer.apply(domain, stored(100, PROMPT))
    await writer.commit(domain, 1, wiped=False)
    await writer.flush()
    keys = precise_keys(PROMPT, SALT, 16)
    assert (await reader.lookup(keys))[domain].depth == 6
    before, retries = writer.committed_epochs[domain], reader.retries
    writer.apply(domain, AllBlocksCleared())
    await writer.commit(domain, 2, wiped=True)  # returns once the new epoch is in Redis
    assert writer.committed_epochs[domain] == before + 1
    # the reader still holds the old epoch: on one Redis the lookup reads the epochs itself
    # and says they moved; in a cluster the pipelined epochs tell it, and it retries
    assert domain not in await reader.lookup(keys)
    assert reader.epochs[replica_id(domain)] == before + 1
    assert reader.retries == retries + isinstance(client, RedisCluster)
    await writer.flush()  # the cleanup ran with the flush (one chunk)
    rid = replica_id(domain)
    block = block_keys(keys)[0] + b":e"
    assert await client.hget(block, rid) is None
    assert await client.hlen(map_key(rid)) == 0
    # a store after the wipe is written at the new epoch and matches again
    writer.apply(domain, stored(300, PROMPT))
    await writer.flush()
    assert (await reader.lookup(keys))[domain].depth == 6


async def test_a_new_owner_continues_where_the_last_one_stopped(
    client: AnyRedis, domain: str
) -> None:
    first = EventWriter(client, block_size=16)
    await first.adopt(domain)
    first.apply(domain, stored(100, PROMPT))
    await first.commit(domain, 41, wiped=False)
    await first.flush()
    # the first owner is gone (nothing released); the next one loads what it wrote
    second = EventWriter(client, block_size=16)
    assert await second.adopt(domain) == 41
    assert second.num_blocks(domain) == 6
    second.apply(domain, stored(200, MORE, parent=105))  # resolved through the stored map
    second.apply(domain, BlockRemoved([100], GPU))  # a block the first owner stored
    await second.flush()
    assert second.stats.unresolved_parents == 0 and second.stats.unknown_removals == 0
    reader = EventReader(client)
    assert domain not in await reader.lookup(precise_keys(PROMPT + MORE, SALT, 16))
    second.apply(domain, stored(300, PROMPT[:16]))  # block 0 again: the chain is whole
    await second.flush()
    assert (await reader.lookup(precise_keys(PROMPT + MORE, SALT, 16)))[domain].depth == 8
    assert int(await client.hget(feed_key(replica_id(domain)), "next_seq")) == 41


async def test_every_kind_of_engine_hash_reaches_the_next_owner_through_the_map(
    client: AnyRedis, domain: str
) -> None:
    """The map is written as one blob per flush (`MAP`): vLLM's unsigned 64-bit hashes,
    SGLang's signed ones and byte hashes each come back to a new owner exactly, a removed
    block's field is gone, and its removals by those hashes apply."""
    hashes: list[int | bytes] = [2**64 - 1, -(2**63), 7, b"\x00\xff" * 16, 2**63, -1]
    first = EventWriter(client, block_size=16)
    await first.adopt(domain)
    first.apply(domain, BlockStored(hashes, None, PROMPT, 16, GPU, SALT))
    first.apply(domain, BlockRemoved([hashes[-1]], GPU))
    await first.flush()
    assert await client.hlen(map_key(replica_id(domain))) == 5
    second = EventWriter(client, block_size=16)
    await second.adopt(domain)
    assert second.num_blocks(domain) == 5
    second.apply(domain, BlockRemoved(hashes[1:5], GPU))
    await second.flush()
    assert second.stats.unknown_removals == 0 and second.num_blocks(domain) == 1
    assert await client.hlen(map_key(replica_id(domain))) == 1
    reader = EventReader(client)
    assert (await reader.lookup(precise_keys(PROMPT, SALT, 16)))[domain].depth == 1


async def test_a_lease_has_one_holder_and_passes_on_when_it_expires(
    client: AnyRedis, domain: str
) -> None:
    a, b = Leases(client, "gateway-a", 0.3), Leases(client, "gateway-b", 0.3)
    assert await a.acquire(domain)
    assert not await b.acquire(domain)
    assert not await b.renew(domain)
    assert await a.renew(domain)
    assert await a.holder(domain) == "gateway-a"
    deadline = asyncio.get_running_loop().time() + 5
    while not await b.acquire(domain):  # a stopped renewing: its lease runs out
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.05)
    assert not await a.renew(domain)
    await a.release(domain)  # not a's to release
    assert await b.holder(domain) == "gateway-b"
    await b.release(domain)
    assert await a.holder(domain) is None


async def test_domains_hash_names_each_domain_and_its_epoch(client: AnyRedis, domain: str) -> None:
    writer = EventWriter(client, block_size=16)
    await writer.adopt(domain)
    writer.apply(domain, AllBlocksCleared())
    await writer.commit(domain, 1, wiped=True)
    value = await client.hget(DOMAINS_KEY, replica_id(domain))
    assert value == f"1|{domain}".encode()


async def test_a_long_chains_shared_lookup_has_the_time_its_walk_takes(
    client: AnyRedis, domain: str
) -> None:
    """Precise mode's shared lookup (`PreciseKeys`) of a 6,000-block agent prompt (96k tokens)
    behind a 200-µs base deadline: answered, with the default per-block allowance. (Redis once
    walked such a chain a block at a time, 10-40 ms, and a fixed few-ms deadline routed those
    turns on the prediction alone; prefix marks bisect it now, and the allowance stays for the
    walk past the marks: a turn's speculative blocks, what follows a hole.)"""
    from gateway.settings import DEFAULT_REDIS_DEADLINE_PER_BLOCK_S

    ids = list(range(100_000, 100_000 + 16 * 6_000))
    await owned(client, domain, 10_000_000, ids)
    reader = EventReader(client)
    await reader.refresh()
    precise = PreciseKeys(PromptTokens(ModelTokenizer(MODEL_DIR)), EventIndex(), None)
    precise.shared = reader
    precise.shared_deadline.base_s = 200e-6
    precise.shared_deadline.per_block_s = DEFAULT_REDIS_DEADLINE_PER_BLOCK_S
    for _ in range(3):
        found = await precise._shared_lookup(reader, precise_keys(ids, SALT, 16))
        assert found.matches is not None and found.matches[domain].depth == 6_000
    assert precise.stats.shared_failures == 0


async def _shared_lookups_past_a_busy_loop(url: str, rounds: int) -> PreciseStats:
    """Each round: precise mode's shared lookup (5-ms deadline) is sent, Redis answers it (its
    `INFO commandstats` counts the call: one server's, or a cluster's masters'), then the loop
    is held 10 ms before it reads the reply. Returns the stats of the rounds whose reply was
    still unread at the hog."""
    domain = f"http://{uuid.uuid4().hex[:8]}:8000"
    client = await open_redis(url)  # a cluster when the server says so
    stats = CommandCalls(url)
    await owned(client, domain, 100, PROMPT)
    reader = EventReader(client)
    precise = PreciseKeys(PromptTokens(ModelTokenizer(MODEL_DIR)), EventIndex(), None)
    precise.shared, precise.shared_deadline.base_s = reader, 0.005
    keys = precise_keys(PROMPT, SALT, 16)
    try:
        for _ in range(100):  # the lane open, the script loaded (bounded: a loaded machine)
            if (await precise._shared_lookup(reader, keys)).matches:
                break
        else:
            raise AssertionError("the shared lookup never answered")
        counted = PreciseStats()
        for _ in range(20 * rounds):  # bounded: a round whose reply was read early is redone
            calls = stats()
            task = asyncio.create_task(precise._shared_lookup(reader, keys))
            await until_ran(stats, calls)
            unread = not task.done()  # not answered in one of those yields
            failures = precise.stats.shared_failures
            hog(0.010)  # the reply is in the socket; the loop is busy past the deadline
            found = await task
            if unread:
                counted.shared_lookups += 1
                counted.shared_failures += precise.stats.shared_failures - failures
                assert found.matches is None or found.matches[domain].depth == 6
                if counted.shared_lookups == rounds:
                    break
        assert counted.shared_lookups == rounds, "the replies were read before the hog"
        assert reader.lane.stats.late_answers >= 1  # one at least was read past its deadline
        return counted
    finally:
        stats.close()
        await reader.close()
        await client.aclose()


@pytest.mark.parametrize("topology", ["redis", "cluster"])
def test_a_shared_lookup_answered_while_the_loop_was_busy_is_not_a_fallback(
    fresh_redis: RedisServer, redis_cluster_url: str, topology: str
) -> None:
    """The shared event lookup's deadline is Redis's time (its own connection,
    `cachemap.redis.lookups`; a cluster's, one per master: `cachemap.redis.node_lanes`): a
    reply that is in the socket while the gateway runs other requests' CPU came in time, and
    is read past the deadline (a late answer) instead of failing. As wall time around the
    await, the loop's lag counted against Redis (the two-gateway bench: a fifth to two thirds
    of the lookups routed on the prediction; a cluster's until issue 39 item 1). Run on
    uvloop, as `kvgate serve` is: it fires due timers before it polls the socket."""
    url = fresh_redis.url if topology == "redis" else redis_cluster_url
    stats = uvloop.run(_shared_lookups_past_a_busy_loop(url, 5))
    assert (stats.shared_lookups, stats.shared_failures) == (5, 0)


async def test_a_paused_redis_still_costs_a_shared_lookup_its_deadline(
    fresh_redis: RedisServer, domain: str
) -> None:
    """What the deadline protects: Redis sends nothing, so the lookup fails at its deadline
    (routed on the prediction) instead of waiting for Redis."""
    client, pauser = await open_redis(fresh_redis.url), await open_redis(fresh_redis.url)
    reader = EventReader(client)
    precise = PreciseKeys(PromptTokens(ModelTokenizer(MODEL_DIR)), EventIndex(), None)
    precise.shared, precise.shared_deadline.base_s = reader, 0.005
    keys = precise_keys(PROMPT, SALT, 16)
    try:
        await precise._shared_lookup(reader, keys)  # the lane open, the script loaded
        failures = precise.stats.shared_failures
        await pauser.execute_command("CLIENT", "PAUSE", 3000, "ALL")
        started = time.perf_counter()
        found = await precise._shared_lookup(reader, keys)
        assert found.matches is None and precise.stats.shared_failures == failures + 1
        assert time.perf_counter() - started < 1.0  # its deadline, not the pause
    finally:
        with contextlib.suppress(Exception):
            await pauser.execute_command("CLIENT", "UNPAUSE")
        await pauser.aclose()
        await reader.close()
        await client.aclose()


async def test_a_lane_whose_connection_the_pool_closed_reconnects_and_gives_it_back(
    fresh_redis: RedisServer, domain: str
) -> None:
    """The lookups' connection is the client pool's: when the pool disconnects everything
    (the directory's breaker probe does, after an outage), the next lookup opens another and
    the closed one goes back to the pool, so outages do not pile up connections in use."""
    client = await open_redis(fresh_redis.url)
    try:
        await owned(client, domain, 100, PROMPT)
        reader = EventReader(client)
        keys = precise_keys(PROMPT, SALT, 16)
        pool = client.connection_pool
        for _ in range(3):
            assert (await reader.lookup(keys))[domain].depth == 6
            await pool.disconnect()
        assert (await reader.lookup(keys))[domain].depth == 6
        assert reader.lane is not None and reader.lane.stats.connects == 4
        assert len(pool._in_use_connections) == 1  # the lane's open one
        await reader.close()
    finally:
        await client.aclose()


async def test_a_shared_lookup_queued_behind_writes_within_the_cap_is_answered(
    fresh_redis: RedisServer, domain: str
) -> None:
    """Issue 39: shared event-index lookups answered only 25% / 15% / 1% at 2 / 4 gateways /
    Cluster under load: they queue behind the owners' event writes, and a fixed 5-ms deadline
    failed those Redis answered in 6-15 ms. The deadline follows twice the lane's recent p99
    round trip (Redis's time, written to parsed: `gateway.deadline`), within its cap:
    while another client holds Redis 12 ms a call, back to back, every lookup after the first
    round trips taught it is answered (with the fixed deadline 28 of 30 failed)."""
    client, busy = await open_redis(fresh_redis.url), await open_redis(fresh_redis.url)
    await owned(client, domain, 100, PROMPT)
    reader = EventReader(client)
    precise = PreciseKeys(PromptTokens(ModelTokenizer(MODEL_DIR)), EventIndex(), None)
    precise.share(reader)  # the lane's round trips teach the deadline
    precise.shared_deadline.base_s, precise.shared_deadline.cap_s = 0.005, 0.1
    keys = precise_keys(PROMPT, SALT, 16)
    try:
        async with RedisHolder(busy, 12_000) as holder:  # Redis is being held
            for _ in range(24):  # taught: the failed ones' replies are read and timed too
                await precise._shared_lookup(reader, keys)
            assert precise.shared_deadline.p99_s > 0.005  # Redis answered slower than the base
            failures, started = precise.stats.shared_failures, holder.calls
            for _ in range(30):
                found = await precise._shared_lookup(reader, keys)
                assert found.matches is None or found.matches[domain].depth == 6
            assert holder.calls - started >= 10  # the lookups did queue behind its calls
        assert precise.stats.shared_failures - failures == 0
    finally:
        await reader.close()
        await busy.aclose()
        await client.aclose()


@pytest.mark.parametrize("reader", ["not started", "reading"])
async def test_a_lane_disconnected_mid_call_fails_the_call_and_gives_its_connection_back_once(
    fresh_redis: RedisServer, reader: str
) -> None:
    """The breaker's probe disconnects the lane after an outage, often with given-up lookups
    still being read. A reader cancelled before its first step never ran its clean-up: the
    calls in flight were never answered (a call without a deadline waited forever) and the
    lane kept the dead task as its reader, so no later reply was read. A reader cancelled while
    reading gave the connection back to the client's pool, and `disconnect` gave it back again:
    when another task of the gateway took it from the pool in between, the second give-back
    put it back in the pool while in use, and the pool lent one connection to two users (their
    replies crossed). Now the call fails at once and the connection goes back once, after its
    reader stopped; the lane then answers on a new connection."""
    client = await open_redis(fresh_redis.url)
    pool = client.connection_pool
    events = EventReader(client)
    lane = events.lane
    assert isinstance(lane, LookupLane)
    try:
        held = lane.command(b"", ("EVAL", HOLD, 0, 200_000))  # Redis answers in 200 ms
        for _ in range(10_000):  # bounded: until it is written (the connection open)
            await asyncio.sleep(0)
            if lane.in_flight:
                break
        for _ in range(10 if reader == "reading" else 0):
            await asyncio.sleep(0)  # the reader's first steps: it waits for the reply
        assert lane.in_flight == 1 and not held.done() and not pool._available_connections
        taken: list[Any] = []

        async def take_it_when_given_back() -> None:  # another request's Redis call
            for _ in range(100_000):
                if pool._available_connections:
                    taken.append(await pool.get_connection())
                    return
                await asyncio.sleep(0)

        taker = asyncio.create_task(take_it_when_given_back())
        await lane.disconnect()
        await asyncio.wait_for(taker, 5)
        with pytest.raises(LaneClosed):
            await asyncio.wait_for(held, 5)
        assert len(taken) == 1
        assert taken[0] not in pool._available_connections  # in use: not to be lent
        other = await pool.get_connection()
        assert other is not taken[0]
        await pool.release(other)
        await pool.release(taken[0])
        answer = await asyncio.wait_for(lane.command(b"", ("PING",), deadline_s=1.0), 5)
        assert answer in (b"PONG", "PONG", True)
        await events.close()
    finally:
        await client.aclose()
