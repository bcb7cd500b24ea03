"""Gateway memory with 1,000,000 distinct prefixes recorded and 100,000 tenants' rate entries.

`kvgate footprint` (a process of its own, so its RSS is the stores' alone) builds the routing
directory a gateway of these settings runs (the in-process index at
`directory_capacity_blocks` per replica, the hot-prefix rates at their LRU bound) and its rate
limiter, records one distinct prefix per request, then debits the tenants once each, and as
many new ones once the first have refilled; it prints RSS and what the allocators hold at each
step. Judged here, from its output:
- each store holds no more than its configured capacity; the rate-limit buckets, after the
  second wave, no more than twice those still refilling (the first wave's are gone);
- RSS flat once the stores have settled: from the `settled` step (every entry replaced once,
  the dict tables at the size they keep under churn) to the end it grows at most
  `PLATEAU_GROWTH` of what filling took.
"""

from __future__ import annotations

from typing import Any

import orjson

from loadgen.chaos.outcome import Outcome, Size
from loadgen.harness import processes

PLATEAU_GROWTH = 0.10
FOOTPRINT_TIMEOUT_S = 1800.0


def footprint(prefixes: int, tenants: int, capacity: int) -> dict[str, Any]:
    args = ["footprint", "--prefixes", str(prefixes), "--tenants", str(tenants),
            "--directory-capacity-blocks", str(capacity)]  # fmt: skip
    found: dict[str, Any] = orjson.loads(processes.run_kvgate(args, FOOTPRINT_TIMEOUT_S))
    return found


def run(size: Size) -> Outcome:
    prefixes, tenants = size.pick(300_000, 1_000_000), size.pick(5_000, 100_000)
    capacity = size.pick(4_096, 65_536)
    m = footprint(prefixes, tenants, capacity)
    steps = m["steps"]
    out = Outcome("memory")
    out.goal("directory entries within capacity", m["directory_entries"] <= m["directory_capacity"],
             f"{m['directory_entries']:,} of {m['directory_capacity']:,}")  # fmt: skip
    out.goal("prefix rates within capacity", m["rate_entries"] <= m["rate_capacity"],
             f"{m['rate_entries']:,} of {m['rate_capacity']:,}")  # fmt: skip
    refilling = m["bucket_entries_refilling"]
    out.goal("rate-limit buckets within twice those refilling",
             m["bucket_entries_later"] <= 2 * refilling,
             f"{m['bucket_entries_later']:,} (refilling {refilling:,}; "
             f"{m['bucket_entries']:,} after the first wave)")  # fmt: skip
    fill = steps["full"]["rss_mb"] - steps["start"]["rss_mb"]
    plateau = steps["end"]["rss_mb"] - steps["settled"]["rss_mb"]
    out.goal(f"RSS flat once settled (prefixes {m['settled_at']:,} to {prefixes:,})",
             plateau <= PLATEAU_GROWTH * fill,
             f"{plateau:+.1f} MB vs +{fill:.1f} MB to fill")  # fmt: skip
    names = ("start", "full", "settled", "end", "tenants", "later_tenants")
    label = (f"RSS MB: start / {m['full_at']:,} / {m['settled_at']:,} / {prefixes:,} prefixes / "
             f"+ {tenants:,} tenants / + {tenants:,} later")  # fmt: skip
    out.figures[label] = " / ".join(f"{steps[k]['rss_mb']:.0f}" for k in names)
    out.figures["Python blocks (millions), same steps"] = " / ".join(
        f"{steps[k]['python_blocks'] / 1e6:.2f}" for k in names
    )
    if "c_heap_live_mb" in steps["start"]:
        out.figures["C heap live / free MB, same steps"] = " / ".join(
            f"{steps[k]['c_heap_live_mb']:.0f}/{steps[k]['c_heap_free_mb']:.0f}" for k in names
        )
    out.figures["glibc mmap threshold pinned (gateway.server.malloc)"] = m.get(
        "mmap_threshold_pinned", False
    )
    per_tenant = (steps["tenants"]["rss_mb"] - steps["end"]["rss_mb"]) * 1024 / tenants
    out.figures["rate-limit buckets: RSS per tenant (first wave)"] = f"{per_tenant:.2f} KB"
    return out
