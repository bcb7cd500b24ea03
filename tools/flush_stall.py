"""How long a lookup of the shared event index waits behind an owner's flush
(docs/benchmarks-archive.md,
"A flush in bounded calls"): one `WRITE` and one `MAP` call per flush against calls of
`WRITE_CHUNK` blocks and `MAP_CHUNK` map fields.

    PYTHONPATH=. python -m tools.flush_stall [ROUNDS] [BLOCKS/FIELDS ...]

One real redis-server on a unix socket. An owner (`EventWriter`) holds 10,000 blocks on one
domain (20 chains of 500); each measured flush is a thrashing engine's batch: those 10,000
removed and 10,000 new ones stored (20,000 block writes). Meanwhile another process looks up a
240-block chain another domain holds, back to back, on its own connection (`EventReader`, the
lookup lane) and times each lookup. Per flush: the flush's wall time, the lookups that ran
during it and their median, p99 and slowest wall times. The arms alternate in one process
(`WRITE_CHUNK` and `MAP_CHUNK` set per arm: "one call" is the old single call of each per chain
slot; more arms as BLOCKS/FIELDS, e.g. 128/256), ROUNDS times each.

Nothing here is asserted; it prints numbers.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

from cachemap.events import GPU, BlockRemoved, BlockStored, precise_keys
from cachemap.redis import events
from cachemap.redis.client import open_redis
from cachemap.redis.events import EventReader, EventWriter
from loadgen.harness.redis_servers import RedisServer

SALT = "s"
CHAINS = 20
CHAIN_BLOCKS = 500
LOOKED_UP = 240
ARMS = {
    "one call": (10**9, 10**9),
    f"calls of {events.WRITE_CHUNK}": (events.WRITE_CHUNK, events.MAP_CHUNK),
}


def _ids(chain: int, generation: int) -> list[int]:
    start = 10_000_000 * (1 + generation) + chain * 100_000
    return list(range(start, start + 16 * CHAIN_BLOCKS))


def _hashes(chain: int, generation: int) -> list[int]:
    start = 1_000_000 * (1 + generation) + chain * 1_000
    return list(range(start, start + CHAIN_BLOCKS))


def _looker(url: str, conn: Connection) -> None:
    """The other gateway: lookups back to back until told to stop, then (start, wall) each."""

    async def loop() -> list[tuple[float, float]]:
        client = await open_redis(url)
        reader = EventReader(client)
        await reader.refresh()
        keys = precise_keys(list(range(16 * LOOKED_UP)), SALT, 16)
        assert (await reader.lookup(keys))["http://looked-up:8000"].depth == LOOKED_UP
        conn.send("ready")
        timings: list[tuple[float, float]] = []
        while not conn.poll():
            started = time.perf_counter()
            await reader.lookup(keys)
            timings.append((started, time.perf_counter() - started))
        await reader.close()
        await client.aclose()
        return timings

    conn.send(asyncio.run(loop()))


async def _rounds(url: str, rounds: int, arms: dict[str, tuple[int, int]]) -> None:
    client = await open_redis(url)
    writer = EventWriter(client, block_size=16)
    await writer.adopt("http://looked-up:8000")
    writer.apply(
        "http://looked-up:8000",
        BlockStored(
            list(range(1, LOOKED_UP + 1)), None, list(range(16 * LOOKED_UP)), 16, GPU, SALT
        ),
    )
    domain = "http://thrashing:8000"
    await writer.adopt(domain)
    for chain in range(CHAINS):
        writer.apply(domain, BlockStored(_hashes(chain, 0), None, _ids(chain, 0), 16, GPU, SALT))
    await writer.flush()
    ours, theirs = multiprocessing.Pipe()
    looker = multiprocessing.get_context("spawn").Process(target=_looker, args=(url, theirs))
    looker.start()
    assert ours.recv() == "ready"
    windows: list[tuple[str, float, float]] = []
    generation = 0
    for _ in range(rounds):
        for arm, (blocks, fields) in arms.items():
            events.WRITE_CHUNK, events.MAP_CHUNK = blocks, fields
            for chain in range(CHAINS):
                writer.apply(domain, BlockRemoved(_hashes(chain, generation), GPU))
                stored = BlockStored(
                    _hashes(chain, generation + 1), None, _ids(chain, generation + 1), 16, GPU, SALT
                )
                writer.apply(domain, stored)
            generation += 1
            started = time.perf_counter()
            await writer.flush()
            windows.append((arm, started, time.perf_counter()))
            await asyncio.sleep(0.2)  # the looker's lookups between two flushes: unmeasured
    ours.send("stop")
    timings: list[tuple[float, float]] = ours.recv()
    looker.join()
    await client.aclose()
    print(f"{CHAINS * CHAIN_BLOCKS * 2:,} block writes a flush; lookups of {LOOKED_UP} blocks")
    print(f"{'arm':<16} {'flush ms':>9} {'lookups':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for arm, start, end in windows:
        during = sorted(w for s, w in timings if start <= s + w and s <= end)
        p99 = during[min(len(during) - 1, int(len(during) * 0.99))] if during else 0.0
        slowest = during[-1] if during else 0.0
        p50 = statistics.median(during) if during else 0.0
        print(
            f"{arm:<16} {(end - start) * 1e3:9.1f} {len(during):8d} {p50 * 1e3:8.2f} "
            f"{p99 * 1e3:8.2f} {slowest * 1e3:8.2f}"
        )
    for arm in arms:
        flushes = [(e - s) * 1e3 for a, s, e in windows if a == arm]
        print(f"{arm:<16} median flush {statistics.median(flushes):.1f} ms")


def main(argv: list[str]) -> int:
    rounds = int(argv[0]) if argv and argv[0].isdigit() else 3
    arms = dict(ARMS)
    for arm in argv[1:]:
        blocks, fields = arm.split("/")
        arms[arm] = (int(blocks), int(fields))
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        server.start()
        try:
            asyncio.run(_rounds(server.url, rounds, arms))
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
