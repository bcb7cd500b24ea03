"""A fan-out leader cancelled while its shared marker is being set leaves no flight behind
(issue 14, item 12): the real directory facade over a real redis-server that stops answering
(SIGSTOP), so the cancellation lands inside the marker's Redis call; and the leader's marker
landed whatever became of its call (holds over Redis, lead's round)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from cachemap.keys import chain_hashes, root_hash
from cachemap.memory import MemoryDirectory, MemoryIndex
from cachemap.redis.client import open_redis
from cachemap.redis.directory import RedisDirectory
from cachemap.redis.schema import block_keys, text
from gateway.directory.routing import RoutingDirectory
from gateway.pipeline.flights import FAIL, OK, PENDING, Flights, Marker
from loadgen.harness.redis_servers import RedisServer

pytestmark = pytest.mark.redis


async def _directory(redis: RedisServer, deadline_s: float) -> RoutingDirectory:
    """A gateway's routing directory over `redis` (its own connection), its writers tracked."""
    return RoutingDirectory(
        MemoryDirectory(MemoryIndex()),
        RedisDirectory(await open_redis(redis.url, cluster=False)),
        deadline_s=deadline_s,
        track_writers=True,
    )


async def test_a_leader_cancelled_while_announcing_itself_leaves_no_flight(
    fresh_redis: RedisServer,
) -> None:
    directory = await _directory(
        fresh_redis, 30.0
    )  # the marker's call waits: the cancellation comes first
    await directory.start()
    flights = Flights(shared=directory)
    blocks = chain_hashes(b"a shared prefix " * 400, root_hash(b"salt", "m"), 256)
    assert fresh_redis.proc is not None
    os.kill(fresh_redis.proc.pid, signal.SIGSTOP)  # Redis stops answering
    try:
        leading = asyncio.create_task(flights.lead("r1", blocks, 1.0, 10.0))
        await asyncio.sleep(0.2)
        assert not leading.done()  # inside the marker's Redis call
        leading.cancel()  # the leader's client left (its task is cancelled)
        with pytest.raises(asyncio.CancelledError):
            await leading
    finally:
        os.kill(fresh_redis.proc.pid, signal.SIGCONT)
    assert len(flights) == 0  # before the fix: every block stayed "being written" forever
    assert flights.find(blocks, 0) is None  # a later sibling finds nothing to hold on
    await directory.close()


async def test_a_marker_set_after_its_call_timed_out_still_lands(
    fresh_redis: RedisServer,
) -> None:
    """Holds over Redis (lead's round): the leader's marker call misses its deadline (5 ms by
    default, often missed on a loaded machine) but Redis runs it anyway — the script was on the
    socket. Before the fix the leader took the timeout for "no marker", never landed it, and
    the pending marker stayed for the whole hold: every sibling at another gateway (or at this
    one, once the leader had ended) that looked it up was held until its timeout."""
    directory = await _directory(fresh_redis, 0.05)
    sibling_directory = await _directory(fresh_redis, 5.0)
    await directory.start()
    await sibling_directory.start()
    leader_flights = Flights(shared=directory)
    sibling_flights = Flights(shared=sibling_directory)
    salt = root_hash(b"salt", "m")
    # the scripts are loaded (a call while Redis is stopped must not need a SCRIPT LOAD)
    await leader_flights.lead("r1", chain_hashes(b"warm-up " * 100, salt, 256), 1.0, 10.0)
    blocks = chain_hashes(b"a shared prefix " * 400, salt, 256)
    assert fresh_redis.proc is not None
    os.kill(fresh_redis.proc.pid, signal.SIGSTOP)  # Redis is descheduled past the deadline
    try:
        flight = await leader_flights.lead("r1", blocks, 1.0, 10.0)  # the call times out
    finally:
        os.kill(fresh_redis.proc.pid, signal.SIGCONT)  # ...and Redis runs the script
    admin = await open_redis(fresh_redis.url, cluster=False)
    key = block_keys([blocks[0]])[0] + b":w"  # the flight's one marker, on its first block
    for _ in range(1000):  # the script came on another connection: read until it has run
        if await admin.get(key) is not None:
            break
    marker = Marker.parse(text((await admin.get(key)).split(b"\n", 1)[0]))
    assert marker is not None and marker.state == PENDING
    lookup = await sibling_directory.lookup(blocks)
    assert lookup.writer_depth == len(blocks) and lookup.writer is not None
    waiting = asyncio.create_task(
        sibling_flights.wait_remote(
            marker.key, 3.0, lambda: sibling_directory.read_marker(blocks[lookup.writer_from])
        )
    )
    leader_flights.end(flight, ok=True)  # the leader's first byte
    landed = await waiting
    assert landed is not None and landed.state == OK  # before the fix: None after 3 s
    assert sibling_flights.stats.timeouts == 0
    await admin.aclose()
    await directory.close()
    await sibling_directory.close()


