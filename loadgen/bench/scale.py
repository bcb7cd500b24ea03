"""`kvgate bench-scale`: what one Redis and a 3-master Cluster carry for the shared directory
(issue 39 item 6), from Redis's own CPU time per routed request.

A routed request costs the directory, on Redis: its lookup (with its conversation's home), the
placement in flight, the record at its first token with its count, and the home's write. This
command replays that mix for conversations of a given number of blocks against a redis-server
(and a 3-master Cluster) it starts, and reads each server's CPU seconds (`INFO cpu`) before
and after: Redis's busy time per request. Redis runs commands on one thread, so one server's
ceiling is ~1 / that time; the knee (latency rising) comes well before — the plan in
docs/design/directory.md takes 70%. Measuring Redis's CPU rather than driving it to saturation
keeps the run bounded and independent of the client: one Python process on a 2-core machine
saturates long before Redis does.

Every loop is bounded by `--requests`; the servers are on free loopback ports.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass

import redis

from cachemap.affinity import MAX_WALK_BLOCKS
from cachemap.keys import BlockHash, chain_hashes, root_hash
from cachemap.redis.client import open_redis
from cachemap.redis.directory import RedisDirectory
from loadgen.harness.redis_servers import redis_cluster, redis_server

REPLICAS = tuple(f"http://10.0.0.{i}:8000" for i in range(8))
KNEE = 0.7
"""The share of one Redis thread the plan loads it to: past it queueing grows fast."""
MAX_REQUESTS = 20_000
IDLE_SAMPLE_S = 1.0
"""The servers' idle CPU is sampled this long first and taken out of the run's."""


def add_bench_scale_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=2000, help="routed requests per row")
    parser.add_argument(
        "--blocks", default="16,64,256", help="blocks per request's chain (comma-separated)"
    )
    parser.add_argument("--conversations", type=int, default=64, help="conversations replayed")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    parser.add_argument("--skip-cluster", action="store_true", help="skip the Redis Cluster arm")
    parser.add_argument(
        "--new-blocks",
        type=int,
        default=0,
        help="blocks new to each request (its conversation's other blocks held since its first "
        "turn; 0: each turn a block longer than the one before)",
    )


def _conversation(i: int, blocks: int) -> list[BlockHash]:
    data = f"conversation {i} of the scale bench ".encode() * (256 * blocks // 30 + 20)
    return chain_hashes(data, root_hash(b"tenant", "model"), 256)[:blocks]


@dataclass
class _Run:
    redis_cpu_us: float
    """Every server's CPU time per request, the idle burn taken out."""
    client_rps: float
    calls: dict[str, float]
    """Commands per request by name (a script's own calls counted by Redis too)."""


