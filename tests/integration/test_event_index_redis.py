"""The event index in Redis: one owner writes what the events say (`EventWriter`), any gateway
reads it (`EventReader`) — against a real redis-server and a real 3-master Redis Cluster.
Domains are unique per test, so the tests share the servers."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from cachemap.events import CPU, GPU, AllBlocksCleared, BlockRemoved, BlockStored, precise_keys
from cachemap.redis.client import AnyRedis, open_redis
from cachemap.redis.event_scripts import DOMAINS_KEY, feed_key, map_key
from cachemap.redis.events import EventReader, EventWriter, Leases
from cachemap.redis.schema import block_keys, replica_id

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
    # the reader still holds the old epoch: the pipelined epochs tell it, it retries
    assert domain not in await reader.lookup(keys)
    assert reader.retries == retries + 1
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
    """Precise mode's shared lookup (`PreciseKeys`) of a 6,000-block agent prompt (96k tokens):
    Redis walks it a block at a time, 10-40 ms here, so a fixed few-ms deadline routed such
    turns on the prediction alone (a two-gateway bench: 62% of lookups failed). With the
    default per-block allowance Redis answers it, even behind a 200-µs base deadline. (Without
    it the outcome is a race — a timeout, or redis-py finishing the read it was cancelled in —
    so this test pins the allowance's side only; its directory twin in
    tests/integration/test_routing_directory.py pins both.)"""
    from cachemap.events import EventIndex
    from cachemap.tokenizer import ModelTokenizer
    from gateway.events.precise import PreciseKeys, PromptTokens
    from gateway.settings import DEFAULT_REDIS_DEADLINE_PER_BLOCK_S
    from loadgen.engine.tokenizer import MODEL_DIR

    ids = list(range(100_000, 100_000 + 16 * 6_000))
    writer = EventWriter(client, block_size=16)
    await writer.adopt(domain)
    writer.apply(domain, stored(10_000_000, ids))
    await writer.commit(domain, 1, wiped=False)
    await writer.flush()
    reader = EventReader(client)
    await reader.refresh()
    precise = PreciseKeys(PromptTokens(ModelTokenizer(MODEL_DIR)), EventIndex(), None)
    precise.shared = reader
    precise.shared_deadline_s = 200e-6
    precise.shared_deadline_per_block_s = DEFAULT_REDIS_DEADLINE_PER_BLOCK_S
    for _ in range(3):
        found = await precise._shared_lookup(reader, precise_keys(ids, SALT, 16))
        assert found.matches is not None and found.matches[domain].depth == 6_000
    assert precise.stats.shared_failures == 0
