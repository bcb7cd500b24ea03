"""Writing the local index back into Redis, when Redis lost what it held.

Every record goes to the local index at once and to Redis off the request path; while Redis is
away the writes are dropped (`writes.WriteBehind`). So when Redis comes back, the gateway's own
index holds what Redis is missing:
- Redis lost its state (restarted empty, flushed; `RedisDirectory.on_reset`): every live local
  entry is written back.
- Redis was only unreachable (the breaker's outage): the entries used since the outage began
  (and a write deadline before it, when the failing writes started) are written back.

Entries are written at the replica's current generation with their own last use, where Redis
has none or an older one (`RedisDirectory.restore`), one call per 512 blocks of a chain, in the
background. While it runs, lookups also consult the local index (`running`): a conversation's
next turn finds its replica before its entries are back. Measured by `kvgate bench-redis-reset`
(docs/benchmarks-archive.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from cachemap.memory import MemoryIndex
from cachemap.redis.directory import RedisDirectory
from gateway.tasks import BackgroundTasks

log = logging.getLogger(__name__)


@dataclass
class WriteBackStats:
    runs: int = 0
    blocks_written: int = 0
    failures: int = 0
    last_seconds: float = 0.0


class WriteBack:
    def __init__(self, local: MemoryIndex, tasks: BackgroundTasks) -> None:
        self.local = local
        self.stats = WriteBackStats()
        self._tasks = tasks
        self._idle = asyncio.Event()
        self._idle.set()
        self._pending: tuple[float | None, str] | None = None
        """A request that came while a write-back ran: (its `since_s`, why); `since_s` None:
        everything."""

    @property
    def running(self) -> bool:
        return not self._idle.is_set()

    async def finished(self) -> None:
        """Wait until no write-back runs or waits to run."""
        await self._idle.wait()

    def start(self, shared: RedisDirectory, since_s: float | None, why: str) -> None:
        """Write back entries used since `since_s` (None: all of them), in the background."""
        if self.running:  # one at a time; the widest request waiting runs next
            waiting = self._pending
            if (
                waiting is None
                or since_s is None
                or (waiting[0] is not None and since_s < waiting[0])
            ):
                self._pending = (since_s, why)
            return
        self._launch(shared, since_s, why)

    def _launch(self, shared: RedisDirectory, since_s: float | None, why: str) -> None:
        if not any(self.local.num_entries(r) for r in self.local.replicas()):
            self._idle.set()
            return
        self._idle.clear()
        self._tasks.spawn(self._run(shared, since_s, why), name="directory write-back")

    async def _run(self, shared: RedisDirectory, since_s: float | None, why: str) -> None:
        started = time.perf_counter()
        written = 0
        try:
            for replica in self.local.replicas():
                entries = self.local.entries(replica, since_s)
                if entries:
                    written += await shared.restore(replica, entries)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # Redis away again: the next recovery starts over
            self.stats.failures += 1
            log.warning("directory write-back stopped: %s", exc)
        finally:
            elapsed = time.perf_counter() - started
            self.stats.runs += 1
            self.stats.blocks_written += written
            self.stats.last_seconds = elapsed
            log.warning("directory write-back (%s): %d blocks in %.3f s", why, written, elapsed)
            pending, self._pending = self._pending, None
            if pending is None:
                self._idle.set()
            else:  # still running: a waiter on `finished` waits for this one too
                self._launch(shared, *pending)
