"""One contract, three stores: the in-process directory, a real redis-server and a real 3-master
Redis Cluster. Chains and replica names are unique per test, so tests share the servers."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest
import redis

from cachemap.keys import BlockHash, chain_hashes, root_hash
from cachemap.memory import MemoryDirectory, MemoryIndex
from cachemap.rates import PrefixRates
from cachemap.redis import scripts
from cachemap.redis.client import open_redis
from cachemap.redis.directory import RECORD_CHUNK, RedisDirectory
from cachemap.redis.schema import (
    COUNT_KEY,
    FLOOR_KEY,
    GEN_KEY,
    LIVE_KEY,
    SEEN_KEY,
    START_KEY,
    block_keys,
    replica_id,
    text,
)
from loadgen.harness.redis_servers import RedisServer, without_pubsub

pytestmark = pytest.mark.redis

STORES = ("memory", "redis", "cluster")


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


class Store:
    """A directory under test plus the means to drive it."""

    def __init__(self, kind: str, make: Callable[..., Coroutine[Any, Any, Any]], clock: Clock):
        self.kind = kind
        self.make = make
        """make(capacity_blocks=, ttl_s=, pubsub=True): a directory; pubsub=False connects as
        a Redis user that may not SUBSCRIBE (a broken pub/sub path, for real)."""
        self.clock = clock
        self.prefix = uuid.uuid4().hex

    def chain(self, name: str, n: int) -> list[BlockHash]:
        data = (self.prefix + name).encode() * (16 * n)
        return chain_hashes(data[: 16 * n * 16], root_hash(b"salt", self.prefix + name), 16)[:n]

    def replica(self, name: str) -> str:
        return f"http://{self.prefix[:8]}-{name}:8000"


@pytest.fixture(params=STORES)
async def store(
    request: pytest.FixtureRequest, redis_url: str, redis_cluster_url: str
) -> AsyncIterator[Store]:
    async for s in _store(request.param, redis_url, redis_cluster_url):
        yield s


@pytest.fixture(params=("redis", "cluster"))
async def shared_store(
    request: pytest.FixtureRequest, redis_url: str, redis_cluster_url: str
) -> AsyncIterator[Store]:
    """The shared stores only: what many gateways see together."""
    async for s in _store(request.param, redis_url, redis_cluster_url):
        yield s


async def _store(kind: str, redis_url: str, redis_cluster_url: str) -> AsyncIterator[Store]:
    clock = Clock()
    opened: list[Any] = []

    async def make(capacity_blocks: int = 1000, ttl_s: float = 60.0, pubsub: bool = True) -> Any:
        if kind == "memory":
            return MemoryDirectory(
                MemoryIndex(capacity_blocks=capacity_blocks, ttl_s=ttl_s, clock=clock)
            )
        url = redis_url if kind == "redis" else redis_cluster_url
        client = await open_redis(url if pubsub else without_pubsub(url))
        directory = RedisDirectory(
            client, capacity_blocks=capacity_blocks, ttl_s=ttl_s, clock=clock
        )
        await directory.start()
        opened.append(directory)
        return directory

    yield Store(kind, make, clock)
    for directory in opened:
        await directory.close()


async def eventually(check: Callable[[], Coroutine[Any, Any, bool]], timeout_s: float) -> bool:
    """Poll an async condition until it holds, at most `timeout_s` (bounded; no sleep decides)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def named(directory: Any, store: Store, *names: str) -> None:
    if isinstance(directory, RedisDirectory):
        directory.register(store.replica(n) for n in names)


async def test_lookup_returns_contiguous_leading_depth_and_stops_at_the_first_miss(
    store: Store,
) -> None:
    d = await store.make()
    r1, r2, r3 = (store.replica(n) for n in ("r1", "r2", "r3"))
    named(d, store, "r1", "r2", "r3")
    a = store.chain("a", 6)
    await d.record(r1, a[:4])
    await d.record(r2, a[:2])
    await d.record(r3, a[1:5])  # no block 0: no usable prefix
    assert await d.lookup(a) == {r1: 4, r2: 2}
    assert await d.lookup(store.chain("b", 3)) == {}
    assert await d.lookup([]) == {}
    await d.record(r1, a[5:6])  # a gap at block 4: still 4
    assert (await d.lookup(a))[r1] == 4


