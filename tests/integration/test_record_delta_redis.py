"""A record writes what changed (issue 39's tier CPU): the blocks its replica's lookup did not
find fresh in Redis, not the prefix Redis holds at the current generation and used within the
refresh interval — against a real redis-server, counting Redis's commands (`INFO
commandstats`), and through the gateway's directory facade, recorder and reconciliation."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import orjson
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from cachemap.directory import Held
from cachemap.keys import BlockHash, chain_hashes, root_hash
from cachemap.memory import MemoryDirectory, MemoryIndex
from cachemap.redis.client import open_redis
from cachemap.redis.directory import RECORD_REFRESH_S, RedisDirectory
from cachemap.redis.schema import replica_id
from gateway.api.openai.parse import parse_chat
from gateway.directory.routing import RoutingDirectory
from gateway.pipeline.reconcile import Reconciler
from gateway.request.state import ExchangeRecord, Routed
from gateway.request.tenant import Tenant
from gateway.request.usage import EngineUsage
from loadgen.harness.redis_servers import RedisServer
from router.types import Decision, RouteRequest
from tests.conftest import MODEL

pytestmark = pytest.mark.redis

T0 = 1_800_000_000.0


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def chain(n: int, name: str | None = None) -> list[BlockHash]:
    name = name or uuid.uuid4().hex
    return chain_hashes(name.encode() * (16 * n), root_hash(b"salt", name), 256)[:n]


def _calls(sync: redis.Redis) -> dict[str, int]:
    """Commands Redis ran since the last reset (a script's own calls counted), by name."""
    return {
        name.removeprefix("cmdstat_"): int(stat["calls"])
        for name, stat in sync.info("commandstats").items()
        if not name.startswith("cmdstat_config")
    }


@pytest.fixture
async def shared(fresh_redis: RedisServer) -> AsyncIterator[tuple[RedisDirectory, Clock]]:
    clock = Clock()
    d = RedisDirectory(await open_redis(fresh_redis.url), clock=clock)
    await d.refresh_generations()
    d.register(["r1", "r2"])
    yield d, clock
    await d.close()


async def _turn(d: RedisDirectory, replica: str, blocks: list[BlockHash]) -> Held | None:
    """A request's lookup, then its first token's record with what the lookup read."""
    held = (await d.lookup_full(blocks)).held.get(replica)
    await d.record(replica, blocks, held)
    return held


async def test_a_continuations_record_sends_no_command_for_its_fresh_held_prefix(
    shared: tuple[RedisDirectory, Clock], fresh_redis: RedisServer
) -> None:
    d, clock = shared
    blocks = chain(64)
    await _turn(d, "r1", blocks[:60])
    clock.now += 1.0
    held = (await d.lookup_full(blocks)).held["r1"]
    assert held == Held(60, d.meta.gen(replica_id("r1")), round(T0 * 1000))
    sync = redis.Redis.from_url(fresh_redis.url)
    try:
        sync.config_resetstat()
        await d.record("r1", blocks, held)
        calls = _calls(sync)
        # the 4 new blocks' HGET, HSET and PEXPIRE; the count's HGETs and HSETs: nothing for
        # the 60
        assert calls["hget"] == 4 + 2 and calls["pexpire"] == 4 and calls["hset"] <= 4 + 2, calls
        depth, used = (await d.lookup_detail(blocks))["r1"]
        assert depth == 64 and used == T0 + 1.0  # the deepest block's use: this record's
        clock.now += 1.0
        held = (await d.lookup_full(blocks)).held["r1"]
        assert held.depth == 64 and held.used_ms == round(T0 * 1000)  # the oldest of them
        sync.config_resetstat()
        await d.record("r1", blocks, held)  # everything held and fresh: not one command
        assert _calls(sync) == {}
    finally:
        sync.close()


async def test_a_stale_held_prefix_or_another_generation_is_written_again(
    fresh_redis: RedisServer,
) -> None:
    clock = Clock()
    # 6 new blocks a generation: the second chain below advances r1's
    d = RedisDirectory(await open_redis(fresh_redis.url), capacity_blocks=8, clock=clock)
    await d.refresh_generations()
    d.register(["r1"])
    sync = redis.Redis.from_url(fresh_redis.url)
    try:
        blocks = chain(5)
        await _turn(d, "r1", blocks[:4])
        clock.now += RECORD_REFRESH_S  # as old as the refresh interval: stale
        held = (await d.lookup_full(blocks)).held["r1"]
        sync.config_resetstat()
        await d.record("r1", blocks, held)
        # the whole chain (and the count's two reads), its held blocks used again now
        assert _calls(sync)["hget"] == 5 + 2
        assert (await d.lookup_full(blocks)).held["r1"].used_ms == round(clock.now * 1000)

        clock.now += 1.0
        held = (await d.lookup_full(blocks)).held["r1"]
        rid = replica_id("r1")
        gen = d.meta.gen(rid)
        await d.record("r1", chain(4))  # 4 + 1 + 4 new blocks: past 6, the generation advances
        assert d.meta.gen(rid) == gen + 1
        sync.config_resetstat()
        await d.record("r1", blocks, held)  # held at the generation before: rewritten
        assert _calls(sync)["hget"] == 5 + 2
        assert (await d.lookup_full(blocks)).held["r1"].gen == gen + 1
    finally:
        sync.close()
        await d.close()


async def test_a_recent_floor_shortens_the_refresh_interval(
    shared: tuple[RedisDirectory, Clock], fresh_redis: RedisServer
) -> None:
    """A replica whose engine evicts within seconds (its floor close to now) has its records
    written whole: a held block's last use in Redis may lag the engine's by the interval, and
    must stay small against how far back the engine keeps blocks."""
    d, clock = shared
    assert d.refresh_ms("r1", round(T0 * 1000)) == RECORD_REFRESH_S * 1000  # no floor
    blocks = chain(8)
    await _turn(d, "r1", blocks[:4])
    await d.expire("r1", T0 - 2.0)
    await d.refresh_generations()
    clock.now += 1.0
    assert d.refresh_ms("r1", round(clock.now * 1000)) == 3000 // 8
    held = (await d.lookup_full(blocks)).held["r1"]
    assert held.depth == 4
    sync = redis.Redis.from_url(fresh_redis.url)
    try:
        sync.config_resetstat()
        await d.record("r1", blocks, held)  # 1 s old against a 375-ms interval: whole
        assert _calls(sync)["hget"] == 8 + 2  # and the count's two reads
    finally:
        sync.close()


async def test_placements_in_flight_are_not_held(shared: tuple[RedisDirectory, Clock]) -> None:
    """What a record may leave is the replica's entries alone: a placement in flight extends
    the match, not what Redis holds."""
    d, _ = shared
    blocks = chain(10)
    await _turn(d, "r1", blocks[:3])
    await d.place("r1", blocks[3:])
    full = await d.lookup_full(blocks)
    assert full.detail["r1"][0] == 10 and full.held["r1"].depth == 3
    await d.place("r2", blocks)
    full = await d.lookup_full(blocks)
    assert "r2" in full.detail and "r2" not in full.held


def _routed(
    blocks: list[BlockHash], replica: str, lookup_held: dict[str, Held], used: float
) -> Routed:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 800}]}
    parsed = parse_chat(orjson.dumps(body), 1 << 20)
    tenant = Tenant("t", b"salt")
    matched = lookup_held[replica].depth if replica in lookup_held else 0
    route = RouteRequest(len(blocks), 1000.0, {replica: matched})
    return Routed(
        parsed,
        tenant,
        blocks,
        route,
        Decision((replica,), "cache_hit"),
        {replica: used},
        0.0,
        0.0,
        held=lookup_held,
    )


