"""The load view shared between gateways (`gateway.fleet.shared_load`) against a real
redis-server and a real 3-master Redis Cluster: one gateway's requests in flight count in
another's snapshot of the same replica, a stopped or silent gateway stops counting, a malformed
entry is skipped, and Redis going away leaves the last view standing only for the stale bound.
Replica URLs are unique per test, so the tests share the servers."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster

from cachemap.redis.client import AnyRedis, open_redis
from cachemap.redis.lookups import LookupLane
from cachemap.redis.node_lanes import NodeLanes
from gateway.fleet.replicas import FleetLoad, ReplicaState
from gateway.fleet.shared_load import LOAD_KEY, PeerSums, SharedLoad, decode, encode
from loadgen.harness.redis_servers import RedisServer
from tests.integration.test_event_index_redis import client

__all__ = ["client"]  # the fixture (Redis and Cluster), by name

pytestmark = pytest.mark.redis


def fleet(*urls: str) -> dict[str, ReplicaState]:
    shared = FleetLoad()
    return {url: ReplicaState(url, healthy=True, fleet=shared) for url in urls}


def urls(n: int) -> list[str]:
    run = uuid.uuid4().hex[:8]
    return [f"http://{run}-{i}:8000" for i in range(n)]


def gateway(client: AnyRedis, states: dict[str, ReplicaState]) -> SharedLoad:
    return SharedLoad(client, lambda: list(states.values()), round_s=0.1)


async def test_a_peers_requests_count_in_this_gateways_snapshot(client: AnyRedis) -> None:
    x, y = urls(2)
    mine, theirs = fleet(x, y), fleet(x, y)
    a, b = gateway(client, theirs), gateway(client, mine)
    mine[x].lease(1_000.0, output_tokens=50.0).keep()  # this gateway's own request on x
    long_prefill = theirs[x].lease(40_000.0, output_tokens=200.0).keep()
    theirs[x].lease(3_000.0).keep()
    theirs[y].lease(500.0).keep().prefilled()  # its first token came back: decoding only

    await a.round()  # publishes
    await b.round()  # reads
    seen_x, seen_y = mine[x].snapshot(), mine[y].snapshot()
    assert seen_x.num_inflight == 3
    assert seen_x.pending_prefill_tokens == 1_000.0 + 40_000.0 + 3_000.0
    assert seen_x.decode_tokens == 50.0 + 200.0
    assert seen_y.num_inflight == 1 and seen_y.pending_prefill_tokens == 0.0
    assert mine[x].peer is not None and mine[x].peer.num_prefilling == 2
    assert b.num_peers >= 1 and b.rounds == 1 and b.failed == 0

    long_prefill.release()  # the peer's request ends; its next round says so
    await a.round()
    await b.round()
    assert mine[x].snapshot().pending_prefill_tokens == 1_000.0 + 3_000.0

    await a.stop()  # a graceful stop withdraws it at once
    await b.round()
    assert mine[x].peer is None and mine[y].peer is None
    assert mine[x].snapshot().num_inflight == 1  # its own request only


async def test_a_scrape_counts_the_peers_requests_as_known(client: AnyRedis) -> None:
    """The engine's queue holds both gateways' requests: the foreign estimate must not count
    the peer's again (it is in `pending_prefill_tokens` already)."""
    (x,) = urls(1)
    mine, theirs = fleet(x), fleet(x)
    a, b = gateway(client, theirs), gateway(client, mine)
    for _ in range(3):
        theirs[x].lease(2_000.0).keep()
    await a.round()
    await b.round()
    mine[x].known_at_scrape()  # what a scrape answering now records
    assert mine[x].own_waiting_at_scrape == 3 and mine[x].own_running_at_scrape == 3
    await a.stop()


