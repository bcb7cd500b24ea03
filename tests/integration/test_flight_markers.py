"""A fan-out leader cancelled while its shared marker is being set leaves no flight behind
(issue 14, item 12): the real directory facade over a real redis-server that stops answering
(SIGSTOP), so the cancellation lands inside the marker's Redis call."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from cachemap.keys import chain_hashes, root_hash
from cachemap.memory import MemoryDirectory, MemoryIndex
from cachemap.redis.client import open_redis
from cachemap.redis.directory import RedisDirectory
from gateway.directory.routing import RoutingDirectory
from gateway.pipeline.flights import Flights
from loadgen.harness.redis_servers import RedisServer

pytestmark = pytest.mark.redis


async def test_a_leader_cancelled_while_announcing_itself_leaves_no_flight(
    fresh_redis: RedisServer,
) -> None:
    directory = RoutingDirectory(
        MemoryDirectory(MemoryIndex()),
        RedisDirectory(await open_redis(fresh_redis.url, cluster=False)),
        deadline_s=30.0,  # the marker's call waits: the cancellation comes first
        track_writers=True,
    )
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