async def test_ttl_refreshed_on_use(store: Store) -> None:
    d = await store.make(ttl_s=60)
    r1 = store.replica("r1")
    named(d, store, "r1")
    a = store.chain("a", 3)
    await d.record(r1, a)
    store.clock.now += 59
    assert await d.lookup(a) == {r1: 3}
    await d.record(r1, a[:1])
    store.clock.now += 2
    assert await d.lookup(a) == {r1: 1}
    store.clock.now += 60
    assert await d.lookup(a) == {}


async def test_capacity_bounds_what_matches_and_keeps_the_recent(store: Store) -> None:
    capacity = 40
    d = await store.make(capacity_blocks=capacity)
    r1 = store.replica("r1")
    named(d, store, "r1")
    chains = [store.chain(f"c{i}", 10) for i in range(12)]  # 120 blocks recorded, capacity 40
    for c in chains:
        await d.record(r1, c)
    matched = [(await d.lookup(c)).get(r1, 0) for c in chains]
    assert sum(matched) <= capacity
    assert matched[-1] == 10  # the most recent chain is whole
    assert matched[0] == 0  # the oldest is gone


async def test_the_most_recent_three_quarters_of_the_capacity_always_match(store: Store) -> None:
    """Issue 39: the Redis store advanced a replica's generation every half of its capacity, so
    right after an advance only half of it matched: sized from the engine's KV (issue 42), the
    shared directory forgot prefixes the engine still held, and four gateways on Redis read a
    lower hit ratio than one in process (`kvgate sim --gateways 4`: 0.164 against 0.187)."""
    capacity = 40
    d = await store.make(capacity_blocks=capacity)
    r1 = store.replica("r1")
    named(d, store, "r1")
    chains = [store.chain(f"c{i}", 10) for i in range(12)]
    for i, c in enumerate(chains):
        await d.record(r1, c)
        recent = chains[max(i - 2, 0) : i + 1]  # the last 30 blocks recorded
        assert [(await d.lookup(r)).get(r1, 0) for r in recent] == [10] * len(recent), i


def live_entries(sync: redis.Redis, rid: str) -> dict[int, int]:
    """A replica's live generations in Redis: generation -> entries at it."""
    value = sync.hget(LIVE_KEY, rid)
    assert value is not None
    _, counts = text(value).split(";", 1)
    return {int(g): int(n) for g, n in (p.split(":") for p in counts.split(";") if p)}


def capped(d: Any, replica: str, engine_blocks: int | None) -> None:
    """The replica's engine reported a KV worth `engine_blocks` entries (None: none)."""
    index = d.index if isinstance(d, MemoryDirectory) else d
    index.set_capacity(replica, engine_blocks)


async def test_a_replica_keeps_the_smaller_of_the_setting_and_its_engines_kv(
    store: Store,
) -> None:
    """Issue 42: a directory of 1,000 entries per replica in front of an engine that holds 40
    keeps 40 of that replica's (a small engine's prefix is forgotten when the engine would have
    evicted it), while a replica whose engine holds more, or says nothing, keeps the setting."""
    d = await store.make(capacity_blocks=1000)
    small, large, silent = (store.replica(n) for n in ("small", "large", "silent"))
    named(d, store, "small", "large", "silent")
    capped(d, small, 40)
    capped(d, large, 5000)
    for replica in (small, large, silent):
        chains = [store.chain(f"{replica}{i}", 10) for i in range(12)]  # 120 blocks each
        for c in chains:
            await d.record(replica, c)
        matched = [(await d.lookup(c)).get(replica, 0) for c in chains]
        assert matched[-1] == 10  # the most recent chain is whole
        if replica == small:
            assert sum(matched) <= 40
            assert matched[0] == 0  # the oldest is gone, as the engine evicted it
        else:
            assert matched == [10] * 12  # 120 of 1,000: nothing forgotten
    capped(d, small, None)  # the engine stopped reporting: the setting again
    again = [store.chain(f"again{i}", 10) for i in range(12)]
    for c in again:
        await d.record(small, c)
    assert [(await d.lookup(c)).get(small, 0) for c in again] == [10] * 12