async def test_a_gateway_silent_past_the_bound_stops_counting(client: AnyRedis) -> None:
    """A gateway that died without withdrawing: its entry, stamped by Redis's clock, is dropped
    by the next round past the bound (here an entry written 10 s ago)."""
    (x,) = urls(1)
    mine = fleet(x)
    b = gateway(client, mine)
    dead = f"dead-{uuid.uuid4().hex[:8]}"
    seconds, micros = await client.time()
    old_ms = int(seconds) * 1000 + int(micros) // 1000 - 10_000
    await client.hset(LOAD_KEY, dead, f"{old_ms}|".encode() + orjson_row(x, 5, 5, 9e4, 0))
    await b.round()
    assert mine[x].peer is None
    assert not await client.hexists(LOAD_KEY, dead)  # and gone from Redis


async def test_a_malformed_entry_is_counted_and_skipped(client: AnyRedis) -> None:
    x, y = urls(2)
    mine, theirs = fleet(x, y), fleet(x, y)
    a, b = gateway(client, theirs), gateway(client, mine)
    theirs[y].lease(700.0).keep()
    await a.round()
    seconds, micros = await client.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    bad = f"bad-{uuid.uuid4().hex[:8]}"
    await client.hset(LOAD_KEY, bad, f"{now_ms}|[[1, 2]]")  # a row too short
    try:
        await b.round()
        assert b.malformed >= 1 and b.failed == 0
        assert mine[y].snapshot().pending_prefill_tokens == 700.0  # the good entry counts
    finally:
        await client.hdel(LOAD_KEY, bad)
        await a.stop()


def orjson_row(url: str, inflight: int, prefilling: int, prefill: float, out: float) -> bytes:
    states = fleet(url)
    state = states[url]
    state.num_inflight, state.num_prefilling = inflight, prefilling
    state.pending_prefill_tokens, state.decode_tokens = prefill, out
    return encode(states.values())


def test_decoding_sums_the_peers_and_skips_what_it_cannot_read() -> None:
    x = "http://x:8000"
    one, two = orjson_row(x, 2, 1, 4_000.0, 10.0), orjson_row(x, 1, 1, 500.0, 0.0)
    peers, malformed = decode([one, two, b"{not json", b'[["u", "one", 0, 0, 0]]'])
    assert malformed == 2
    assert peers[x].num_inflight == 3 and peers[x].prefill_tokens == 4_500.0
    assert encode(fleet(x).values()) == b"[]"  # an idle gateway publishes only its heartbeat


def test_the_sums_kept_between_reads_are_what_decoding_every_entry_gives() -> None:
    """`PeerSums`: an entry read again unchanged is not added twice, a changed one replaces
    its old figures, a gone one is taken out, a malformed one skipped (and counted at each
    read)."""
    x, y = "http://x:8000", "http://y:8000"
    a1, a2 = orjson_row(x, 2, 1, 4_000.0, 10.0), orjson_row(y, 1, 0, 0.0, 64.0)
    b1 = orjson_row(x, 1, 1, 500.0, 0.0)
    sums = PeerSums()
    reads = [
        {b"a": a1, b"b": b1},
        {b"a": a1, b"b": b1},  # unchanged
        {b"a": a2, b"b": b1},  # a's request on x ended, one on y started
        {b"a": a2, b"c": b"{not json"},  # b left, c unreadable
        {},
    ]
    for entries in reads:
        malformed = sums.fold(entries)
        expected, bad = decode(entries.values())
        assert sums.view() == expected and malformed == bad
    assert sums.view() == {}


async def test_redis_gone_leaves_the_last_view_for_the_bound_then_none(
    fresh_redis: RedisServer,
) -> None:
    (x,) = urls(1)
    mine, theirs = fleet(x), fleet(x)
    now = [100.0]
    clients = [await open_redis(fresh_redis.url, timeout_s=0.2) for _ in range(2)]
    a = gateway(clients[0], theirs)
    b = SharedLoad(clients[1], lambda: list(mine.values()), round_s=0.1, clock=lambda: now[0])
    theirs[x].lease(8_000.0).keep()
    await a.round()
    await b.round()
    assert mine[x].snapshot().pending_prefill_tokens == 8_000.0
    fresh_redis.stop()
    try:
        now[0] += 2.0  # within the bound (3 s): the last answer stands
        await b.round()
        assert b.failed == 1 and mine[x].snapshot().pending_prefill_tokens == 8_000.0
        now[0] += 1.5  # past it: the peers' figures go
        await b.round()
        assert b.failed == 2 and mine[x].peer is None
        await b.stop()  # the withdrawal fails, bounded: the stop goes on
    finally:
        for c in clients:
            await c.aclose()