async def test_reconciliation_of_a_request_whose_record_left_its_prefix_keeps_it(
    fresh_redis: RedisServer,
) -> None:
    """An over-prediction raises the replica's floor to the lookup's last use: the blocks the
    request's record left at that use would stop matching though its engine has just
    prefilled them. Reconciliation writes the request's chain again, whole."""
    clock = Clock()
    local = MemoryDirectory(MemoryIndex(clock=clock))
    shared = RedisDirectory(await open_redis(fresh_redis.url), clock=clock)
    directory = RoutingDirectory(local, shared, deadline_s=5.0)
    await directory.start()
    try:
        directory.register(["r1"])
        blocks = chain(12)
        await directory.record("r1", blocks[:8])
        await directory.flushed()
        clock.now += 1.0
        lookup = await directory.lookup(blocks)
        assert lookup.overlap == {"r1": 8} and lookup.held["r1"].depth == 8
        routed = _routed(blocks, "r1", lookup.held, lookup.last_use["r1"])
        await directory.record("r1", blocks, routed.held.get("r1"))  # its first token
        await directory.flushed()
        assert (await shared.lookup_full(blocks)).held["r1"].used_ms == round(T0 * 1000)
        reconciler = Reconciler(directory, 256, CollectorRegistry())
        clock.now += 0.5
        usage = EngineUsage.parse(
            {"prompt_tokens": 1000, "prompt_tokens_details": {"cached_tokens": 0}}
        )
        await reconciler.on_usage(ExchangeRecord(routed, "r1"), usage)
        assert reconciler.stats.expiries == 1
        await directory.flushed()
        await shared.refresh_generations()
        assert shared.meta.floor(replica_id("r1")) == round(T0 * 1000)
        assert (await shared.lookup(blocks)) == {"r1": 12}  # the floor took none of them
    finally:
        await directory.close()