async def test_a_landing_that_overtakes_its_late_marker_leaves_no_pending_marker(
    fresh_redis: RedisServer,
) -> None:
    """The other order of the same race: the marker's call missed its deadline and Redis runs
    it only after the leader's landing (a different connection). Before the fix the landing
    found no marker to turn "ok", and the late marker then stayed pending for its whole ttl."""
    client = await open_redis(fresh_redis.url, cluster=False)
    store = RedisDirectory(client).markers
    blocks = chain_hashes(b"a shared prefix " * 400, root_hash(b"salt", "m"), 256)
    pending = Marker(PENDING, "gw:1", "r1", 1.0)
    await store.land(blocks, pending.format(), pending.landed(True).format(), 2.0)
    await store.lead(blocks, pending.format(), 10.0)  # the late call
    marker = await store.read_marker(blocks[0])  # the flight's one marker
    assert marker is not None and Marker.parse(marker) == pending.landed(True)
    other = Marker(PENDING, "gw:2", "r2", 1.0)  # another leader's marker is never touched
    blocks2 = chain_hashes(b"another prefix " * 400, root_hash(b"salt", "m"), 256)
    await store.lead(blocks2, other.format(), 10.0)
    await store.land(blocks2, pending.format(), pending.landed(True).format(), 2.0)
    assert await store.read_marker(blocks2[0]) == other.format()
    await client.aclose()


async def test_a_sibling_whose_leaders_marker_is_gone_is_released(
    fresh_redis: RedisServer,
) -> None:
    """A sibling holds on another gateway's pending marker and the marker goes (Redis restarted
    empty, or the marker's ttl ran out): no landing can release it any more. Before the fix it
    took a vanished marker for a pending one and waited out its whole bound."""
    directory = await _directory(fresh_redis, 5.0)
    await directory.start()
    flights = Flights(shared=directory)
    blocks = chain_hashes(b"a shared prefix " * 400, root_hash(b"salt", "m"), 256)
    assert directory.shared is not None
    pending = Marker(PENDING, "other-gateway:1", "r1", 1.0)
    await directory.shared.markers.lead(blocks, pending.format(), 10.0)
    waiting = asyncio.create_task(
        flights.wait_remote(pending.key, 5.0, lambda: directory.read_marker(blocks[0]))
    )
    fresh_redis.cli("FLUSHALL")  # the store lost the marker
    released = await waiting
    assert released is not None and released.state == FAIL  # before the fix: None after 5 s
    assert flights.stats.timeouts == 0 and flights.stats.released_failed == 1
    await directory.close()


async def test_a_flight_is_one_marker_key_and_a_sibling_finds_how_far_it_shares_it(
    fresh_redis: RedisServer,
) -> None:
    """Fan-out markers cost Redis one SET per flight, not one per block (issue 17 item 4): the
    leader's flight starts where its replica's cache ended; a sibling's lookup finds the one
    key there and how far its own chain shares the flight, a diverged chain only that far, a
    chain that leaves before the flight starts nothing."""
    client = await open_redis(fresh_redis.url, cluster=False)
    store = RedisDirectory(client)
    store.register(["r1"])
    await store.start()
    salt = root_hash(b"salt", "m")
    blocks = chain_hashes(b"a shared prefix " * 400, salt, 256)  # 25 blocks
    await store.record("r1", blocks[:4])  # r1 holds the first four
    pending = Marker(PENDING, "gw:1", "r1", 1.0)
    sets_before = _calls(fresh_redis, "set")
    assert await store.markers.lead(blocks[4:], pending.format(), 10.0) == 1
    assert _calls(fresh_redis, "set") - sets_before == 1  # before: one SET per block (21)
    assert len(await client.keys("kvg:*:w")) == 1
    # a second leader of the same flight loses (first writer wins)
    other = Marker(PENDING, "gw:2", "r2", 1.0)
    assert await store.markers.lead(blocks[4:], other.format(), 10.0) == 0

    sibling = await store.lookup_full(blocks, writers=True)
    assert (sibling.writer_depth, sibling.writer_from) == (len(blocks), 4)
    assert sibling.writer == pending.format()
    diverged = blocks[:12] + chain_hashes(b"its own turn " * 400, salt, 256, parent=blocks[11])
    found = await store.lookup_full(diverged, writers=True)
    assert (found.writer_depth, found.writer_from, found.writer) == (12, 4, pending.format())
    assert await store.markers.read_marker(diverged[found.writer_from]) == pending.format()
    left_early = blocks[:3] + chain_hashes(b"elsewhere " * 400, salt, 256, parent=blocks[2])
    assert (await store.lookup_full(left_early, writers=True)).writer is None

    gets_before, sets_before = _calls(fresh_redis, "get"), _calls(fresh_redis, "set")
    await store.markers.land(blocks[4:], pending.format(), pending.landed(True).format(), 2.0)
    assert _calls(fresh_redis, "get") - gets_before == 1
    assert _calls(fresh_redis, "set") - sets_before == 1
    assert await store.markers.read_marker(blocks[4]) == pending.landed(True).format()
    await store.close()


