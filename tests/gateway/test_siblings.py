"""The pod's placement channel (`gateway.directory.siblings`) over real `AF_UNIX` datagram
sockets, as the supervisor makes them (`gateway.server.workers.placement_sockets`)."""

from __future__ import annotations

import asyncio
import os

from cachemap.keys import chain_hashes, root_hash
from cachemap.memory import MemoryDirectory
from gateway.directory.routing import RoutingDirectory
from gateway.directory.siblings import HASHES_PER_DATAGRAM, Siblings, decode, encode
from gateway.server.app import build_directory
from gateway.server.workers import placement_sockets, share_placements
from gateway.settings import Settings


async def until(predicate: object, what: str) -> None:
    for _ in range(1000):  # bounded: the datagrams are on loopback
        if predicate():  # type: ignore[operator]
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"never: {what}")


def test_a_long_chain_is_several_datagrams_each_a_run_of_it() -> None:
    chain = chain_hashes(b"x" * 256 * (HASHES_PER_DATAGRAM + 5), root_hash(b"s", "m"), 256)
    datagrams = encode(b"R", "http://r1:8000", chain, 1234.5)
    assert len(datagrams) == 2
    kind, replica, first, at_s = decode(datagrams[0])
    assert (kind, replica, at_s, len(first)) == (b"R", "http://r1:8000", 1234.5, 2048)
    assert first + decode(datagrams[1])[2] == chain


async def test_what_one_worker_places_every_other_workers_local_index_holds() -> None:
    """Three workers: a record at worker 0 reaches 1 and 2 (not Redis: none here), a drop at
    worker 2 reaches 0 and 1; a malformed datagram is counted and ignored."""
    ends = placement_sockets(3)
    workers = [RoutingDirectory(MemoryDirectory()) for _ in range(3)]
    for directory, socks in zip(workers, ends, strict=True):
        directory.siblings = Siblings(socks[0], socks[1:])
        await directory.start()
    try:
        chain = chain_hashes(b"y" * 256 * 6, root_hash(b"s", "m"), 256)
        await workers[0].record("http://r1:8000", chain)
        for w in workers[1:]:
            await until(lambda w=w: w.local.index.lookup(chain) == {"http://r1:8000": 6}, "rec")
        await workers[2].drop("http://r1:8000", chain[3:])
        for w in workers[:2]:
            await until(lambda w=w: w.local.index.lookup(chain) == {"http://r1:8000": 3}, "drop")
        ends[0][1].send(b"not a placement")  # worker 1's receiving end
        siblings = workers[1].siblings
        assert siblings is not None
        await until(lambda: siblings.stats.malformed == 1, "the malformed one counted")
        assert siblings.stats.received == 2
    finally:
        for directory in workers:
            await directory.close()


def test_a_pods_worker_looks_up_block_by_block_and_a_lone_gateway_bisects() -> None:
    """The other workers' records arrive as runs of a chain (a long one in several datagrams,
    any of which a full queue may drop), so a worker's local index walks each lookup; a lone
    gateway's records are whole chains, and its index bisects (`MemoryIndex.whole_chains`)."""
    alone = build_directory(Settings())
    assert isinstance(alone.local, MemoryDirectory) and alone.local.index.whole_chains
    ends = placement_sockets(2)
    worker = build_directory(Settings())
    share_placements(
        Settings(worker_placement_fds=tuple(os.dup(s.fileno()) for s in ends[0])), worker
    )
    try:
        assert isinstance(worker.local, MemoryDirectory) and not worker.local.index.whole_chains
    finally:
        assert worker.siblings is not None
        worker.siblings.close()
        for socks in ends:
            for sock in socks:
                sock.close()