turns = st.lists(
    st.tuples(
        st.integers(0, 3),  # a conversation
        st.integers(0, 3),  # blocks it grows by
        st.sampled_from(["r1", "r2"]),
        st.sampled_from([0.0, 0.3, 1.5, 3.0, 5.0]),  # seconds since the turn before
        st.booleans(),  # the replica restarts (an epoch) before it
    ),
    min_size=1,
    max_size=25,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(turns)
def test_lookups_after_records_that_write_what_changed_read_what_whole_records_give(
    fresh_redis: RedisServer, ops: list[tuple[int, int, str, float, bool]]
) -> None:
    """The same turns (a lookup, then its record), on two Redis databases: one recorded whole
    (the chain rewritten each turn), one from where each lookup's fresh held prefix ends. Every
    lookup reads the same depths on both, across generations advancing (a capacity of 16:
    12 new blocks a generation) and restart epochs; the floors are the other tests'."""
    asyncio.run(_compare(fresh_redis.url, ops))


async def _compare(url: str, ops: list[tuple[int, int, str, float, bool]]) -> None:
    clock = Clock()
    stores = []
    for db in (1, 2):
        client = await open_redis(f"{url}/{db}", cluster=False)
        await client.flushdb()
        d = RedisDirectory(client, capacity_blocks=16, clock=clock)
        await d.refresh_generations()
        d.register(["r1", "r2"])
        stores.append(d)
    whole, delta = stores
    convs = [chain(40, f"conversation {i} {uuid.uuid4().hex}") for i in range(4)]
    length = [1] * len(convs)
    try:
        for c, grow, replica, dt, restart in ops:
            clock.now += dt
            if restart:
                for d in stores:
                    await d.forget(replica)
            length[c] = min(length[c] + grow, len(convs[c]))
            blocks = convs[c][: length[c]]
            seen = [await d.lookup_full(blocks) for d in stores]
            assert {r: n for r, (n, _) in seen[0].detail.items()} == {
                r: n for r, (n, _) in seen[1].detail.items()
            }
            await whole.record(replica, blocks)
            await delta.record(replica, blocks, seen[1].held.get(replica))
            rid = replica_id(replica)
            assert whole.meta.gen(rid) == delta.meta.gen(rid)
            for conv, n in zip(convs, length, strict=True):
                assert await whole.lookup(conv[:n]) == await delta.lookup(conv[:n])
    finally:
        for d in stores:
            await d.close()
