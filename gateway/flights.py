"""Single flight: requests writing a prefix no replica holds yet, and the siblings waiting for
them (the gateway's side of `router.fanout`).

A leader registers the hashes of its uncached blocks when it is routed; a later request of the
same scope walks its own hashes from its matched depth while they are being written (hashes are
salted, so scopes never meet) and finds the leader writing the deepest of them. The leader
lands when its first byte arrives (the engine has prefilled, the KV is written) or fails; either
way every waiter is released at once, and a waiter never waits longer than its bound. A waiter
is never a leader while it waits, so waits cannot form a cycle.

In-process only: with a shared directory, flights of other gateways are not seen (each gateway
holds its own siblings; a gateway's siblings still land on one replica).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Histogram

from cachemap.keys import BlockHash

_ids = itertools.count(1)


@dataclass(eq=False)
class Flight:
    """One leader's write of blocks [depth, depth + len(blocks))."""

    replica: str
    blocks: Sequence[BlockHash]
    expected_s: float
    id: int = field(default_factory=lambda: next(_ids))
    landed: asyncio.Event = field(default_factory=asyncio.Event)
    ok: bool = False
    started_s: float = field(default_factory=time.monotonic)


@dataclass
class HoldStats:
    holds: int = 0
    released_landed: int = 0
    released_failed: int = 0
    timeouts: int = 0
    hold_seconds: list[float] = field(default_factory=list)


class Flights:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._writing: dict[BlockHash, Flight] = {}
        self.stats = HoldStats()
        self._histogram = Histogram(
            "kvgate_fanout_hold_seconds",
            "How long siblings waited for their leader's write.",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=registry,
        )

    def find(self, hashes: Sequence[BlockHash], depth: int) -> tuple[Flight, int] | None:
        """The flight writing the deepest of `hashes[depth:]` contiguously, and that depth."""
        found: Flight | None = None
        shared = depth
        for i in range(depth, len(hashes)):
            flight = self._writing.get(hashes[i])
            if flight is None:
                break
            found, shared = flight, i + 1
        return (found, shared) if found is not None else None

    def lead(self, replica: str, blocks: Sequence[BlockHash], expected_s: float) -> Flight:
        """Register a leader; blocks another live flight already writes stay with it."""
        flight = Flight(replica, blocks, expected_s)
        for block in blocks:
            self._writing.setdefault(block, flight)
        return flight

    def end(self, flight: Flight, ok: bool) -> None:
        if flight.landed.is_set():
            return
        flight.ok = ok
        for block in flight.blocks:
            if self._writing.get(block) is flight:
                del self._writing[block]
        flight.landed.set()

    async def wait(self, flight: Flight, timeout_s: float) -> bool:
        """Wait for a leader; True when it landed (its replica now holds the prefix)."""
        self.stats.holds += 1
        started = time.monotonic()
        try:
            await asyncio.wait_for(flight.landed.wait(), timeout_s)
        except TimeoutError:
            self.stats.timeouts += 1
            return False
        finally:
            held = time.monotonic() - started
            self._histogram.observe(held)
            self.stats.hold_seconds.append(held)
            del self.stats.hold_seconds[:-4096]
        if flight.ok:
            self.stats.released_landed += 1
        else:
            self.stats.released_failed += 1
        return flight.ok

    def __len__(self) -> int:
        return len(self._writing)
