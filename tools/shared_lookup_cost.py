"""What one lookup of the shared event index costs by chain length (docs/benchmarks-archive.md,
"Lookups of long chains" and "Prefix marks"): with prefix marks a lookup bisects to the deepest
marked block (log2(n) reads a domain), so the cost barely grows with the chain.

    PYTHONPATH=. python -m tools.shared_lookup_cost [REPEATS]

One real redis-server on a unix socket; an owner (`EventWriter`) writes one chain of N blocks
(16 tokens each) for each of D domains (D = 1, 4: every domain holds the whole chain, the most a
walk reads); a reader (`EventReader`) looks the chain up REPEATS times. Prints the median wall
time per lookup (client and Redis), the redis-server's CPU per lookup (/proc, 10-ms ticks, so
averaged over the repeats) and that per block, for N = 240 (a 4k-token chat), 750 (point 1's
12k-token agent prompts), 2,000 and 6,250 (a 100k-token agent session).

Nothing here is asserted; it prints numbers.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from cachemap.events import GPU, BlockStored, precise_keys
from cachemap.redis.client import open_redis
from cachemap.redis.events import EventReader, EventWriter
from loadgen.harness.processes import cpu_seconds
from loadgen.harness.redis_servers import RedisServer

SALT = "s"
LENGTHS = (240, 750, 2_000, 6_250)


async def run(repeats: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        server.start()
        try:
            pid = server.proc.pid if server.proc is not None else 0
            client = await open_redis(server.url, cluster=False)
            print(f"{repeats} lookups each; one redis-server, unix socket")
            for num_domains in (1, 4):
                for n in LENGTHS:
                    await client.flushall()
                    ids = list(range(1_000_000, 1_000_000 + 16 * n))
                    writer = EventWriter(client, block_size=16)
                    for d in range(num_domains):
                        domain = f"http://10.0.0.{d}:8000"
                        await writer.adopt(domain)
                        hashes = [d * 10_000_000 + i for i in range(n)]
                        writer.apply(domain, BlockStored(hashes, None, ids, 16, GPU, SALT))
                        await writer.commit(domain, 1, wiped=False)
                    await writer.flush()
                    reader = EventReader(client)
                    await reader.refresh()
                    keys = precise_keys(ids, SALT, 16)
                    found = await reader.lookup(keys)
                    assert len(found) == num_domains and all(m.depth == n for m in found.values())
                    walls = []
                    redis_cpu = cpu_seconds(pid)
                    for _ in range(repeats):
                        started = time.perf_counter()
                        await reader.lookup(keys)
                        walls.append(time.perf_counter() - started)
                    redis_us = (cpu_seconds(pid) - redis_cpu) / repeats * 1e6
                    wall_ms = statistics.median(walls) * 1e3
                    print(
                        f"{num_domains} domain(s), {n:5d} blocks: wall {wall_ms:6.2f} ms   "
                        f"redis-server CPU {redis_us / 1e3:6.2f} ms ({redis_us / n:5.2f} us/block)"
                    )
            await client.aclose()
        finally:
            server.stop()


def main(argv: list[str]) -> int:
    repeats = int(argv[0]) if argv and argv[0].isdigit() else 50
    asyncio.run(run(repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