async def test_an_idle_gateway_calls_redis_once_a_heartbeat_and_at_once_when_busy(
    client: AnyRedis,
) -> None:
    """Rounds run every 0.125 s here (exact in binary: the clock is summed); an idle one goes
    to Redis once a second. A request in flight makes the next round call, and so does the one
    after the last request ended (its peers must see the empty list now, not at the
    heartbeat); a peer's load on our replicas keeps every round calling."""
    (x,) = urls(1)
    mine = fleet(x)
    now = [100.0]
    g = SharedLoad(client, lambda: list(mine.values()), round_s=0.125, clock=lambda: now[0])

    async def ticks(n: int) -> list[bool]:
        called = []
        for _ in range(n):
            now[0] += 0.125
            called.append(await g.tick())
        return called

    assert await g.tick()  # the first round calls
    assert await ticks(8) == [False] * 7 + [True]  # idle: once a second
    lease = mine[x].lease(1_000.0).keep()
    assert await ticks(3) == [True, True, True]  # busy: every round
    lease.release()
    assert await ticks(3) == [True, False, False]  # the empty list once, then idle
    theirs = fleet(x)
    peer = gateway(client, theirs)
    try:
        theirs[x].lease(500.0).keep()
        await peer.round()
        # seen at the next heartbeat (idle here: nothing routes on it before a request comes,
        # and this gateway's own request makes the round after it call), then every round
        assert await ticks(8) == [False] * 5 + [True, True, True]
        assert mine[x].peer is not None and mine[x].peer.num_inflight == 1
    finally:
        await peer.stop()


async def test_a_round_writes_only_when_its_figures_change_or_a_heartbeat_passed(
    client: AnyRedis,
) -> None:
    """A round whose figures are those of the last write only reads the hash (no script):
    the peers' figures still count every round and its own entry stays; a change is written
    at once, unchanged figures once a heartbeat (well within the stale bound), and an entry
    Redis no longer holds is written again at the next round."""
    (x,) = urls(1)
    mine, theirs = fleet(x), fleet(x)
    now = [100.0]
    g = SharedLoad(client, lambda: list(mine.values()), round_s=0.125, clock=lambda: now[0])
    peer = gateway(client, theirs)

    async def rounds(n: int) -> int:
        for _ in range(n):
            now[0] += 0.125
            await g.round()
        return g.writes

    try:
        mine[x].lease(1_000.0).keep()
        await g.round()
        assert g.writes == 1
        theirs[x].lease(500.0).keep()
        await peer.round()
        assert await rounds(1) == 1 and g.rounds == 2  # read only, and the peer counts
        assert mine[x].peer is not None and mine[x].peer.prefill_tokens == 500.0
        await peer.round()  # and this gateway's entry still counts for the peer
        assert theirs[x].peer is not None and theirs[x].peer.prefill_tokens == 1_000.0
        mine[x].lease(2_000.0).keep()
        assert await rounds(1) == 2  # changed: written at once
        assert await rounds(6) == 2  # unchanged: read only...
        assert await rounds(2) == 3  # ...until a heartbeat after the last write
        await client.hdel(LOAD_KEY, g.gateway_id)  # Redis lost it
        assert await rounds(1) == 3  # the read finds it gone...
        assert await rounds(1) == 4  # ...and the next round writes it again
        assert await client.hexists(LOAD_KEY, g.gateway_id)
    finally:
        await peer.stop()
        await g.stop()


async def test_a_read_only_round_leaves_out_a_peer_past_the_stale_bound(client: AnyRedis) -> None:
    """Between writes the stale bound is applied by Redis's clock as the last write read it."""
    (x,) = urls(1)
    mine = fleet(x)
    g = gateway(client, mine)
    mine[x].lease(1_000.0).keep()
    await g.round()
    dead = f"dead-{uuid.uuid4().hex[:8]}"
    seconds, micros = await client.time()
    old_ms = int(seconds) * 1000 + int(micros) // 1000 - 10_000
    await client.hset(LOAD_KEY, dead, f"{old_ms}|".encode() + orjson_row(x, 5, 5, 9e4, 0))
    try:
        await g.round()
        assert g.writes == 1 and g.rounds == 2  # read only
        assert mine[x].peer is None
    finally:
        await client.hdel(LOAD_KEY, dead)
        await g.stop()


