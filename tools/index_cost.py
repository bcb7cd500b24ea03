"""What the in-process directory costs per request at a gateway's scale, in process (µs).

    python -m tools.index_cost [REQUESTS] [BLOCKS_PER_ENGINE]

A `MemoryIndex` of 4 engines is filled to `BLOCKS_PER_ENGINE` live entries each (bench point
1's full slice reaches ~225k), then `REQUESTS` requests of conversation shape run through it:
each looks up a chain of ~180 blocks (a ~47 KB prompt, the Mooncake slice's mean) whose first
three quarters an earlier turn recorded, and records the chain on one engine, as the gateway
does on the first token. It prints, per request, the lookup and the record (medians of rounds
in this thread's CPU time, so a loaded machine moves them little) and the cyclic GC's
collections and CPU time over the loop (`gc.callbacks`: the directory's own allocations are
what triggers them here; in a gateway the request path's allocations trigger them too, and an
older generation's pass walks whatever the directory keeps tracked), the tracked object count
and what one full collection (`gc.collect()`, the oldest generation's pass) costs at that size.

To compare another checkout, run it from inside that checkout (`cd <tree> && python -m
tools.index_cost`): `python -m` puts the current directory ahead of `PYTHONPATH`.
"""

from __future__ import annotations

import gc
import random
import statistics
import sys
import time
from typing import Any

from cachemap.keys import BlockHash
from cachemap.memory import MemoryIndex

ENGINES = ("e0", "e1", "e2", "e3")
CHAIN_BLOCKS = 180
"""Blocks per prompt: ~47 KB of rendering at 256 bytes a block, the slice's mean prompt."""
SHARED_SHARE = 0.75
"""Of a prompt's blocks, the share an earlier turn of its conversation already recorded."""
ROUND = 50
"""Requests per timing round (the median is over rounds)."""


def _blocks(rng: random.Random, n: int) -> list[BlockHash]:
    return [BlockHash(rng.randbytes(16)) for _ in range(n)]


class _GcTimer:
    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.cpu_s = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.thread_time()
        else:
            self.collections[info["generation"]] += 1
            self.cpu_s += time.thread_time() - self._started


def main(argv: list[str]) -> None:
    requests = int(argv[0]) if argv else 3000
    per_engine = int(argv[1]) if len(argv) > 1 else 200_000
    rng = random.Random(0)
    index = MemoryIndex(capacity_blocks=per_engine, ttl_s=1e9, clock=time.monotonic)
    for engine in ENGINES:
        for _ in range(per_engine // CHAIN_BLOCKS):
            index.record(engine, _blocks(rng, CHAIN_BLOCKS))
    shared = int(CHAIN_BLOCKS * SHARED_SHARE)
    turns = [_blocks(rng, shared) for _ in range(requests)]
    for i, turn in enumerate(turns):
        index.record(ENGINES[i % len(ENGINES)], turn)
    prompts = [turn + _blocks(rng, CHAIN_BLOCKS - shared) for turn in turns]
    gc.collect()
    timer = _GcTimer()
    gc.callbacks.append(timer)
    lookups, records = [], []
    started = time.thread_time()
    for first in range(0, requests, ROUND):
        batch = list(enumerate(prompts[first : first + ROUND], first))
        t0 = time.thread_time()
        for _, prompt in batch:
            index.lookup_detail(prompt)
        t1 = time.thread_time()
        for i, prompt in batch:
            index.record(ENGINES[i % len(ENGINES)], prompt)
        t2 = time.thread_time()
        lookups.append((t1 - t0) / len(batch))
        records.append((t2 - t1) / len(batch))
    total = time.thread_time() - started
    gc.callbacks.remove(timer)
    full = []
    for _ in range(5):
        t0 = time.thread_time()
        gc.collect()
        full.append(time.thread_time() - t0)
    print(
        f"{requests} requests, {len(ENGINES)} engines x {per_engine:,} blocks, "
        f"chains of {CHAIN_BLOCKS} blocks ({SHARED_SHARE:.0%} recorded before)"
    )
    print(f"  lookup_detail  {statistics.median(lookups) * 1e6:8.1f} µs/request (median)")
    print(f"  record         {statistics.median(records) * 1e6:8.1f} µs/request (median)")
    print(f"  loop total     {total / requests * 1e6:8.1f} µs/request (incl. GC)")
    print(
        f"  cyclic GC      {timer.cpu_s / requests * 1e6:8.1f} µs/request, collections "
        f"{timer.collections} (gen 0/1/2)"
    )
    print(
        f"  full collection {statistics.median(full) * 1e3:7.2f} ms over "
        f"{len(gc.get_objects()):,} tracked objects"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