def _calls(redis: RedisServer, command: str) -> int:
    """How many times Redis ran `command` (scripts' calls included: INFO commandstats)."""
    for line in redis.cli("INFO", "commandstats").splitlines():
        if line.startswith(f"cmdstat_{command}:"):
            return int(line.split("calls=", 1)[1].split(",", 1)[0])
    return 0


async def test_a_leaders_placement_goes_in_its_markers_call(fresh_redis: RedisServer) -> None:
    """Issue 39's tier CPU: a leader placed on r1 announces its flight and its placement in
    flight in ONE script call down the lookups' lane (`LEAD_PLACE`), not the marker there and
    the placement in a write-behind round trip of its own; another gateway's lookup matches
    the flight on r1 as far as a placement's (no last use) and finds the marker. A leader that
    does not place (another replica's keying, a landed leader's depth) writes the marker alone."""
    directory = await _directory(fresh_redis, 5.0)
    peer = await _directory(fresh_redis, 5.0)
    await directory.start()
    await peer.start()
    assert directory.shared is not None and peer.shared is not None
    directory.shared.register(["r1"])
    peer.shared.register(["r1"])
    flights = Flights(shared=directory)
    salt = root_hash(b"salt", "m")
    await flights.lead("r1", chain_hashes(b"warm-up " * 100, salt, 256), 1.0, 10.0, place=True)
    blocks = chain_hashes(b"a shared prefix " * 400, salt, 256)
    await directory.shared.record("r1", blocks[:4])  # r1 holds the first four
    fresh_redis.cli("CONFIG", "RESETSTAT")
    flight = await flights.lead("r1", blocks[4:], 1.0, 10.0, place=True)
    assert flight.placed and flight.marker is not None
    assert _calls(fresh_redis, "evalsha") == 1  # before: the marker's, then PLACE's pipeline
    assert _calls(fresh_redis, "set") == 1 and _calls(fresh_redis, "hset") == 1
    assert directory.writes.idle  # nothing queued for the write-behind
    # the placement extends r1's four (a lookup that finds the leader reports the entries)
    assert (await peer.shared.lookup_detail(blocks))["r1"] == (len(blocks), 0.0)
    found = await peer.shared.lookup_full(blocks, writers=True)
    assert found.writer == flight.marker.format() and found.writer_from == 4
    flights.end(flight, ok=True)
    await directory.writes.flushed()  # its landing

    other = chain_hashes(b"another prefix " * 400, salt, 256)
    fresh_redis.cli("CONFIG", "RESETSTAT")
    alone = await flights.lead("r1", other, 1.0, 10.0)
    assert not alone.placed and alone.marker is not None
    assert _calls(fresh_redis, "hset") == 0 and _calls(fresh_redis, "set") == 1
    assert "r1" not in await peer.shared.lookup_detail(other)
    await directory.close()
    await peer.close()


async def test_a_leaders_placement_whose_call_failed_is_written_behind(
    fresh_redis: RedisServer,
) -> None:
    """The marker's call missed its deadline (Redis stopped): the placement it carried may
    not have run, so it is queued for the write-behind too, and reaches Redis either way."""
    directory = await _directory(fresh_redis, 0.05)
    await directory.start()
    assert directory.shared is not None
    directory.shared.register(["r1"])
    flights = Flights(shared=directory)
    salt = root_hash(b"salt", "m")
    await flights.lead("r1", chain_hashes(b"warm-up " * 100, salt, 256), 1.0, 10.0, place=True)
    blocks = chain_hashes(b"a shared prefix " * 400, salt, 256)
    assert fresh_redis.proc is not None
    os.kill(fresh_redis.proc.pid, signal.SIGSTOP)
    try:
        flight = await flights.lead("r1", blocks, 1.0, 10.0, place=True)  # the call times out
    finally:
        os.kill(fresh_redis.proc.pid, signal.SIGCONT)
    assert flight.placed and directory.stats.marker_failures == 1
    await directory.writes.flushed()
    found = await directory.shared.lookup_detail(blocks)
    assert found["r1"] == (len(blocks), 0.0)
    flights.end(flight, ok=True)
    await directory.close()
