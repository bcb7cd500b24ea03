"""The router's own cost per decision against the fleet's size (docs/benchmarks-archive.md).

    python -m tools.route_cost [REPLICAS ...]     default 4 16 64 256

For each fleet size and each locality policy (`cache_aware`, and `cache_pressure` with every
replica's eviction frontier known, as precise mode gives it), `RoutingProfile.decide` on one
700-block request (44,800 tokens) that two replicas hold part of (600 and 300 blocks), every
replica healthy and carrying its own queue, decode and (for `cache_pressure`) a frontier of a few
runs and live conversations. Thread CPU time, median of CALLS (1,000) decisions; the replicas'
loads differ, so the load bound and the tie-break both have work to do.

Beside them, what precise mode does before a `cache_pressure` decision: `Frontiers.annotate`,
each replica's frontier read from an event index that tracks recency (every replica holding a
64-block chain of its own) and set on its snapshot.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from collections.abc import Sequence

from cachemap.events import BlockStored, EventIndex, precise_keys
from gateway.pipeline.frontier import Frontiers
from router.registry import build_policy
from router.scorers import DisplacementScorer
from router.types import KvFrontier, Replica, RouteRequest

SIZES = (4, 16, 64, 256)
CALLS = 1_000
BLOCKS = 700
TOKENS_PER_BLOCK = 16.0


def fleet(size: int, frontiers: bool) -> list[Replica]:
    """`size` replicas with loads that differ (a fixed seed: every run sees the same fleet)."""
    rng = random.Random(size)
    out = []
    for n in range(size):
        frontier = (
            KvFrontier(
                empty_blocks=rng.randrange(0, 200),
                runs=((rng.randrange(50, 400), rng.uniform(0, 30)), (400, rng.uniform(30, 90))),
                capacity_blocks=4_000,
                live=tuple(rng.randrange(100, 1_500) for _ in range(rng.randrange(0, 4))),
            )
            if frontiers
            else None
        )
        out.append(
            Replica(
                f"http://10.0.{n // 256}.{n % 256}:8000",
                num_inflight=rng.randrange(0, 8),
                pending_prefill_tokens=rng.uniform(0, 40_000),
                engine_num_waiting=float(rng.randrange(0, 4)),
                own_num_waiting=float(rng.randrange(0, 2)),
                foreign_request_tokens=6_000.0,
                decode_tokens=rng.uniform(0, 5_000),
                engine_num_running=float(rng.randrange(0, 16)),
                own_num_running=float(rng.randrange(0, 8)),
                request_output_tokens=300.0,
                kv_frontier=frontier,
            )
        )
    return out


def request(replicas: Sequence[Replica]) -> RouteRequest:
    return RouteRequest(
        num_blocks=BLOCKS,
        num_prompt_tokens=BLOCKS * TOKENS_PER_BLOCK,
        overlap={replicas[0].id: 600, replicas[len(replicas) // 2].id: 300},
        tokens_per_block=TOKENS_PER_BLOCK,
        decode_token_weight=4.0,
    )


def decide_us(policy: str, size: int, calls: int = CALLS) -> tuple[float, str]:
    """Median thread CPU µs of one decision, and the replica it chose."""
    profile = build_policy(policy)
    replicas = fleet(size, frontiers=policy == "cache_pressure")
    req = request(replicas)
    rng = random.Random(0)
    times = []
    decision = None
    for _ in range(calls):
        started = time.thread_time()
        decision = profile.decide(req, replicas, rng)
        times.append(time.thread_time() - started)
    assert decision is not None
    return statistics.median(times) * 1e6, decision.replica


def annotate_us(size: int, calls: int = CALLS) -> float:
    """Median thread CPU µs of annotating `size` replicas with their frontiers."""
    replicas = fleet(size, frontiers=False)
    index = EventIndex(track_recency=True)
    for n, replica in enumerate(replicas):
        ids = [(n * 7 + i) % 4000 for i in range(16 * 64)]
        hashes = list(range(n * 1000, n * 1000 + 64))
        index.store(replica.id, BlockStored(hashes, None, ids, 16, cache_salt="s"))
    frontiers = Frontiers(index, DisplacementScorer(), lambda r: 100, lambda r: True)
    req = request(replicas)
    keys = precise_keys([1] * 16 * BLOCKS, "s", 16)
    times = []
    for _ in range(calls):
        started = time.thread_time()
        annotated = frontiers.annotate(req, replicas, keys)
        times.append(time.thread_time() - started)
    assert all(r.kv_frontier is not None for r in annotated)
    return statistics.median(times) * 1e6


def run(sizes: Sequence[int], calls: int = CALLS) -> None:
    print(f"{calls:,} decisions per arm, a {BLOCKS}-block request, 2 replicas holding part of it")
    for size in sizes:
        cells = []
        for policy in ("cache_aware", "cache_pressure"):
            us, _ = decide_us(policy, size, calls)
            cells.append(f"{policy} {us:8.1f} us ({us / size:5.2f} a replica)")
        us = annotate_us(size, calls)
        cells.append(f"frontiers {us:8.1f} us ({us / size:5.2f} a replica)")
        print(f"  {size:4d} replicas: " + "   ".join(cells))


def main(argv: list[str]) -> int:
    run([int(n) for n in argv] or SIZES)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
