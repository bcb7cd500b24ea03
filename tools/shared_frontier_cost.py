"""What eviction frontiers over the shared index cost (docs/benchmarks-archive.md,
"Frontiers over the
shared index").

    PYTHONPATH=. python -m tools.shared_frontier_cost [ROUNDS]

One real redis-server on a unix socket; one owner (`EventWriter` with `track_recency` and its
`SharedFrontiers`) owning D domains, each holding 256 runs of 16 blocks; one other gateway's
`SharedFrontiers` reading them. For D = 4, 16, 64, CPU per round (`process_time`: this
process, both gateways' Python; and the redis-server's, from /proc), medians over ROUNDS x 50
rounds:

- `idle`: nothing moved (the owner publishes nothing; both fetch the versions and epochs
  only) — the cost every gateway pays 10 times a second, at `ROUND_S`;
- `busy`: every domain's order moves every round (under load every engine step moves it):
  published at most every `PUBLISH_EVERY_S` of the rounds' clock (0.1 s a round), and, for
  the ratio, `busy, every round` (published at every round, as before that limit).

And per touch (a placement on a domain owned elsewhere), for a 64-block chain and a
6,250-block one (a 100k-token agent session): the sender's CPU (`touch` + its RPUSH) and the
owner's (its LPOP and the touch applied to its order).

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
from cachemap.redis.client import AnyRedis, open_redis
from cachemap.redis.events import EventReader, EventWriter
from cachemap.redis.frontiers import PUBLISH_EVERY_S, ROUND_S, SharedFrontiers
from loadgen.harness.processes import cpu_seconds
from loadgen.harness.redis_servers import RedisServer

RUNS, RUN_BLOCKS = 256, 16
ROUNDS_PER_SAMPLE = 50
SALT = "s"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def tokens(chain: int, n_blocks: int) -> list[int]:
    return [chain * 100_000 + i for i in range(16 * n_blocks)]


async def owner_of(
    client: AnyRedis, domains: list[str], clock: Clock
) -> tuple[EventWriter, SharedFrontiers]:
    writer = EventWriter(client, block_size=16, track_recency=True, clock=clock)
    for d, domain in enumerate(domains):
        await writer.adopt(domain)
        for run in range(RUNS):  # one run per store: each 2 s after the last
            clock.now += 2.0
            ids = tokens(d * RUNS + run, RUN_BLOCKS)
            hashes = [(d * RUNS + run) * 100 + i for i in range(RUN_BLOCKS)]
            writer.apply(domain, BlockStored(hashes, None, ids, 16, GPU, SALT))
        await writer.commit(domain, 1, wiped=False)
    await writer.flush()
    return writer, SharedFrontiers(client, EventReader(client), writer, clock)


async def rounds(
    owner: SharedFrontiers, other: SharedFrontiers, pid: int, move: list[str] | None
) -> tuple[float, float]:
    """CPU per round, both gateways' and the redis-server's (us)."""
    writer = owner.writer
    assert writer is not None
    cpu, redis_cpu = time.process_time(), cpu_seconds(pid)
    for _ in range(ROUNDS_PER_SAMPLE):
        owner.clock.now += ROUND_S  # type: ignore[attr-defined]
        if move is not None:
            writer.frontiers_moved(move)
        await owner.round()
        await other.round()
    return (
        (time.process_time() - cpu) / ROUNDS_PER_SAMPLE * 1e6,
        (cpu_seconds(pid) - redis_cpu) / ROUNDS_PER_SAMPLE * 1e6,
    )


async def touches(
    owner: SharedFrontiers, other: SharedFrontiers, domain: str, n_blocks: int, pid: int
) -> tuple[float, float, float]:
    """(sender us, owner us, redis-server us) per touch of an n-block chain the domain holds."""
    writer = owner.writer
    assert writer is not None
    keys = precise_keys(tokens(40_000, n_blocks), SALT, 16)
    hashes = [9_000_000 + i for i in range(n_blocks)]
    writer.apply(domain, BlockStored(hashes, None, tokens(40_000, n_blocks), 16, GPU, SALT))
    await writer.flush()
    await other.round()
    count = 20
    redis_cpu = cpu_seconds(pid)
    cpu = time.process_time()
    for _ in range(count):
        other.touch(domain, keys, owner.clock())
    await other.close()
    sent = time.process_time()
    target = owner.touches_applied + count
    while owner.touches_applied < target:
        await owner.round()
    applied = time.process_time()
    return (
        (sent - cpu) / count * 1e6,
        (applied - sent) / count * 1e6,
        (cpu_seconds(pid) - redis_cpu) / count * 1e6,
    )


async def run(samples: int) -> None:
    rows: dict[str, list[tuple[float, ...]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        server.start()
        try:
            pid = server.proc.pid if server.proc is not None else 0
            for num_domains in (4, 16, 64):
                client = await open_redis(server.url, cluster=False)
                await client.flushall()
                clock = Clock()
                domains = [f"http://10.0.{num_domains}.{i}:8000" for i in range(num_domains)]
                _, owner = await owner_of(client, domains, clock)
                other = SharedFrontiers(client, EventReader(client), None, clock)
                await owner.round()
                await other.round()
                assert other.num_blocks(domains[0]) == RUNS * RUN_BLOCKS
                for _ in range(samples):
                    rows.setdefault(f"idle, {num_domains} domains", []).append(
                        await rounds(owner, other, pid, None)
                    )
                    rows.setdefault(f"busy, {num_domains} domains", []).append(
                        await rounds(owner, other, pid, domains)
                    )
                    owner.publish_every_s = 0.0
                    rows.setdefault(f"busy, every round, {num_domains}", []).append(
                        await rounds(owner, other, pid, domains)
                    )
                    owner.publish_every_s = PUBLISH_EVERY_S
                if num_domains == 4:
                    for n in (64, 6250):
                        for _ in range(samples):
                            rows.setdefault(f"touch, {n} blocks", []).append(
                                await touches(owner, other, domains[0], n, pid)
                            )
                await client.aclose()
        finally:
            server.stop()
    print(
        f"{samples} samples, medians (one redis-server, unix socket; {RUNS} runs of "
        f"{RUN_BLOCKS} blocks per domain)"
    )
    for name, values in rows.items():
        med = [statistics.median(v[i] for v in values) for i in range(len(values[0]))]
        if name.startswith("touch"):
            print(
                f"{name:22s} sender CPU us: {med[0]:8.1f}   owner CPU us: {med[1]:8.1f}   "
                f"redis-server CPU us: {med[2]:7.1f}"
            )
        else:
            share = (med[0] + med[1]) * 10 / 1e6 * 100  # 10 rounds a second
            print(
                f"{name:22s} both gateways' CPU us/round: {med[0]:8.1f}   redis-server: "
                f"{med[1]:7.1f}   (at 10 rounds/s: {share:.2f}% of a core)"
            )


def main(argv: list[str]) -> int:
    samples = int(argv[0]) if argv and argv[0].isdigit() else 5
    asyncio.run(run(samples))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
