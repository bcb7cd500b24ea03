"""A feed writing the shared event index (a real redis-server): a new owner resumes from the
seq its predecessor wrote, a restart (seq going back) is out of Redis when the batch's
`receive` returns — before any routing decision that follows it —, Redis away stops nothing,
and an owner writes its domain back when Redis lost it."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import zmq.asyncio
from redis import exceptions as redis_errors

from cachemap.events import BlockStored, EventIndex, precise_keys
from cachemap.redis.client import AnyRedis, open_redis
from cachemap.redis.events import EventReader, EventWriter, Leases
from gateway.events.intake import EventIntake, EventsConfig, Feed, FeedConfig
from loadgen.harness.processes import free_port
from loadgen.harness.redis_servers import RedisServer

pytestmark = pytest.mark.redis
SALT = "s"
PROMPT = list(range(300, 300 + 16 * 4))
MORE = list(range(900, 900 + 16 * 2))


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[AnyRedis]:
    redis = await open_redis(redis_url, cluster=False)
    yield redis
    await redis.aclose()


def batch(*events: dict[str, Any]) -> bytes:
    payload: bytes = msgspec.msgpack.encode([time.time(), list(events), 0])
    return payload


def stored(first: int, ids: list[int], parent: int | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": [first + i for i in range(len(ids) // 16)],
        "parent_block_hash": parent,
        "token_ids": ids,
        "block_size": 16,
        "medium": "GPU",
    }
    if parent is None:
        event["extra_keys"] = [[SALT]]
    return event


def feed_of(writer: EventWriter, domain: str, ctx: zmq.asyncio.Context, seq: int | None) -> Feed:
    config = FeedConfig(domain, 0, domain, f"inproc://{uuid.uuid4().hex}", None, "")
    return Feed(config, writer, ctx, next_seq=seq, commit=writer.commit)


async def test_a_new_owner_resumes_and_a_restart_is_out_of_redis_on_return(
    client: AnyRedis,
) -> None:
    domain = f"http://{uuid.uuid4().hex[:8]}:8000"
    ctx = zmq.asyncio.Context()
    reader = EventReader(client)
    keys = precise_keys(PROMPT + MORE, SALT, 16)
    first = EventWriter(client, block_size=16)
    feed = feed_of(first, domain, ctx, await first.adopt(domain))
    await feed.receive(0, batch(stored(10, PROMPT)))
    await feed.receive(1, batch())
    await first.flush()
    feed.close()  # the first owner dies here: nothing released
    second = EventWriter(client, block_size=16)
    resumed = feed_of(second, domain, ctx, await second.adopt(domain))
    assert resumed.next_seq == 2
    await resumed.receive(2, batch(stored(20, MORE, parent=13)))  # its parent in the first's map
    assert resumed.stats.gaps == 0 and second.stats.unresolved_parents == 0
    await second.flush()
    assert (await reader.lookup(keys))[domain].depth == 6
    # the engine restarted: its seq starts again from 0 (lower than expected)
    await resumed.receive(0, batch(stored(30, MORE[:16], parent=None)))
    assert resumed.stats.restarts == 1
    assert domain not in await reader.lookup(keys)  # no flush needed: the commit waited
    assert second.num_blocks(domain) == 1
    resumed.close()
    await first.close()
    await second.close()
    ctx.term()


async def test_redis_away_neither_stops_the_feed_nor_loses_its_pending_writes(
    fresh_redis: RedisServer,
) -> None:
    domain = f"http://{uuid.uuid4().hex[:8]}:8000"
    redis = await open_redis(fresh_redis.url, cluster=False, timeout_s=0.2)
    ctx = zmq.asyncio.Context()
    writer = EventWriter(redis, block_size=16)
    feed = feed_of(writer, domain, ctx, await writer.adopt(domain))
    fresh_redis.stop()
    # a wipe's commit waits for its flush: the flush fails, the batch is still taken
    await feed.receive(0, batch({"type": "AllBlocksCleared"}, stored(10, PROMPT)))
    assert feed.next_seq == 1 and writer.flush_errors > 0
    assert writer.num_blocks(domain) == 4
    fresh_redis.start()  # back (empty: no persistence); what was pending is written
    await writer.flush()
    reader = EventReader(redis)
    assert (await reader.lookup(precise_keys(PROMPT, SALT, 16)))[domain].depth == 4
    feed.close()
    await writer.close()
    await redis.aclose()
    ctx.term()


async def test_an_owner_writes_its_domain_back_when_redis_lost_it(
    fresh_redis: RedisServer,
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    redis = await open_redis(fresh_redis.url, cluster=False, timeout_s=0.2)
    writer = EventWriter(redis, block_size=16)
    config = EventsConfig(endpoints={url: f"tcp://127.0.0.1:{free_port()}"})
    intake = EventIntake(config, EventIndex(), lambda: [url])
    intake.share(writer, Leases(redis, "me", 5.0), 5.0)
    await intake.own()
    assert intake.owned() == [url]
    writer.apply(url, BlockStored([1, 2, 3, 4], None, PROMPT, 16, cache_salt=SALT))
    await writer.flush()
    fresh_redis.stop()
    fresh_redis.start()  # no persistence: the index, the map and the lease are gone
    with contextlib.suppress(redis_errors.ConnectionError):
        await redis.ping()  # the pooled connection died with the server
    reader = EventReader(redis)
    keys = precise_keys(PROMPT, SALT, 16)
    assert url not in await reader.lookup(keys)
    await intake.own()  # the renewal finds no lease and nobody holding it: retaken
    assert intake.owned() == [url]
    await writer.flush()
    assert (await reader.lookup(keys))[url].depth == 4
    await intake.close()
    await redis.aclose()


async def test_one_engines_long_block_hash_drops_no_other_engines_writes(
    client: AnyRedis,
) -> None:
    """Issue 45 item 7: two engines' feeds write through one owner; the second publishes a
    block hash of 300 bytes (a field no map can hold). Its batch is malformed (counted, not
    applied); the first engine's blocks, queued before it in the same flush, reach Redis."""
    honest, hostile = (f"http://{uuid.uuid4().hex[:8]}:8000" for _ in range(2))
    ctx = zmq.asyncio.Context()
    writer = EventWriter(client, block_size=16)
    good = feed_of(writer, honest, ctx, await writer.adopt(honest))
    bad = feed_of(writer, hostile, ctx, await writer.adopt(hostile))
    await good.receive(0, batch(stored(10, PROMPT)))
    long_hash = stored(10, MORE)
    long_hash["block_hashes"] = [b"\xab" * 300, b"\xac" * 16]
    await bad.receive(0, batch(long_hash))
    await writer.flush()
    reader = EventReader(client)
    assert honest in await reader.lookup(precise_keys(PROMPT, SALT, 16))
    assert (await reader.lookup(precise_keys(PROMPT, SALT, 16)))[honest].depth == 4
    assert bad.stats.malformed == 1 and writer.num_blocks(hostile) == 0
    assert writer.flush_errors == 0
    good.close()
    bad.close()
    await writer.close()
    ctx.term()


async def test_a_flush_that_cannot_be_built_keeps_every_domains_writes(
    client: AnyRedis,
) -> None:
    """Item 7, the writer's side: a block the pipeline cannot carry (a hash too long for the
    map, applied past the decoder) fails its own domain's part of the flush only. The other
    domain's writes land; the failed domain's stay pending (nothing is dropped while the log
    says "kept, retried")."""
    honest, broken = (f"http://{uuid.uuid4().hex[:8]}:8000" for _ in range(2))
    writer = EventWriter(client, block_size=16)
    await writer.adopt(honest)
    await writer.adopt(broken)
    writer.apply(honest, BlockStored([1, 2, 3, 4], None, PROMPT, 16, cache_salt=SALT))
    writer.apply(broken, BlockStored([b"\x01" * 300], None, MORE[:16], 16, cache_salt=SALT))
    with pytest.raises(ValueError, match="map"):
        await writer.flush()
    reader = EventReader(client)
    assert (await reader.lookup(precise_keys(PROMPT, SALT, 16)))[honest].depth == 4
    assert writer.pending_blocks() == 1 and writer.flush_errors >= 1
    await writer.close()
