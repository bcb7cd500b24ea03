"""The Redis directory benchmark: lookup latency and throughput by chain length, on a single
node and on a 3-master cluster, and Redis memory per cached block entry (issue #3).

Everything runs in one process against servers this command starts on free loopback ports; the
in-process directory runs the same lookups in the same run as the reference.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Sequence
from typing import Any

import redis

from cachemap.keys import BlockHash, chain_hashes, root_hash
from cachemap.memory import MemoryDirectory
from cachemap.redis.client import open_redis
from cachemap.redis.directory import RedisDirectory
from loadgen.harness.redis_servers import redis_cluster, redis_server
from loadgen.runner import percentile

CHAIN_LENGTHS = (8, 64, 512)
REPLICAS = tuple(f"http://10.0.0.{i}:8000" for i in range(8))


def add_bench_directory_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lookups", type=int, default=2000, help="lookups per measurement")
    parser.add_argument("--concurrency", type=int, default=32, help="lookups in flight")
    parser.add_argument("--chains", type=int, default=64, help="distinct chains per length")
    parser.add_argument(
        "--memory-entries",
        type=int,
        default=200_000,
        help="prefix entries stored to measure memory",
    )
    parser.add_argument("--skip-cluster", action="store_true", help="skip the Redis Cluster arm")


def _chains(length: int, count: int) -> list[list[BlockHash]]:
    out = []
    for i in range(count):
        data = f"chain {length}/{i} ".encode() * (256 * length // 10 + 40)
        out.append(chain_hashes(data, root_hash(b"tenant", "model"), 256)[:length])
    return out


async def _prepare(directory: Any, chains: Sequence[list[BlockHash]]) -> None:
    for i, chain in enumerate(chains):
        await directory.record(REPLICAS[i % len(REPLICAS)], chain)
        await directory.record(REPLICAS[(i + 1) % len(REPLICAS)], chain[: len(chain) // 2])


async def _measure(
    directory: Any, chains: Sequence[list[BlockHash]], n: int, concurrency: int
) -> dict[str, float]:
    latencies = []
    for i in range(min(n, 1000)):  # one at a time: latency
        start = time.perf_counter()
        depth = await directory.lookup(chains[i % len(chains)])
        latencies.append(time.perf_counter() - start)
        assert max(depth.values()) == len(chains[i % len(chains)])
    counter = iter(range(n))

    async def worker() -> None:
        for i in counter:
            await directory.lookup(chains[i % len(chains)])

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    return {
        "p50_ms": percentile(latencies, 0.5) * 1e3,
        "p99_ms": percentile(latencies, 0.99) * 1e3,
        "mean_ms": statistics.fmean(latencies) * 1e3,
        "lookups_per_s": n / elapsed,
    }


async def _store_rows(
    name: str, directory: Any, args: argparse.Namespace
) -> list[tuple[str, int, dict[str, float]]]:
    rows = []
    for length in CHAIN_LENGTHS:
        chains = _chains(length, args.chains)
        await _prepare(directory, chains)
        rows.append(
            (name, length, await _measure(directory, chains, args.lookups, args.concurrency))
        )
    return rows


async def _redis_rows(
    url: str, name: str, args: argparse.Namespace
) -> list[tuple[str, int, dict[str, float]]]:
    directory = RedisDirectory(await open_redis(url))
    directory.register(REPLICAS)
    await directory.refresh_generations()
    try:
        return await _store_rows(name, directory, args)
    finally:
        await directory.close()


async def _memory_per_entry(url: str, entries: int) -> dict[str, float]:
    """used_memory growth per (block, replica) entry: one replica per block, then a second."""
    sync = redis.Redis.from_url(url)
    directory = RedisDirectory(await open_redis(url))
    directory.register(REPLICAS)
    try:
        before = int(sync.info("memory")["used_memory"])
        length = 512
        chains = _chains(length, entries // length)
        for chain in chains:
            await directory.record(REPLICAS[0], chain)
        one = int(sync.info("memory")["used_memory"])
        for chain in chains:
            await directory.record(REPLICAS[1], chain)
        two = int(sync.info("memory")["used_memory"])
        blocks = len(chains) * length
        return {
            "blocks": blocks,
            "bytes_per_block_one_replica": (one - before) / blocks,
            "bytes_per_extra_replica": (two - one) / blocks,
        }
    finally:
        sync.close()
        await directory.close()


def run_bench_directory(args: argparse.Namespace) -> int:
    rows = asyncio.run(_store_rows("in-process", MemoryDirectory(), args))
    with redis_server(port=0) as server:
        rows += asyncio.run(_redis_rows(server.url, "redis single node", args))
        memory = asyncio.run(_memory_per_entry(server.url, args.memory_entries))
    if not args.skip_cluster:
        with redis_cluster() as cluster:
            rows += asyncio.run(_redis_rows(cluster.url, "redis cluster (3 masters)", args))
    print(
        f"lookups: {args.lookups} per row, concurrency {args.concurrency}, "
        f"{args.chains} chains per length, 2 replicas per chain"
    )
    print(f"{'store':<27} {'blocks':>6} {'p50 ms':>8} {'p99 ms':>8} {'lookups/s':>10}")
    for name, length, m in rows:
        p50, p99, rate = m["p50_ms"], m["p99_ms"], m["lookups_per_s"]
        print(f"{name:<27} {length:>6} {p50:>8.3f} {p99:>8.3f} {rate:>10.0f}")
    print(
        f"redis memory: {memory['bytes_per_block_one_replica']:.0f} B per cached block entry "
        f"(one replica), +{memory['bytes_per_extra_replica']:.0f} B per further replica "
        f"holding it ({memory['blocks']:.0f} blocks)"
    )
    return 0