async def test_a_smaller_engine_capacity_applies_to_what_is_held(store: Store) -> None:
    """The capacity arrives (or shrinks) after entries were recorded: the in-process store
    drops the least recent past it at once; Redis, within the replica's next 3/2 `capacity` new
    blocks (two generation advances), never more than the old entries plus those."""
    d = await store.make(capacity_blocks=1000)
    r1 = store.replica("r1")
    named(d, store, "r1")
    old = [store.chain(f"old{i}", 10) for i in range(10)]
    for c in old:
        await d.record(r1, c)
    capped(d, r1, 20)
    new = [store.chain(f"new{i}", 10) for i in range(4)]  # 40 new blocks: past two advances
    for c in new:
        await d.record(r1, c)
    assert [(await d.lookup(c)).get(r1, 0) for c in old] == [0] * 10
    assert (await d.lookup(new[-1])) == {r1: 10}


async def test_re_recording_a_hot_chain_does_not_age_an_idle_one(store: Store) -> None:
    """Item 17: capacity counts distinct entries, as an LRU does. A chain recorded again (the
    spine every request shares) is one set of entries, not a new one per record; when Redis
    counted every re-record, an idle conversation stopped matching long before the in-process
    store at the same capacity forgot it."""
    d = await store.make(capacity_blocks=40)
    r1 = store.replica("r1")
    named(d, store, "r1")
    idle, hot = store.chain("idle", 10), store.chain("hot", 10)
    await d.record(r1, idle)
    for _ in range(10):  # 100 records of 10 distinct blocks: 20 entries of 40 in all
        await d.record(r1, hot)
    assert await d.lookup(idle) == {r1: 10}
    assert await d.lookup(hot) == {r1: 10}


async def test_drop_removes_what_the_engine_did_not_hold(store: Store) -> None:
    d = await store.make()
    r1, r2 = store.replica("r1"), store.replica("r2")
    named(d, store, "r1", "r2")
    a = store.chain("a", 4)
    await d.record(r1, a)
    await d.record(r2, a)
    await d.drop(r1, a[2:])
    assert await d.lookup(a) == {r1: 2, r2: 4}


async def test_forget_stops_matching_at_once_and_the_replica_starts_afresh(store: Store) -> None:
    d = await store.make()
    r1, r2 = store.replica("r1"), store.replica("r2")
    named(d, store, "r1", "r2")
    a = store.chain("a", 5)
    await d.record(r1, a)
    await d.record(r2, a[:2])
    await d.forget(r1)
    assert await d.lookup(a) == {r2: 2}
    await d.record(r1, a[:3])
    assert await d.lookup(a) == {r1: 3, r2: 2}


async def test_two_directories_on_one_redis_share_everything(shared_store: Store) -> None:
    store = shared_store
    first, second = await store.make(), await store.make()
    r1 = store.replica("r1")
    named(first, store, "r1")
    named(second, store, "r1")
    a = store.chain("a", 4)
    await first.record(r1, a)
    assert await second.lookup(a) == {r1: 4}
    await first.forget(r1)
    await second.refresh_generations()  # the channel does this within ms; make it certain
    assert await second.lookup(a) == {}


async def test_a_gateway_whose_pubsub_is_broken_still_hears_epochs_and_floors(
    shared_store: Store,
) -> None:
    """Item 14: generations and floors reach every gateway within the refresh interval even
    when its subscription to the channel fails (here: its Redis user may not SUBSCRIBE). Until
    now the once-a-second refresh ran only inside a working subscription."""
    store = shared_store
    first, deaf = await store.make(), await store.make(pubsub=False)
    r1, r2 = store.replica("r1"), store.replica("r2")
    for d in (first, deaf):
        named(d, store, "r1", "r2")
    a = store.chain("a", 4)
    await first.record(r1, a)
    await first.record(r2, a)
    assert await deaf.lookup(a) == {r1: 4, r2: 4}
    await first.forget(r1)  # r1 restarted: an epoch bump
    await first.expire(r2, store.clock.now)  # r2 evicted everything used until now
    assert await eventually(lambda: _matches_nothing(deaf, a), timeout_s=5.0)


