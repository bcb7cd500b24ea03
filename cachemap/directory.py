"""The cache directory protocol: which replica holds which prefix blocks (after llm-d's
`kvblock.Index`).

Every store (in-process, Redis, Redis Cluster) implements this protocol and passes the same
contract tests. Semantics shared by all of them:

- `lookup(hashes)` returns, for each replica, how many LEADING blocks of the chain it holds
  (contiguously, from block 0). Replicas holding nothing are absent. The walk stops at the first
  block no replica holds, because the chain breaks there.
- `record(replica, hashes)` says the replica now holds the chain (after its first token, when
  the engine has written the KV). It refreshes every entry's TTL and LRU position.
- `drop(replica, hashes)` says the engine did NOT hold these blocks (reconciliation).
- `forget(replica)` says it restarted or left: its entries stop matching at once. An epoch
  bump, never a scan over keys.
- `expire(replica, before_s)` says the engine (LRU) has evicted everything of its entries last
  used at or before `before_s`: they stop matching (reconciliation's correction).
- `lookup_detail(hashes)` is `lookup` plus, per replica, the last use of the deepest matched
  block: the oldest entry the prediction relied on.
- Entries age out like an engine evicts: a TTL refreshed on use, and a per-replica capacity
  with LRU eviction where, on ties, the longer chain's tail goes first.
- Every time a store takes or returns (`before_s`, a last use) is on `DIRECTORY_CLOCK`, wall
  seconds since the epoch, in every store: a shared store's times come from every gateway's
  host, and the gateway applies a time read from one store to the other (reconciliation
  expires on both what the shared lookup said was last used at t), so t must mean the same
  instant in both.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from cachemap.keys import BlockHash

Clock = Callable[[], float]

DIRECTORY_CLOCK: Clock = time.time
"""The one clock of directory times (see the module docstring). Not `time.monotonic`: its zero
is each host's boot, so a monotonic last use applied to Redis, or Redis's epoch seconds applied
to a monotonic index, is off by decades (the in-process index once ran on it, and every shared
over-estimate wiped the local index the fallback routes on)."""


def to_ms(t_s: float) -> int:
    """A directory time as the shared store keeps it: whole milliseconds (rounded, so a time
    that came back from the store as ms / 1000 maps to the same ms)."""
    return round(t_s * 1000)


def on_ms(t_s: float) -> float:
    """`t_s` at the shared store's resolution: what both stores record for one event, so an
    expiry at a time the shared store returned removes that event in the local index too."""
    return to_ms(t_s) / 1000


@dataclass(frozen=True, slots=True)
class Held:
    """A replica's entries in the shared store from a chain's first block on, as a lookup read
    them (no placement in flight): how many, and the oldest generation and last use (ms) among
    them (`cachemap.redis.directory.RedisDirectory.record_many`)."""

    depth: int
    gen: int
    used_ms: int


DEFAULT_REPLICA_CAPACITY_BLOCKS = 65_536
"""Directory entries kept per replica.

An H100-80GB serving an 8B model keeps ~500k tokens of KV (≈60 GB free / 128 KiB per token),
≈2 MB of prompt at ~4 bytes/token, ≈8,000 blocks of 256 B. The directory remembers up to 8×
that: an entry the engine has already evicted costs one wrong prediction (reconciliation drops
it), an entry forgotten too early costs a lost hit. The gateway caps each replica below this at
its engine's reported KV (`set_capacity`): with 8× an engine's KV the cache-aware pick kept
sending continuations to an engine that had evicted them (issue 42).
"""

DEFAULT_TTL_S = 3600.0
"""Entries not used for an hour stop matching: engines under load evict far sooner, and an idle
engine's prefix is still worth a try (a wrong guess costs no more than a miss)."""


class Directory(Protocol):
    async def lookup(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """replica -> number of leading blocks of `hashes` it holds."""
        ...

    async def record(self, replica: str, hashes: Sequence[BlockHash]) -> None: ...

    async def drop(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        """The engine did not hold these blocks."""
        ...

    async def forget(self, replica: str) -> None:
        """The replica restarted or left: an epoch bump, not a scan."""
        ...

    async def expire(self, replica: str, before_s: float) -> None:
        """Entries of `replica` last used at or before `before_s` stop matching."""
        ...

    async def lookup_detail(self, hashes: Sequence[BlockHash]) -> dict[str, tuple[int, float]]:
        """replica -> (leading blocks held, last use of the deepest of them)."""
        ...

    async def close(self) -> None: ...