async def test_an_answered_round_leaves_no_deadline_timer_to_wake_the_loop(
    client: AnyRedis,
) -> None:
    """A round's 1-s deadline is cancelled with its reply: left armed, each of a busy
    gateway's 10-40 rounds a second woke the loop once more, a second later, for nothing."""
    g = gateway(client, fleet(*urls(1)))
    try:
        await g.round()
        assert g.rounds == 1
        loop: Any = asyncio.get_running_loop()
        scheduled = loop._scheduled  # the loop's timers (asyncio's own loop in the tests)
        armed = [
            handle
            for handle in scheduled
            if not handle.cancelled()
            and getattr(handle._callback, "__func__", None) is LookupLane._expire
        ]
        assert not armed
    finally:
        await g.stop()


async def test_an_idle_loop_sleeps_until_its_heartbeat_and_a_lease_wakes_it(
    client: AnyRedis,
) -> None:
    """An idle gateway's loop does not wake every round to find nothing due (at 0.01-s rounds,
    20 wake-ups in the 0.2 s watched here): it sleeps until its heartbeat, and a lease wakes
    it for its next round (here long before the heartbeat, a second after the start's)."""
    (x,) = urls(1)
    mine = fleet(x)
    g = SharedLoad(client, lambda: list(mine.values()), round_s=0.01)
    mine[x].fleet.on_leased = g.wake
    called = asyncio.Event()
    plain = g.round

    async def round(states: list[ReplicaState] | None = None) -> None:
        await plain(states)
        called.set()

    g.round = round  # type: ignore[method-assign]
    await g.start()  # its first round, then the loop (idle: nothing in flight)
    try:
        ticks = g.ticks
        await asyncio.sleep(0.2)  # a window of 20 rounds, not a synchronisation
        assert g.ticks - ticks <= 2
        called.clear()
        mine[x].lease(1_000.0).keep()
        await asyncio.wait_for(called.wait(), 0.5)  # the heartbeat is ~0.8 s away
        # the start's empty list (the script), then this request's figures, published as it
        # was placed (the round after only read)
        assert (g.writes, g.published) == (1, 1)
        entry = await client.hget(LOAD_KEY, g.gateway_id)
        assert entry is not None and x.encode() in entry  # its figures, for the peers
    finally:
        await g.stop()


class Watched:
    """A rider (`cachemap.redis.lookups.Rider`) that is the gateway's own, and says when its
    read was answered."""

    def __init__(self, load: SharedLoad) -> None:
        self.load = load
        self.key = load.key
        self.deadline_s = load.deadline_s
        self.answered = asyncio.Event()
        self.sent = 0

    def ride(self) -> Any:
        wanted = self.load.ride()
        if wanted is None:
            return None
        self.sent += 1
        command, done = wanted

        def answered(future: asyncio.Future[Any]) -> None:
            done(future)
            self.answered.set()

        return command, answered


