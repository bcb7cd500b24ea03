"""Writes to the shared directory, off the request path.

Records, drops and expiries go to the local directory at once (by the caller) and to Redis
through this bounded queue, flushed in batches by one background task with a write deadline:
records and placements first (one script call per chain, in one pipeline), then the rest.
When Redis is away (the breaker says degraded) or a batch fails, its writes are dropped and
counted, never retried forever; when the queue is full the oldest write goes first.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cachemap.directory import Held
from cachemap.keys import BlockHash
from cachemap.redis.directory import RedisDirectory

log = logging.getLogger(__name__)

WRITE_QUEUE_LIMIT = 10_000
"""Pending writes kept while Redis is slow; the oldest go first beyond this."""
WRITE_BATCH = 256


@dataclass(frozen=True, slots=True)
class Record:
    replica: str
    hashes: Sequence[BlockHash]
    at_s: float | None = None
    """When the chain was used (the local index's time for the same record), or None: when
    the write reaches Redis."""
    held: Held | None = None
    """What the request's lookup read the replica to hold in Redis (its fresh part is not
    written again: `RedisDirectory.record_many`), or None: the whole chain is written."""


@dataclass(frozen=True, slots=True)
class Place:
    """A placement in flight (`RedisDirectory.place`): written in the records' pipeline."""

    replica: str
    hashes: Sequence[BlockHash]


@dataclass(frozen=True, slots=True)
class Scripted:
    """A script call built when its batch is written — (command, the script's source) — and
    pipelined with the records (a fan-out landing, a conversation's home, a hot prefix's k or
    a sibling's count taken back: each was a pooled call of its own)."""

    build: Callable[[RedisDirectory], tuple[tuple[Any, ...], str]]


@dataclass(frozen=True, slots=True)
class Drop:
    replica: str
    hashes: Sequence[BlockHash]


@dataclass(frozen=True, slots=True)
class Expire:
    replica: str
    before_s: float


Write = Record | Place | Scripted | Drop | Expire


class WriteBehind:
    def __init__(self, deadline_s: float, degraded: Callable[[], bool]) -> None:
        self.deadline_s = deadline_s
        self._degraded = degraded
        self.num_dropped = 0
        self._queue: deque[Write] = deque(maxlen=WRITE_QUEUE_LIMIT)
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    def push(self, write: Write) -> None:
        if len(self._queue) == self._queue.maxlen:
            self.num_dropped += 1
        self._queue.append(write)
        self._idle.clear()
        self._wakeup.set()

    @property
    def idle(self) -> bool:
        """No write is queued or in flight."""
        return self._idle.is_set()

    async def flushed(self) -> None:
        """Wait until every queued write has been attempted."""
        await self._idle.wait()

    async def run(self, shared: RedisDirectory) -> None:
        """The flusher: one per gateway, for as long as it has a shared directory."""
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                batch = [self._queue.popleft() for _ in range(min(WRITE_BATCH, len(self._queue)))]
                if self._degraded():
                    self.num_dropped += len(batch)
                    continue
                try:
                    await asyncio.wait_for(_write(shared, batch), self.deadline_s)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    self.num_dropped += len(batch)
                    log.debug("shared directory write failed: %s", exc)
            self._idle.set()


async def _write(shared: RedisDirectory, batch: list[Write]) -> None:
    """Records and placements first (one script call per chain, all in one pipeline), then
    the rest."""
    records = [(w.replica, w.hashes, w.at_s, w.held) for w in batch if isinstance(w, Record)]
    places = [(w.replica, w.hashes) for w in batch if isinstance(w, Place)]
    scripted = [w.build(shared) for w in batch if isinstance(w, Scripted)]
    if records or places or scripted:
        await shared.record_many(records, places, scripted)
    await asyncio.gather(
        *(shared.drop(w.replica, w.hashes) for w in batch if isinstance(w, Drop)),
        *(shared.expire(w.replica, w.before_s) for w in batch if isinstance(w, Expire)),
    )