async def _matches_nothing(directory: Any, chain: list[BlockHash]) -> bool:
    return bool(await directory.lookup(chain) == {})


async def test_a_restart_marker_bumps_the_epoch_once(shared_store: Store) -> None:
    store = shared_store
    first, second = await store.make(), await store.make()
    r1 = store.replica("r1")
    for d in (first, second):
        named(d, store, "r1")
    a = store.chain("a", 3)
    assert not await first.restarted(r1, "1000.0")  # first sight: no restart
    await first.record(r1, a)
    assert not await second.restarted(r1, "1000.0")  # same start: nothing
    assert await first.restarted(r1, "2000.0")  # a new start time: epoch bump
    assert not await second.restarted(r1, "2000.0")  # reported twice, bumped once
    await second.refresh_generations()
    assert await second.lookup(a) == {}


async def test_quiet_replicas_leave_the_meta_hashes_and_generations_never_go_back(
    shared_store: Store,
) -> None:
    """Item 17: `kvg:{kvg-meta}:*` held a field per replica ever seen (a rollout adds a set
    per pod address). A replica neither recorded nor restarted for twice the TTL is pruned from
    every hash; its generation lives on in the base, so if it returns its old entries stay
    dead while its new ones match."""
    store = shared_store
    d = await store.make(capacity_blocks=8, ttl_s=60.0)
    quiet, busy = store.replica("quiet"), store.replica("busy")
    named(d, store, "quiet", "busy")
    a = store.chain("a", 6)
    assert not await d.restarted(quiet, "1000.0")
    for _ in range(3):  # past capacity: the generation moves (2 per restart, 1 per 6 blocks)
        await d.record(quiet, store.chain(f"q{_}", 6))
    await d.restarted(quiet, "2000.0")
    await d.expire(quiet, store.clock.now)
    old_gen = d.meta.gen(replica_id(quiet))
    assert old_gen >= 3
    store.clock.now += 90  # past the TTL, not the horizon
    await d.record(busy, a)
    assert await d.prune() == 0
    store.clock.now += 60  # 150 s since `quiet` was last heard of: past 2 × TTL
    assert await d.prune() >= 1
    rid = replica_id(quiet)
    for key in (GEN_KEY, COUNT_KEY, START_KEY, FLOOR_KEY, SEEN_KEY):
        assert not await d.client.hexists(key, rid), key
    assert await d.client.hexists(GEN_KEY, replica_id(busy))
    await d.refresh_generations()
    assert d.meta.gen(rid) >= old_gen  # the base: never back
    await d.record(quiet, a)  # it came back
    await d.record(busy, a)
    assert await d.lookup(a) == {quiet: 6, busy: 6}


async def test_the_shared_rate_of_a_burst_is_the_in_process_one(shared_store: Store) -> None:
    """Item 18: the lookup script counts a prefix's rate with the formula `cachemap.rates`
    uses in process — a young prefix over the span observed — so every gateway sees a burst
    as soon as one would alone."""
    store = shared_store
    d = await store.make()
    r1 = store.replica("r1")
    named(d, store, "r1")
    spine = store.chain("spine", 3)
    await d.record(r1, spine)
    store.clock.now = 1_800_000_003.0  # 3 s into a 10-s window
    local = PrefixRates(clock=store.clock)
    for _ in range(30):  # 40 requests/s
        shared = await d.lookup_full(spine, rate_window_s=local.window_s)
        expected = local.observe(spine[-1])
        assert shared.rate_per_min == pytest.approx(expected.rate_per_min, rel=1e-3)
        store.clock.now += 0.025
    assert shared.rate_per_min == pytest.approx(29 * 60 / 1.0, rel=1e-3)  # a span of >= 1 s


