"""What the load view shared over Redis costs (docs/benchmarks-archive.md, "A load view shared over
Redis").

    PYTHONPATH=. python -m tools.shared_load_cost [SAMPLES]

One real redis-server on a unix socket; G gateways' `SharedLoad` (G = 2, 8) over R replicas
(R = 4, 16, 64), every gateway one round after another as their 0.1-s rounds would interleave.
Per round and gateway, medians over SAMPLES x 50 rounds of each: this process's CPU
(`process_time`: the gateway's Python, encoding its figures and decoding its peers') and the
redis-server's (from /proc), for

- `idle`: no gateway has a request in flight (each publishes an empty list: the heartbeat);
- `busy`: every gateway has requests on every replica (the most a round carries).

Nothing here is asserted; it prints numbers.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from cachemap.redis.client import open_redis
from gateway.fleet.replicas import FleetLoad, ReplicaState
from gateway.fleet.shared_load import SharedLoad
from loadgen.harness.processes import cpu_seconds
from loadgen.harness.redis_servers import RedisServer

ROUNDS_PER_SAMPLE = 50
ROUND_S = 0.1


async def sample(gateways: list[SharedLoad], pid: int) -> tuple[float, float]:
    """CPU per round and gateway: this process's and the redis-server's (us)."""
    cpu, redis_cpu = time.process_time(), cpu_seconds(pid)
    for _ in range(ROUNDS_PER_SAMPLE):
        for g in gateways:
            await g.round()
    n = ROUNDS_PER_SAMPLE * len(gateways)
    return (
        (time.process_time() - cpu) / n * 1e6,
        (cpu_seconds(pid) - redis_cpu) / n * 1e6,
    )


async def run(samples: int) -> None:
    rows: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        server.start()
        try:
            pid = server.proc.pid if server.proc is not None else 0
            client = await open_redis(server.url, cluster=False)
            for num_gateways in (2, 8):
                for num_replicas in (4, 16, 64):
                    await client.flushall()
                    urls = [f"http://10.0.0.{i}:8000" for i in range(num_replicas)]
                    fleets = []
                    for _ in range(num_gateways):
                        shared = FleetLoad()
                        fleets.append({u: ReplicaState(u, True, fleet=shared) for u in urls})
                    gateways = [
                        SharedLoad(client, lambda f=f: list(f.values()), ROUND_S, f"g{i}")
                        for i, f in enumerate(fleets)
                    ]
                    name = f"{num_gateways} gateways, {num_replicas} replicas"
                    for _ in range(samples):
                        rows.setdefault(f"idle, {name}", []).append(await sample(gateways, pid))
                    for f in fleets:
                        for state in f.values():
                            for _ in range(3):
                                state.lease(12_000.0, 300.0).keep()
                    for _ in range(samples):
                        rows.setdefault(f"busy, {name}", []).append(await sample(gateways, pid))
                    peer = fleets[0][urls[0]].peer
                    assert peer is not None and peer.num_inflight == 3 * (num_gateways - 1)
            await client.aclose()
        finally:
            server.stop()
    print(f"{samples} samples, medians (one redis-server, unix socket; rounds every {ROUND_S} s)")
    for name, values in rows.items():
        gateway_us = statistics.median(v[0] for v in values)
        redis_us = statistics.median(v[1] for v in values)
        share = gateway_us / ROUND_S / 1e6 * 100
        print(
            f"{name:32s} a gateway's CPU us/round: {gateway_us:7.1f} ({share:.2f}% of a core)   "
            f"redis-server us/round: {redis_us:6.1f}"
        )


def main(argv: list[str]) -> int:
    samples = int(argv[0]) if argv and argv[0].isdigit() else 5
    asyncio.run(run(samples))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