def _turn(i: int, turn: int, blocks: int, new: int) -> list[BlockHash]:
    """Conversation `i`'s request at `turn` with `new` blocks of its own: its first
    `blocks - new` blocks are the conversation's (what every turn shares), the rest this turn's
    alone (a low hit ratio's mix: most of a request's blocks placed and recorded for the first
    time)."""
    held = _conversation(i, blocks)[: blocks - new]
    own = f" turn {turn} ".encode() * (256 * new // 6 + 20)
    data = f"conversation {i} of the scale bench ".encode() * (256 * blocks // 30 + 20)
    data = data[: 256 * len(held)] + own
    chain = chain_hashes(data, root_hash(b"tenant", "model"), 256)[:blocks]
    assert chain[: len(held)] == held
    return chain


def _calls(urls: list[str]) -> dict[str, int]:
    """Every server's commands run so far (`INFO commandstats`, a script's own calls included),
    by name, summed."""
    total: dict[str, int] = {}
    for url in urls:
        client = redis.Redis.from_url(url)
        try:
            for name, stat in client.info("commandstats").items():
                command = name.removeprefix("cmdstat_")
                total[command] = total.get(command, 0) + int(stat["calls"])
        finally:
            client.close()
    return total


def _cpu_s(urls: list[str]) -> float:
    total = 0.0
    for url in urls:
        client = redis.Redis.from_url(url)
        try:
            info = client.info("cpu")
            total += float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
        finally:
            client.close()
    return total


async def _replay(url: str, servers: list[str], blocks: int, args: argparse.Namespace) -> _Run:
    """Each request: a turn of a conversation, its chain growing by a block a turn (the last
    turn's blocks recorded, one new), as a gateway routes it: lookup with home, placement,
    record (with its count), home."""
    client = await open_redis(url)
    d = RedisDirectory(client)
    await d.start()
    d.register(REPLICAS)
    new = min(args.new_blocks, blocks)
    chains = [_conversation(i, blocks + 64) for i in range(args.conversations)]
    turn = [0] * len(chains)
    for i, chain in enumerate(chains):  # warm: every conversation's first turn held
        await d.record(REPLICAS[i % len(REPLICAS)], chain[:blocks])
    n = min(args.requests, MAX_REQUESTS)
    limit = asyncio.Semaphore(args.concurrency)
    requests = []
    for k in range(n):
        c = k % len(chains)
        turn[c] = min(turn[c] + 1, 63)
        if new:
            requests.append(_turn(c, k, blocks, new))
        else:
            requests.append(chains[c][: blocks + turn[c]])  # a block longer than the turn before

    async def one(k: int) -> None:
        c = k % len(chains)
        hashes = requests[k]
        replica = REPLICAS[c % len(REPLICAS)]
        async with limit:
            full = await d.lookup_full(hashes, rate_window_s=60.0, homes=MAX_WALK_BLOCKS)
            held = full.detail.get(replica, (0, 0.0))[0]
            await d.place(replica, hashes[held:])
            await d.record_many([(replica, hashes, None, full.held.get(replica))])
            await d.homes.record(hashes, replica, None, 3600.0)

    idle_before, idle_started = _cpu_s(servers), time.perf_counter()
    await asyncio.sleep(IDLE_SAMPLE_S)  # what the servers burn with nothing to do (cron, bus)
    idle_per_s = (_cpu_s(servers) - idle_before) / (time.perf_counter() - idle_started)
    calls_before = _calls(servers)
    before, started = _cpu_s(servers), time.perf_counter()
    await asyncio.gather(*(one(k) for k in range(n)))
    wall_s = time.perf_counter() - started
    cpu_s = max(_cpu_s(servers) - before - idle_per_s * wall_s, 0.0)
    calls = {c: k - calls_before.get(c, 0) for c, k in _calls(servers).items()}
    await d.close()
    per_request = {
        c: k / n for c, k in calls.items() if k and c not in ("info", "config|resetstat")
    }
    return _Run(cpu_s / n * 1e6, n / wall_s, per_request)


def _rows(url: str, servers: list[str], name: str, args: argparse.Namespace) -> list[str]:
    masters = len(servers)
    out = []
    for blocks in (int(b) for b in str(args.blocks).split(",")):
        m = asyncio.run(_replay(url, servers, blocks, args))
        calls = m.calls
        # slots spread the chains' tags evenly: each master bears 1/masters of the work
        per_master_us = m.redis_cpu_us / masters
        ceiling = 1e6 / per_master_us if per_master_us else float("inf")
        out.append(
            f"{name:<26} {blocks:>6} {m.redis_cpu_us:>14.0f} {ceiling:>14.0f} "
            f"{ceiling * KNEE:>14.0f} {m.client_rps:>12.0f}"
        )
        scripted = sum(k for c, k in calls.items() if c not in ("evalsha", "hello", "script|load"))
        ranked = sorted(calls.items(), key=lambda item: -item[1])
        out.append(
            f"  commands per request: {scripted:.0f} inside the scripts ("
            + ", ".join(f"{c.upper()} {k:.1f}" for c, k in ranked)
            + ")"
        )
    return out


def run_bench_scale(args: argparse.Namespace) -> int:
    if args.requests < 1 or args.conversations < 1 or args.concurrency < 1:
        raise SystemExit("--requests, --conversations and --concurrency must be at least 1")
    if args.new_blocks < 0:
        raise SystemExit("--new-blocks must be at least 0")
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    mix = f"{args.new_blocks} new blocks a request" if args.new_blocks else "a new block a turn"
    print(
        f"kvgate bench-scale: {args.requests} requests per row ({mix}), "
        f"load average {' '.join(load)}"
    )
    rows = []
    with redis_server(port=0) as server:
        rows += _rows(server.url, [server.url], "one redis-server", args)
    if not args.skip_cluster:
        with redis_cluster() as cluster:
            servers = [m.url for m in cluster.masters()]
            rows += _rows(cluster.url, servers, "cluster (3 masters)", args)
    print(
        f"{'store':<26} {'blocks':>6} {'redis CPU µs/req':>14} {'ceiling req/s':>14} "
        f"{'knee req/s':>14} {'client req/s':>12}"
    )
    print("\n".join(rows))
    print(
        "redis CPU µs/req: every server's CPU time over the run / requests (lookup with home, "
        "placement, record and count, home write); ceiling: one thread per master busy; "
        f"knee: {KNEE:.0%} of it; client req/s: this one Python process's own pace (its CPU, "
        "not Redis, bounds it here)"
    )
    return 0