async def test_later_siblings_are_taken_back_from_the_shared_rate_as_in_process(
    shared_store: Store,
) -> None:
    """Issue 45, item 16: a fan-out flight's later siblings are not new arrivals; the rate
    Redis counts takes them back as `PrefixRates.unobserve` does, never below the first."""
    store = shared_store
    d = await store.make()
    r1 = store.replica("r1")
    named(d, store, "r1")
    spine = store.chain("burst", 3)
    await d.record(r1, spine)
    store.clock.now = 1_800_000_003.0
    local = PrefixRates(clock=store.clock)
    for _ in range(16):
        await d.lookup_full(spine, rate_window_s=local.window_s)
        local.observe(spine[-1])
    for _ in range(16):  # one more than the siblings: the first request stays
        await d.hot.uncount(spine[-1])
        local.unobserve(spine[-1])
    store.clock.now += 0.5
    shared = await d.lookup_full(spine, rate_window_s=local.window_s)
    assert shared.rate_per_min == pytest.approx(local.observe(spine[-1]).rate_per_min, rel=1e-3)
    assert shared.rate_per_min == pytest.approx(60.0, rel=1e-3)  # two arrivals over >= 1 s


@pytest.mark.parametrize("num_blocks", [8, 64, 512])
async def test_a_lookup_is_exactly_one_redis_command(
    num_blocks: int, fresh_redis: RedisServer
) -> None:
    redis_url = fresh_redis.url  # a server of its own: nothing else talks to it
    client = await open_redis(redis_url)
    d = RedisDirectory(client)
    await d.refresh_generations()
    hashes = chain_hashes(uuid.uuid4().bytes * (16 * num_blocks), root_hash(b"s", "m"), 256)
    hashes = hashes[:num_blocks]
    d.register(["r1"])
    await d.record("r1", hashes)
    sync = redis.Redis.from_url(redis_url)
    try:
        await d.lookup(hashes)  # the script is loaded
        sync.config_resetstat()
        assert await d.lookup(hashes) == {"r1": num_blocks}
        stats = sync.info("commandstats")
        # the client sent one EVALSHA; everything else ran inside it (HGETALL per block)
        assert stats["cmdstat_evalsha"]["calls"] == 1
        top_level = {
            k
            for k in stats
            if k not in ("cmdstat_evalsha", "cmdstat_hgetall")
            and not k.startswith("cmdstat_config")
        }
        assert top_level == set()
        assert stats["cmdstat_hgetall"]["calls"] == num_blocks
    finally:
        sync.close()
        await d.close()


