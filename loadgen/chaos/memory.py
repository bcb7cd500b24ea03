"""Gateway memory with 1,000,000 distinct prefixes recorded and 100,000 tenants' rate entries.

Driven through the gateway's own objects, in a subprocess of its own (so its RSS is theirs
alone): the routing directory `gateway.server.app` builds from `Settings` (the in-process
index, capacity `directory_capacity_blocks` per replica, and the hot-prefix rates, at most
`MAX_TRACKED_PREFIXES`), fed one distinct prefix (a one-block chain) per record, spread over
four replicas, each also observed by the rates; then the rate limiter's in-process buckets
debited once for each of the tenants. RSS is read from /proc at each step. Goals: each store
holds no more than its configured capacity, and the RSS stops growing once the directory is
full (the prefixes past both capacities add at most `PLATEAU_GROWTH` of what filling took).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
from typing import Any

from loadgen.chaos.outcome import Outcome, Size

REPLICAS = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]
PLATEAU_GROWTH = 0.10


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


async def _measure(prefixes: int, tenants: int, capacity: int, full_at: int) -> dict[str, Any]:
    from cachemap.keys import BlockHash
    from gateway.pipeline.ratelimit import Limits, RateLimiter
    from gateway.server.app import _directory
    from gateway.settings import Settings

    settings = Settings(engines=REPLICAS, directory_capacity_blocks=capacity)
    directory = _directory(settings)
    rates = directory.rates
    assert rates is not None
    out: dict[str, Any] = {"rss_start_mb": rss_mb()}
    for i in range(prefixes):
        block = BlockHash(hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest())
        await directory.record(REPLICAS[i % len(REPLICAS)], [block])
        rates.observe(block)
        if i + 1 == full_at:
            out["rss_full_mb"] = rss_mb()
    out["rss_prefixes_mb"] = rss_mb()
    out["directory_entries"] = directory.local.index.num_entries()
    out["directory_capacity"] = capacity * len(REPLICAS)
    out["rate_entries"] = len(rates._counters)
    out["rate_capacity"] = rates.max_prefixes
    limiter = RateLimiter()
    limits = Limits(requests_per_min=600, tokens_per_min=1_000_000)
    for t in range(tenants):
        await limiter.acquire(f"tenant-{t}", limits, 100)
    out["rss_tenants_mb"] = rss_mb()
    out["bucket_entries"] = len(limiter.local)
    return out


def run(size: Size) -> Outcome:
    from cachemap.rates import MAX_TRACKED_PREFIXES

    prefixes, tenants = size.pick(130_000, 1_000_000), size.pick(5_000, 100_000)
    capacity = size.pick(4_096, 65_536)
    full_at = max(capacity * len(REPLICAS), MAX_TRACKED_PREFIXES)  # both stores full from here
    args = (prefixes, tenants, capacity, full_at)
    child = [sys.executable, "-m", "loadgen.chaos.memory", *map(str, args)]
    done = subprocess.run(child, capture_output=True, text=True, timeout=1800, check=True)
    m = json.loads(done.stdout)
    out = Outcome("memory")
    out.goal("directory entries within capacity", m["directory_entries"] <= m["directory_capacity"],
             f"{m['directory_entries']:,} of {m['directory_capacity']:,}")  # fmt: skip
    out.goal("prefix rates within capacity", m["rate_entries"] <= m["rate_capacity"],
             f"{m['rate_entries']:,} of {m['rate_capacity']:,}")  # fmt: skip
    first = m["rss_full_mb"] - m["rss_start_mb"]
    second = m["rss_prefixes_mb"] - m["rss_full_mb"]
    out.goal(f"RSS flat once full (the {prefixes - full_at:,} prefixes past {full_at:,})",
             second <= PLATEAU_GROWTH * first,
             f"+{second:.1f} MB vs +{first:.1f} MB to fill")  # fmt: skip
    per_tenant = (m["rss_tenants_mb"] - m["rss_prefixes_mb"]) * 1024 / tenants
    steps = ("rss_start_mb", "rss_full_mb", "rss_prefixes_mb", "rss_tenants_mb")
    label = f"RSS MB: start / {full_at:,} / {prefixes:,} prefixes / + {tenants:,} tenants"
    out.figures[label] = " / ".join(f"{m[k]:.0f}" for k in steps)
    out.figures["rate-limit buckets (2 per tenant, no capacity of their own)"] = (
        f"{m['bucket_entries']:,}, {per_tenant:.2f} KB per tenant"
    )
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(_measure(*(int(a) for a in sys.argv[1:5])))))
