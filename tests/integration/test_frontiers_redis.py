"""Eviction frontiers over the shared event index (`cachemap.redis.frontiers`): the owner of a
domain keeps its eviction order from the events and publishes it; another gateway reads it and
sends its placements back — against a real redis-server and a real 3-master Redis Cluster.
Domains are unique per test, so the tests share the servers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from cachemap.events import (
    GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheEvent,
    EventIndex,
    precise_keys,
)
from cachemap.recency import DomainRecency
from cachemap.redis.client import AnyRedis
from cachemap.redis.events import EventReader, EventWriter, _Owned
from cachemap.redis.frontiers import (
    FRONTIER_KEY,
    PUBLISH_EVERY_S,
    VERSIONS_KEY,
    SharedFrontiers,
    pack,
    unpack,
)
from cachemap.redis.schema import replica_id
from tests.integration.test_event_index_redis import client, domain

__all__ = ["client", "domain"]  # the fixtures (Redis and Cluster; a unique domain), by name

pytestmark = pytest.mark.redis

SALT = "tenant-salt"
OLD = list(range(1000, 1000 + 16 * 6))  # six 16-token blocks, stored first
NEW = list(range(9000, 9000 + 16 * 2))  # two blocks of another conversation, stored later


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def stored(first: int, ids: list[int]) -> BlockStored:
    return BlockStored([first + i for i in range(len(ids) // 16)], None, ids, 16, GPU, SALT)


async def owned_with_two_runs(
    client: AnyRedis, domain: str, clock: Clock
) -> tuple[EventWriter, SharedFrontiers]:
    """An owner whose domain holds OLD (stored at t=1000) and NEW (t=1010), written."""
    writer = EventWriter(client, block_size=16, track_recency=True, clock=clock)
    await writer.adopt(domain)
    writer.apply(domain, stored(100, OLD))
    clock.now = 1010.0
    writer.apply(domain, stored(200, NEW))
    await writer.commit(domain, 2, wiped=False)
    await writer.flush()
    return writer, SharedFrontiers(client, EventReader(client), writer, clock)


async def another_gateway(client: AnyRedis, clock: Clock) -> SharedFrontiers:
    events = EventReader(client)
    await events.refresh()  # the epochs (a lookup reads them too)
    return SharedFrontiers(client, events, None, clock)


def test_a_published_frontier_reads_back_as_written() -> None:
    runs = [(6, 1000.5), (2, 1010.25)]
    published = unpack(pack(3, 8, "http://a:8000#1", runs))
    assert (published.epoch, published.num_blocks, published.name) == (3, 8, "http://a:8000#1")
    assert published.runs == tuple(runs)
    with pytest.raises(ValueError):
        unpack(pack(3, 8, "x", runs)[:-1])


async def test_another_gateway_reads_the_owners_order(client: AnyRedis, domain: str) -> None:
    clock = Clock(1000.0)
    writer, owner = await owned_with_two_runs(client, domain, clock)
    other = await another_gateway(client, clock)
    assert not other.live(domain)  # nothing published yet: no frontier
    assert other.eviction_runs(domain, 8, 1020.0) == ()
    await owner.round()  # publishes
    await other.round()  # fetches
    clock.now = 1020.0
    assert other.live(domain) and other.num_blocks(domain) == 8
    assert other.eviction_runs(domain, 8, 1020.0) == ((6, 20.0), (2, 10.0))
    assert other.eviction_runs(domain, 7, 1020.0) == ((6, 20.0), (1, 10.0))  # to the depth
    assert owner.eviction_runs(domain, 8, 1020.0) == writer.eviction_runs(domain, 8, 1020.0)
    assert owner.published == 1
    await owner.round()  # nothing moved: nothing published again
    assert owner.published == 1


async def test_another_gateways_placement_moves_the_owners_order(
    client: AnyRedis, domain: str
) -> None:
    clock = Clock(1000.0)
    writer, owner = await owned_with_two_runs(client, domain, clock)
    other = await another_gateway(client, clock)
    clock.now = 1030.0
    # the other gateway places a request continuing OLD there: its six blocks are used now
    assert other.touch(domain, precise_keys(OLD, SALT, 16), clock.now) == 0  # sent, not applied
    await other.close()  # the touch's write is done
    assert other.touches_sent == 1
    assert writer.eviction_runs(domain, 8, 1030.0)[0] == (6, 30.0)  # not applied yet
    await owner.round()
    assert owner.touches_applied == 1
    await other.round()
    # NEW (idle 20 s) is next evicted now, then OLD (used now)
    assert other.eviction_runs(domain, 8, 1030.0) == ((2, 20.0), (6, 0.0))
    # a placement on a domain owned here moves the order at once
    clock.now = 1040.0
    assert owner.touch(domain, precise_keys(NEW, SALT, 16), clock.now) == 2
    assert writer.eviction_runs(domain, 8, 1040.0) == ((6, 10.0), (2, 0.0))


async def test_a_wiped_domain_has_no_frontier_until_its_new_epoch_is_published(
    client: AnyRedis, domain: str
) -> None:
    clock = Clock(1000.0)
    writer, owner = await owned_with_two_runs(client, domain, clock)
    other = await another_gateway(client, clock)
    await owner.round()
    await other.round()
    assert other.num_blocks(domain) == 8
    writer.apply(domain, AllBlocksCleared())
    await writer.commit(domain, 3, wiped=True)  # the new epoch is in Redis
    await other.events.refresh()  # (as the next lookup reads it)
    assert not other.live(domain)  # the old order is of the wiped epoch: never read
    assert other.num_blocks(domain) == 0 and other.eviction_runs(domain, 8, 1020.0) == ()
    await other.round()  # fetched before the owner published: still nothing
    assert not other.live(domain)
    await owner.round()
    await other.round()
    assert other.live(domain) and other.num_blocks(domain) == 0
    assert other.eviction_runs(domain, 8, 1020.0) == ()


async def test_a_malformed_frontier_is_counted_and_skipped(client: AnyRedis, domain: str) -> None:
    clock = Clock(1000.0)
    _, owner = await owned_with_two_runs(client, domain, clock)
    other = await another_gateway(client, clock)
    rid = replica_id(domain)
    await client.hset(FRONTIER_KEY, rid, b"\x01\x02")
    await client.hset(VERSIONS_KEY, rid, b"bad")
    await other.round()
    assert other.malformed == 1 and not other.live(domain)
    await owner.round()  # the owner's next publish replaces it
    await other.round()
    assert other.live(domain) and other.num_blocks(domain) == 8


chains = st.lists(
    st.tuples(
        st.sampled_from(["store", "remove", "touch", "wipe"]),
        st.integers(0, 5),  # a conversation
        st.integers(1, 4),  # its blocks
    ),
    max_size=40,
)


@settings(max_examples=100, deadline=None)
@given(chains)
def test_an_owners_order_is_the_in_process_indexs(ops: list[tuple[str, int, int]]) -> None:
    """The same events and placements give the shared owner the order the in-process index
    keeps (no Redis is reached: nothing is flushed)."""
    clock = Clock(0.0)
    local = EventIndex(track_recency=True, clock=clock)
    writer = EventWriter(Redis(), block_size=16, track_recency=True, clock=clock)
    writer._owned["d"] = _Owned(replica_id("d"), recency=DomainRecency())  # adopted, empty
    for step, (op, conversation, n) in enumerate(ops):
        clock.now = 2.0 * step
        tokens = [conversation * 1000 + i for i in range(16 * n)]
        first = conversation * 100
        if op == "store":
            event: CacheEvent = stored(first, tokens)
        elif op == "remove":
            event = BlockRemoved([first + n - 1], GPU)
        elif op == "wipe":
            event = AllBlocksCleared()
        else:
            keys = precise_keys(tokens, SALT, 16)
            assert writer.touch("d", keys, clock.now) == local.touch("d", keys, clock.now)
            continue
        local.apply("d", event)
        writer.apply("d", event)
        assert writer.num_blocks("d") == local.num_blocks("d")
    now = 2.0 * len(ops)
    assert writer.eviction_runs("d", 10_000, now) == local.eviction_runs("d", 10_000, now)


async def test_a_moving_order_is_published_at_most_every_half_second_a_wipe_at_once(
    client: AnyRedis, domain: str
) -> None:
    clock = Clock(1000.0)
    writer, owner = await owned_with_two_runs(client, domain, clock)
    await owner.round()
    assert owner.published == 1
    writer.touch(domain, precise_keys(OLD, SALT, 16), clock.now)  # the order moves
    clock.now += PUBLISH_EVERY_S / 2
    await owner.round()
    assert owner.published == 1  # too soon
    clock.now += PUBLISH_EVERY_S / 2
    await owner.round()
    assert owner.published == 2
    writer.apply(domain, AllBlocksCleared())  # a new epoch: published at the next round
    await owner.round()
    assert owner.published == 3
    await writer.close()  # the wipe's background flush, ended before the client closes