async def test_a_long_chain_is_recorded_in_bounded_calls_a_few_a_pipeline(
    fresh_redis: RedisServer,
) -> None:
    """Precise mode records an agent's prompt in the engine's 16-token blocks, 3,000-7,000 of
    them a turn: one RECORD call held Redis 20 ms median (up to 0.38 s on a loaded machine) and
    the lookups queued behind it timed out (issue 39). Calls of RECORD_CHUNK blocks now, the
    same entries and the same count of new blocks."""
    client = await open_redis(fresh_redis.url)
    d = RedisDirectory(client, capacity_blocks=1_000_000)
    await d.refresh_generations()
    hashes = chain_hashes(uuid.uuid4().bytes * (16 * 6_000), root_hash(b"s", "m"), 256)
    d.register(["r1"])
    sync = redis.Redis.from_url(fresh_redis.url)
    try:
        await d.record("r1", hashes[:1])  # the scripts are loaded
        sync.config_resetstat()
        await d.record("r1", hashes[:6_000])
        stats = sync.info("commandstats")
        # the record's calls, each counting its own new blocks (no count call after them)
        assert stats["cmdstat_evalsha"]["calls"] == -(-6_000 // RECORD_CHUNK)
        calls = stats["cmdstat_evalsha"]["calls"]
        assert stats["cmdstat_hget"]["calls"] == 6_000 + 2 * calls  # each block once; counts
        assert await d.lookup(hashes[:6_000]) == {"r1": 6_000}
        rid = replica_id("r1")
        assert live_entries(sync, rid) == {0: 6_000}
    finally:
        sync.close()
        await d.close()


async def test_a_record_counts_its_new_blocks_in_its_own_call(fresh_redis: RedisServer) -> None:
    """Issue 39's tier CPU: every record batch was followed by a `COUNT` call of its own (a
    round trip of the gateway's, a script of Redis's, per request). On a single Redis the
    record's call counts now: one EVALSHA, the generation advanced and announced in it, the
    gateway's view moved by its reply. A gateway whose view is behind still writes at its own
    generation (a restart it has not heard of keeps its record from matching) and never moves
    Redis's back."""
    client = await open_redis(fresh_redis.url)
    d = RedisDirectory(client, capacity_blocks=96)  # 6 entries a generation
    behind = RedisDirectory(await open_redis(fresh_redis.url), capacity_blocks=96)
    await d.refresh_generations()
    await behind.refresh_generations()
    d.register(["r1"])
    behind.register(["r1"])
    rid = replica_id("r1")
    blocks = chain_hashes(uuid.uuid4().bytes * 200, root_hash(b"s", "count"), 256)[:12]
    sync = redis.Redis.from_url(fresh_redis.url)
    try:
        await d.record("r1", blocks[:1])  # the script is loaded
        gen = d.meta.gen(rid)
        sync.config_resetstat()
        await d.record("r1", blocks[1:6])  # 1 + 5 new blocks: the generation advances
        calls = {k.split("_", 1)[1]: v["calls"] for k, v in sync.info("commandstats").items()}
        # one announcement of the generation, one of the live generations
        assert calls["evalsha"] == 1 and calls["publish"] == 2, calls
        assert d.meta.gen(rid) == gen + 1 == int(sync.hget(GEN_KEY, rid) or 0)
        assert int(sync.hget(COUNT_KEY, rid) or 0) == 0
        assert await d.lookup(blocks[:6]) == {"r1": 6}  # the generation before still matches
        assert behind.meta.gen(rid) == gen  # has not heard: not subscribed, not polled
        await behind.record("r1", blocks[6:8])
        assert behind.meta.gen(rid) == gen + 1  # the reply moved its view
        assert int(sync.hget(GEN_KEY, rid) or 0) == gen + 1
        assert live_entries(sync, rid) == {gen: 8}  # counted where they were written
        value = sync.hget(block_keys(blocks[6:7])[0], rid)
        assert value is not None and value.split(b":")[0] == str(gen).encode()  # its own view's
    finally:
        sync.close()
        await d.close()
        await behind.close()


async def test_a_record_of_many_calls_advances_the_generation_once(
    fresh_redis: RedisServer,
) -> None:
    """A chain longer than `RECORD_CHUNK` is recorded in several calls, which all count: only
    the replica's last call of the batch advances the generation, once, as one count of the
    batch's sum did. Each call advancing on its own would take a 600-block record of a
    replica that advances every 125 blocks four generations on, and its own first blocks,
    written at the first, would no longer match."""
    client = await open_redis(fresh_redis.url)
    d = RedisDirectory(client, capacity_blocks=2000)  # 125 entries a generation
    await d.refresh_generations()
    d.register(["r1", "r2"])
    rid = replica_id("r1")
    blocks = chain_hashes(uuid.uuid4().bytes * 10_000, root_hash(b"s", "many"), 256)[:600]
    other = chain_hashes(uuid.uuid4().bytes * 2_000, root_hash(b"s", "other"), 256)[:100]
    sync = redis.Redis.from_url(fresh_redis.url)
    try:
        gen = d.meta.gen(rid)
        await d.record_many([("r1", blocks, None, None), ("r2", other, None, None)])
        assert d.meta.gen(rid) == gen + 1 == int(sync.hget(GEN_KEY, rid) or 0)
        assert int(sync.hget(COUNT_KEY, rid) or 0) == 0
        assert d.meta.gen(replica_id("r2")) == gen  # 100 of 125: its own count
        assert live_entries(sync, replica_id("r2")) == {gen: 100}
        assert await d.lookup(blocks) == {"r1": 600}
    finally:
        sync.close()
        await d.close()


def test_every_key_of_a_chain_is_in_one_slot() -> None:
    from redis.crc import key_slot

    hashes = chain_hashes(b"x" * 256 * 100, root_hash(b"tenant-a", "m"), 256)
    slots = {key_slot(k) for k in block_keys(hashes)}
    assert len(slots) == 1
    other = chain_hashes(b"x" * 256 * 100, root_hash(b"tenant-b", "m"), 256)
    assert {key_slot(k) for k in block_keys(other)} != slots


async def test_expire_drops_what_the_engine_evicted_before_a_time(store: Store) -> None:
    d = await store.make()
    r1, r2 = store.replica("r1"), store.replica("r2")
    named(d, store, "r1", "r2")
    old, new = store.chain("old", 3), store.chain("new", 3)
    await d.record(r1, old)
    await d.record(r2, old)
    store.clock.now += 10
    await d.record(r1, new)
    detail = await d.lookup_detail(old)
    assert detail[r1] == (3, pytest.approx(store.clock.now - 10))
    await d.expire(r1, detail[r1][1])  # the engine no longer held `old`: nor anything older
    assert await d.lookup(old) == {r2: 3}
    assert await d.lookup(new) == {r1: 3}
    await d.record(r1, old)  # written again later: it matches again
    assert (await d.lookup(old))[r1] == 3


async def test_concurrent_lookups_share_a_round_trip_but_stay_one_command_each(
    fresh_redis: RedisServer,
) -> None:
    d = RedisDirectory(await open_redis(fresh_redis.url))
    await d.refresh_generations()
    d.register(["r1", "r2"])
    chains = [
        chain_hashes(f"chain {i} ".encode() * 800, root_hash(b"s", "m"), 256)[:16]
        for i in range(10)
    ]
    for i, chain in enumerate(chains):
        await d.record("r1" if i % 2 else "r2", chain[: 4 + i])
    sync = redis.Redis.from_url(fresh_redis.url)
    try:
        await d.lookup(chains[0])  # the script is loaded
        sync.config_resetstat()
        results = await asyncio.gather(*(d.lookup(c) for c in chains))
        assert results == [{("r1" if i % 2 else "r2"): 4 + i} for i in range(10)]
        assert sync.info("commandstats")["cmdstat_evalsha"]["calls"] == 10
    finally:
        sync.close()
        await d.close()


async def test_concurrent_cluster_lookups_are_pipelined_per_node_and_survive_a_script_flush(
    redis_cluster_url: str,
) -> None:
    client = await open_redis(redis_cluster_url)
    d = RedisDirectory(client)
    await d.refresh_generations()
    prefix = uuid.uuid4().hex
    d.register(["r1", "r2"])
    chains = [  # chains of different roots: their slots spread over the three masters
        chain_hashes(f"{prefix} {i} ".encode() * 800, root_hash(f"{prefix}{i}".encode(), "m"), 256)[
            :16
        ]
        for i in range(20)
    ]
    for i, chain in enumerate(chains):
        await d.record("r1" if i % 2 else "r2", chain[: 4 + i % 12])
    try:
        await client.script_flush()  # every master forgets the lookup script
        results = await asyncio.gather(*(d.lookup(c) for c in chains))
        assert results == [{("r1" if i % 2 else "r2"): 4 + i % 12} for i in range(20)]
    finally:
        await d.close()


@pytest.mark.parametrize("topology", ["redis", "cluster"])
async def test_a_lookup_whose_script_redis_cannot_load_fails_with_redis_s_error(
    fresh_redis: RedisServer,
    redis_cluster_url: str,
    topology: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lookup whose script Redis refuses to load (NOSCRIPT, then a compile error: a script
    edited wrong, or a Redis whose Lua lacks what it uses) fails with Redis's own error. The
    lane's reader had taken the call off its queue before loading the script, so the error
    failed every other call on the wire but that one: a lookup without a deadline waited
    forever (seen when a helper tried a broken script: the tests blocked for 300 s)."""
    monkeypatch.setattr(scripts, "LOOKUP", scripts.LOOKUP + "\nthis is not Lua (")
    url = fresh_redis.url if topology == "redis" else redis_cluster_url
    d = RedisDirectory(await open_redis(url))
    await d.refresh_generations()  # a cluster client learns its slots
    d.register(["r1"])
    chain = chain_hashes(uuid.uuid4().hex.encode() * 100, root_hash(b"s", "m"), 256)[:4]
    try:
        with pytest.raises(redis.ResponseError, match="compiling script"):
            await asyncio.wait_for(d.lookup(chain), 20)  # a bound on the test, not the path
    finally:
        await d.close()