async def test_a_placement_counts_in_a_peers_next_lookup_before_any_round(
    client: AnyRedis,
) -> None:
    """A placement is published as it is made (`publish`), and a peer's lookup reads it in
    its own round trip (the rider ahead of the lookups on their lane): on one Redis it counts
    when the lookup's caller resumes; on a cluster, once the read beside it is answered. No
    round runs after the first."""
    x, y = urls(2)
    mine, theirs = fleet(x, y), fleet(x, y)
    a, b = gateway(client, theirs), gateway(client, mine)
    await a.round()  # the first rounds (a gateway's start): nothing in flight
    await b.round()
    theirs[x].lease(40_000.0, output_tokens=200.0).keep()
    published = a.publish()
    assert published is not None
    await published
    assert a.publish() is None  # the same figures: not written again
    source = "return 1"
    sha = client.register_script(source).sha
    cluster = isinstance(client, RedisCluster)
    lane = NodeLanes(client, source, sha) if cluster else LookupLane(client, source, sha)
    rider = lane.rider = Watched(b)
    try:
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        lane.send([([b"kvg:{lane-test}:k"], [], 1.0, answer)])
        assert b.ride() is None  # one read in flight at a time
        assert await answer == 1
        if cluster:  # beside the lookup, on the load key's master
            await asyncio.wait_for(rider.answered.wait(), 5.0)
        assert rider.answered.is_set() and rider.sent == 1
        peer = mine[x].peer
        assert peer is not None and peer.num_prefilling == 1 and peer.prefill_tokens == 40_000.0
        assert mine[x].snapshot().pending_prefill_tokens == 40_000.0
        assert mine[y].peer is None
        assert (a.rounds, b.rounds, a.published, b.rides) == (1, 1, 1, 1)
    finally:
        await lane.close()
        await a.stop()
        await b.stop()


async def test_each_gateway_knows_its_place_among_its_live_peers(client: AnyRedis) -> None:
    """The router's load ties rank by it (`router.herd`): the gateways agree on one order, that
    of their ids, from the names the hash's reads return. Other tests' entries may still be
    live in the shared hash: these three ids sort next to each other, whatever is there."""
    run = uuid.uuid4().hex[:8]
    states = fleet(*urls(1))
    gateways = [
        SharedLoad(client, lambda: list(states.values()), 0.1, gateway_id=f"herd-{run}-{i}")
        for i in (2, 0, 1)
    ]
    off = SharedLoad(client, list, 0.1, gateway_id=f"herd-{run}-3", spread_herd=False)
    try:
        assert gateways[0].herd() == (0, 0)  # before any answer: alone
        for g in (*gateways, off):
            await g.round()  # writes its entry
        for g in (*gateways, off):
            await g.round()  # unchanged figures: reads the hash, names and all
            assert g.writes == 1 and g.rounds == 2
        third, first, second = (g.herd() for g in gateways)
        peers, rank = first
        assert peers >= 3 and second == (peers, rank + 1) and third == (peers, rank + 2)
        assert off.herd() == (0, 0) and off.num_peers == peers
        await off.stop()  # a peer leaves: one fewer at the next read, the order kept
        await gateways[0].round()
        assert gateways[0].herd() == (peers - 1, rank + 2)
    finally:
        for g in gateways:
            await g.stop()


async def test_a_paced_decision_waits_its_turn_and_reads_the_peers_placements(
    client: AnyRedis,
) -> None:
    """`herd_pace_ms`: a decision within `pace_s` of the last waits for the rest of it, then
    reads the peers' figures, so it counts a placement a peer made meanwhile (no round, no
    lookup carried it). A decision with none before it, or a gateway without peers, goes at
    once."""
    x, y = urls(2)
    mine, theirs = fleet(x, y), fleet(x, y)
    a = gateway(client, theirs)
    b = SharedLoad(client, lambda: list(mine.values()), 0.1, pace_s=0.05)
    alone = SharedLoad(client, list, 0.1, pace_s=0.05)
    try:
        await alone.pace()
        await alone.pace()  # no peers known: no turn to wait for
        assert alone.paced == 0
        await a.round()
        await b.round()
        assert b.num_peers >= 1
        first = b.clock()
        await b.pace()  # nothing decided in the last 50 ms: at once, no read
        assert b.paced == 0
        theirs[x].lease(40_000.0).keep()
        published = a.publish()
        assert published is not None
        await published
        assert mine[x].peer is None
        await b.pace()
        assert b.clock() - first >= 0.05 and b.paced == 1
        peer = mine[x].peer
        assert peer is not None and peer.prefill_tokens == 40_000.0
        assert mine[y].peer is None and b.rounds == 1
    finally:
        await a.stop()
        await b.stop()


