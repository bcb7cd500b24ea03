"""Speculative entries in the shared event index (a real redis-server): a placement at one
gateway is matched by every gateway's lookup as a GPU block until its ttl (Redis's clock) or a
wipe of its domain; what the index already holds is matched first."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import zmq.asyncio

from cachemap.events import Match, precise_keys
from cachemap.redis.client import AnyRedis, open_redis
from cachemap.redis.events import SPECULATE_CHUNK, EventReader, EventWriter
from tests.gateway.events.test_intake_shared import PROMPT, SALT, batch, feed_of, stored

pytestmark = pytest.mark.redis


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[AnyRedis]:
    redis = await open_redis(redis_url, cluster=False)
    yield redis
    await redis.aclose()


@asynccontextmanager
async def fed_domain(client: AnyRedis) -> AsyncIterator[tuple[str, EventWriter, Any]]:
    """A new engine domain whose KV events feed an `EventWriter` on `client` over a real ZMQ
    socket: (its URL, the writer, the feed); the feed, the writer and the context are closed
    after."""
    domain = f"http://{uuid.uuid4().hex[:8]}:8000"
    ctx = zmq.asyncio.Context()
    writer = EventWriter(client, block_size=16)
    feed = feed_of(writer, domain, ctx, await writer.adopt(domain))
    try:
        yield domain, writer, feed
    finally:
        feed.close()
        await writer.close()
        ctx.term()


async def test_a_placement_is_matched_by_another_reader_until_a_wipe(client: AnyRedis) -> None:
    async with fed_domain(client) as (domain, writer, feed):
        await feed.receive(0, batch(stored(10, PROMPT[:32])))  # the engine holds 2 of 4 blocks
        await writer.flush()
        here, there = EventReader(client), EventReader(client)
        keys = precise_keys(PROMPT, SALT, 16)
        assert (await here.lookup(keys))[domain] == Match(2, 0, 0)
        assert here.speculate(domain, keys[2:], ttl_s=60.0)  # the placement: the 2 blocks past it
        await here.settle()
        assert here.speculated == 2 and here.speculate_failures == 0
        assert (await there.lookup(keys))[domain] == Match(4, 0, 2)
        assert not there.speculate("http://never-seen:1", keys, ttl_s=60.0)  # no events: not sent
        # a wipe: the entries were of the old epoch, they match nothing now
        await feed.receive(1, batch({"type": "AllBlocksCleared"}))
        assert domain not in await there.lookup(keys)


async def redis_ms(client: AnyRedis) -> int:
    seconds, micros = await client.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def test_an_entry_ends_with_its_ttl_on_redis_clock(client: AnyRedis) -> None:
    async with fed_domain(client) as (domain, writer, feed):
        await feed.receive(0, batch())  # the domain's events flow: it has an epoch
        await writer.flush()
        reader = EventReader(client)
        await reader.refresh()
        keys = precise_keys(PROMPT, SALT, 16)
        start_ms = await redis_ms(client)
        assert reader.speculate(domain, keys, ttl_s=0.5)
        await reader.settle()
        assert (await reader.lookup(keys))[domain] == Match(4, 0, 4)
        # its expiry is Redis's time + 0.5 s: once Redis's clock passed it, no lookup matches it
        # (the clock is read, not slept on: a bounded number of round trips)
        for _ in range(100_000):
            if await redis_ms(client) > start_ms + 600:
                break
        assert domain not in await reader.lookup(keys)


def removed(first: int, count: int) -> dict[str, object]:
    return {"type": "BlockRemoved", "block_hashes": [first + i for i in range(count)]}


async def test_the_confirming_event_ends_the_entry_so_an_eviction_unclaims_the_block(
    client: AnyRedis,
) -> None:
    """The placement's entry is confirmed by the engine's BlockStored, then the engine evicts
    the blocks well within the entry's ttl: no lookup may still claim them (the confirmation
    ended the speculative claim; before, it stood until its ttl ran out)."""
    async with fed_domain(client) as (domain, writer, feed):
        await feed.receive(0, batch(stored(10, PROMPT[:32])))
        await writer.flush()
        reader = EventReader(client)
        keys = precise_keys(PROMPT, SALT, 16)
        assert (await reader.lookup(keys))[domain] == Match(2, 0, 0)
        assert reader.speculate(domain, keys[2:], ttl_s=60.0)
        await reader.settle()
        assert (await reader.lookup(keys))[domain] == Match(4, 0, 2)
        await feed.receive(1, batch(stored(12, PROMPT[32:], parent=11)))  # confirmed
        await writer.flush()
        assert (await reader.lookup(keys))[domain] == Match(4, 0, 0)
        await feed.receive(2, batch(removed(12, 2)))  # evicted, 59 s before the ttl
        await writer.flush()
        assert (await reader.lookup(keys))[domain] == Match(2, 0, 0)


async def test_a_placement_written_after_its_confirmation_claims_nothing_past_an_eviction(
    client: AnyRedis,
) -> None:
    """The speculative write is in the background: the engine's event may be in the index
    before it lands. A block the domain already holds at its epoch gets no entry, so the
    eviction that follows leaves nothing claiming it."""
    async with fed_domain(client) as (domain, writer, feed):
        await feed.receive(0, batch(stored(10, PROMPT)))
        await writer.flush()
        reader = EventReader(client)
        keys = precise_keys(PROMPT, SALT, 16)
        assert (await reader.lookup(keys))[domain] == Match(4, 0, 0)
        assert reader.speculate(domain, keys[2:], ttl_s=60.0)  # late: read before the event
        await reader.settle()
        await feed.receive(1, batch(removed(12, 2)))
        await writer.flush()
        assert (await reader.lookup(keys))[domain] == Match(2, 0, 0)


async def test_a_long_placement_is_written_in_bounded_calls_a_few_a_pipeline(
    client: AnyRedis,
) -> None:
    """An agent's 100k-token prompt is ~6,000 blocks past what the domain holds: one SPECULATE
    call of them held Redis ~41 ms (quiet) and every lookup queued behind it timed out (issue
    39). Now calls of SPECULATE_CHUNK blocks, a few a pipeline, the pipelines one after another:
    the same entries."""
    async with fed_domain(client) as (domain, writer, feed):
        await feed.receive(0, batch())  # the domain's events flow: it has an epoch
        await writer.flush()
        reader = EventReader(client)
        await reader.refresh()
        keys = precise_keys(list(range(6_000 * 16)), SALT, 16)
        await client.config_resetstat()
        assert reader.speculate(domain, keys, ttl_s=60.0)
        await reader.settle()
        evalsha = (await client.info("commandstats"))["cmdstat_evalsha"]
        assert evalsha["calls"] - evalsha.get("failed_calls", 0) == -(-6_000 // SPECULATE_CHUNK)
        assert reader.speculated == 6_000 and reader.speculate_failures == 0
        assert (await reader.lookup(keys))[domain] == Match(6_000, 0, 6_000)


async def test_a_long_placement_on_a_cluster_is_matched_whole(redis_cluster_url: str) -> None:
    """The pipelines of `SPECULATE` calls on a cluster (each routed by its first key, the
    chain's slot): another reader matches every block."""
    client = await open_redis(redis_cluster_url, cluster=True)
    try:
        async with fed_domain(client) as (domain, writer, feed):
            await feed.receive(0, batch())
            await writer.flush()
            here, there = EventReader(client), EventReader(client)
            await here.refresh()
            await there.refresh()
            keys = precise_keys(list(range(1_000 * 16)), SALT, 16)
            assert here.speculate(domain, keys, ttl_s=60.0)
            await here.settle()
            assert here.speculated == 1_000 and here.speculate_failures == 0
            assert (await there.lookup(keys))[domain] == Match(1_000, 0, 1_000)
    finally:
        await client.aclose()
