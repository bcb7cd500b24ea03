"""What a fan-out leader's placement in flight costs the client and Redis, written with its
marker (`LEAD_PLACE`, one script call down the lookups' lane) against written behind (its own
`PLACE` pipeline on a pooled connection, as before): docs/design/directory.md, "The tier's CPU
per request".

    PYTHONPATH=. python -m tools.lead_place_cost [REQUESTS] [ROUNDS] [marker|behind]

(With a way named, only that way runs, ROUNDS times: for `valgrind --tool=callgrind`, whose
instruction counts of two request counts' difference do not depend on the machine's load.)

One redis-server over loopback TCP; a gateway's `RoutingDirectory` and `Flights` on it. Each
request: the lookup of a 330-block chain whose first 30 blocks its replica holds, the leader's
marker (and, the "with the marker" way, its placement), the placement written behind (the
other way), the flight's end (its landing) and its first token's record, each write-behind
batch flushed before the next request. The two ways alternate A B B A per round; each run's
process CPU (this process: the client) and redis-server's (`INFO cpu`, main thread) per
request are printed, with the script calls Redis ran and their time (`INFO commandstats`).
Nothing is asserted; it prints numbers.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis

from cachemap.keys import chain_hashes, root_hash
from cachemap.memory import MemoryDirectory, MemoryIndex
from cachemap.redis.client import open_redis
from cachemap.redis.directory import RedisDirectory
from gateway.directory.routing import RoutingDirectory
from gateway.pipeline.flights import Flights
from loadgen.harness.processes import free_port
from loadgen.harness.redis_servers import RedisServer

BLOCKS = 330
HELD = 30


async def _run(directory: RoutingDirectory, requests: int, with_marker: bool) -> None:
    flights = Flights(shared=directory)
    salt = root_hash(b"salt", "m")
    shared = directory.shared
    assert shared is not None
    for _ in range(requests):
        hashes = chain_hashes(uuid.uuid4().bytes * (BLOCKS * 16), salt, 256)[:BLOCKS]
        await shared.record("r1", hashes[:HELD])
        lookup = await directory.lookup(hashes)
        held = lookup.overlap.get("r1", 0)
        flight = await flights.lead("r1", hashes[held:], 1.0, 10.0, place=with_marker)
        if not flight.placed:
            directory.place("r1", hashes, held)
        await directory.writes.flushed()
        flights.end(flight, ok=True)
        await directory.record("r1", hashes)
        await directory.writes.flushed()


def _redis_cpu(sync: redis.Redis) -> float:
    """redis-server's main thread's CPU seconds so far (`INFO cpu`: microsecond resolution,
    where /proc counts 10-ms ticks)."""
    cpu = sync.info("cpu")
    return float(cpu["used_cpu_user_main_thread"]) + float(cpu["used_cpu_sys_main_thread"])


async def main(requests: int, rounds: int, only: str = "") -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp), port=free_port())
        server.start()
        try:
            directory = RoutingDirectory(
                MemoryDirectory(MemoryIndex()),
                RedisDirectory(await open_redis(server.url, cluster=False)),
                deadline_s=1.0,
                track_writers=True,
            )
            await directory.start()
            assert directory.shared is not None
            directory.shared.register(["r1"])
            sync = redis.Redis.from_url(server.url)
            await _run(directory, 20, True)  # scripts loaded, connections open
            await _run(directory, 20, False)
            print(f"{requests} requests a run, {BLOCKS}-block chains, {HELD} held; µs a request")
            for _ in range(rounds):
                ways = (False, True, True, False) if not only else (only == "marker",)
                for with_marker in ways:
                    sync.config_resetstat()
                    client0, redis0 = time.process_time(), _redis_cpu(sync)
                    await _run(directory, requests, with_marker)
                    per = max(requests, 1)  # 0: start-up only (callgrind's baseline)
                    client = (time.process_time() - client0) / per * 1e6
                    server_us = (_redis_cpu(sync) - redis0) / per * 1e6
                    stats = sync.info("commandstats").get("cmdstat_evalsha", {})
                    evalsha = int(stats.get("calls", 0)) / per
                    usec = int(stats.get("usec", 0)) / per
                    way = "with the marker" if with_marker else "written behind "
                    print(
                        f"{way}: client {client:7.0f}  redis-server {server_us:7.0f}"
                        f"  script calls {evalsha:.2f} ({usec:.0f} µs)"
                    )
            sync.close()
            await directory.close()
        finally:
            server.stop()


if __name__ == "__main__":
    asyncio.run(
        main(
            int(sys.argv[1]) if len(sys.argv) > 1 else 400,
            int(sys.argv[2]) if len(sys.argv) > 2 else 2,
            sys.argv[3] if len(sys.argv) > 3 else "",
        )
    )