async def test_a_release_is_published_at_the_end_of_its_loop_turn(client: AnyRedis) -> None:
    """A lease's prefill ending and its release reach Redis as its start does (`changed`, one
    write a loop turn): a peer's next read counts them, with no round of the releasing
    gateway's between (they waited for it, then for the peer's round)."""
    (x,) = urls(1)
    mine, theirs = fleet(x), fleet(x)
    a, b = gateway(client, theirs), gateway(client, mine)
    theirs[x].fleet.on_leased, theirs[x].fleet.on_released = a.wake, a.changed
    writes: list[asyncio.Future[Any] | None] = []
    plain = a.publish

    def publish() -> asyncio.Future[Any] | None:
        writes.append(plain())
        return writes[-1]

    a.publish = publish  # type: ignore[method-assign]

    async def turn() -> None:
        """The loop turn's end: its one write, awaited."""
        count = len(writes)
        await asyncio.sleep(0)  # a yield, not a wait: the callbacks scheduled so far run
        assert len(writes) == count + 1
        written = writes[-1]
        assert written is not None
        await written

    try:
        await a.round()
        await b.round()
        lease = theirs[x].lease(40_000.0, output_tokens=200.0).keep()
        await turn()
        await b.round()
        peer = mine[x].peer
        assert peer is not None and peer.prefill_tokens == 40_000.0
        lease.prefilled()  # its first token: the prefill leaves the figures
        await turn()
        await b.round()
        peer = mine[x].peer
        assert peer is not None and peer.prefill_tokens == 0.0 and peer.decode_tokens == 200.0
        lease.release()
        await turn()
        await b.round()
        assert mine[x].peer is None
        assert (a.rounds, a.writes, a.published) == (1, 1, 3)
    finally:
        await a.stop()
        await b.stop()


async def test_a_round_right_after_a_lookups_read_is_left_out(client: AnyRedis) -> None:
    """A round due less than a round after the peers' figures were read in a lookup's round
    trip (`ride`), its own figures published, only repeats that read: it is left out. A round
    later, or once its figures changed unpublished, it goes to Redis again."""
    (x,) = urls(1)
    mine, theirs = fleet(x), fleet(x)
    now = [100.0]
    b = SharedLoad(client, lambda: list(mine.values()), round_s=0.125, clock=lambda: now[0])
    a = gateway(client, theirs)
    try:
        theirs[x].lease(500.0).keep()
        await a.round()
        mine[x].lease(1_000.0).keep()
        await b.round()
        assert b.num_peers >= 1 and b.rounds == 1
        wanted = b.ride()  # what the lookups' lane writes ahead of a batch
        assert wanted is not None
        command, done = wanted
        read: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        read.set_result(await client.execute_command(*command))
        done(read)
        assert b.rides == 1
        now[0] += 0.1
        assert not await b.tick() and b.skipped == 1 and b.rounds == 1
        now[0] += 0.05  # a round past the read
        assert await b.tick() and b.rounds == 2
        done(read)  # read again; then a change this gateway did not publish
        mine[x].lease(2_000.0).keep()
        assert await b.tick() and b.rounds == 3 and b.writes == 2
        assert b.skipped == 1
    finally:
        await a.stop()
        await b.stop()


async def test_a_peers_release_read_here_wakes_flow_control(client: AnyRedis) -> None:
    """A read that finds a peer's prefill or request gone from a replica runs flow control's
    wake-up (`FleetLoad.on_freed`), as this gateway's own lease ending does; a read that finds
    only more load, or the same, does not."""
    (x,) = urls(1)
    mine, theirs = fleet(x), fleet(x)
    a, b = gateway(client, theirs), gateway(client, mine)
    woken: list[int] = []
    mine[x].fleet.on_freed = lambda: woken.append(1)
    try:
        lease = theirs[x].lease(40_000.0, output_tokens=200.0).keep()
        await a.round()
        await b.round()
        theirs[x].lease(1_000.0).keep()
        await a.round()
        await b.round()
        assert mine[x].peer is not None and not woken  # more load: nothing freed
        lease.prefilled()
        await a.round()
        await b.round()
        assert len(woken) == 1
        await b.round()
        assert len(woken) == 1  # the same figures again
        lease.release()
        await a.round()
        await b.round()
        assert len(woken) == 2
    finally:
        await a.stop()
        await b.stop()
