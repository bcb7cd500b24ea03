"""`kvgate footprint`: the memory of a gateway's bounded in-process stores, filled past them.

Builds what a gateway of these settings keeps per prefix and per tenant — the routing directory
(`build_directory`: the in-process index at `directory_capacity_blocks` per replica, the
hot-prefix rates at their LRU bound) and the rate limiter's in-process buckets — and fills
them: N distinct one-block prefixes over four replicas (each also counted by the rates), then
T tenants debited once each, and, on a clock moved past their refill (not waited for), T new
ones. Prints one JSON object: RSS at each step, what the allocators hold there (Python's small
object blocks; the C heap's live and free bytes, where glibc reports them), and each store's
entries against its capacity. Like `kvgate serve`, it first pins glibc's mmap threshold
(`gateway.server.malloc`). An operator sizes a pod from it; `kvgate chaos --scenario memory`
judges it.

The steps, in prefixes recorded: `full` (both stores at capacity), `settled` (twice that: every
entry replaced once, so each dict's table has the size it keeps under churn — CPython sizes a
table for three times its entries when deletions force a resize, one step past the size that
inserting alone reached), `end`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import sys
from typing import Any

import orjson

from cachemap.keys import BlockHash
from cachemap.rates import MAX_TRACKED_PREFIXES
from gateway.pipeline.ratelimit import SECONDS_PER_MINUTE, Limits, RateLimiter
from gateway.server.app import build_directory
from gateway.server.malloc import c_heap, pin_mmap_threshold
from gateway.settings import Settings

REPLICAS = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]
LIMITS = Limits(requests_per_min=600, tokens_per_min=1_000_000)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def _step() -> dict[str, float]:
    gc.collect()
    step = {"rss_mb": rss_mb(), "python_blocks": float(sys.getallocatedblocks())}
    heap = c_heap()
    if heap is not None:
        step["c_heap_live_mb"] = heap.live_mb
        step["c_heap_free_mb"] = heap.free_mb
    return step


async def measure(prefixes: int, tenants: int, capacity: int) -> dict[str, Any]:
    directory = build_directory(Settings(engines=REPLICAS, directory_capacity_blocks=capacity))
    rates = directory.rates
    assert rates is not None
    full_at = max(capacity * len(REPLICAS), MAX_TRACKED_PREFIXES)
    marks = {full_at: "full", 2 * full_at: "settled", prefixes: "end"}
    out: dict[str, Any] = {"full_at": full_at, "settled_at": 2 * full_at, "steps": {}}
    out["steps"]["start"] = _step()
    for i in range(prefixes):
        block = BlockHash(hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest())
        await directory.record(REPLICAS[i % len(REPLICAS)], [block])
        rates.observe(block)
        if i + 1 in marks:
            out["steps"][marks[i + 1]] = _step()
    out["directory_entries"] = directory.local.index.num_entries()
    out["directory_capacity"] = capacity * len(REPLICAS)
    out["rate_entries"] = rates.num_tracked
    out["rate_capacity"] = rates.max_prefixes
    now = [0.0]
    limiter = RateLimiter(clock=lambda: now[0])
    for t in range(tenants):
        await limiter.acquire(f"tenant-{t}", LIMITS, 100)
    out["steps"]["tenants"] = _step()
    out["bucket_entries"] = len(limiter.local)
    now[0] += SECONDS_PER_MINUTE + 1  # every one of them full again
    for t in range(tenants):
        await limiter.acquire(f"later-{t}", LIMITS, 100)
    out["steps"]["later_tenants"] = _step()
    out["bucket_entries_later"] = len(limiter.local)
    out["bucket_entries_refilling"] = 2 * tenants
    return out


def add_footprint_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefixes", type=int, default=1_000_000, help="distinct prefixes recorded"
    )
    parser.add_argument(
        "--tenants", type=int, default=100_000, help="tenants debited once, twice over"
    )
    parser.add_argument(
        "--directory-capacity-blocks",
        type=int,
        default=65_536,
        help="the directory's capacity per replica (directory_capacity_blocks)",
    )


def run_footprint(args: argparse.Namespace) -> int:
    if min(args.prefixes, args.tenants, args.directory_capacity_blocks) <= 0:
        print("kvgate footprint: --prefixes, --tenants and the capacity must be positive")
        return 2
    pinned = pin_mmap_threshold()  # as `kvgate serve` does
    found = asyncio.run(measure(args.prefixes, args.tenants, args.directory_capacity_blocks))
    found["mmap_threshold_pinned"] = pinned
    sys.stdout.write(orjson.dumps(found).decode() + "\n")
    return 0
