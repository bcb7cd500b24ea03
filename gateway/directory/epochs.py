"""Restart epochs: a replica that restarted (or was wiped) has an empty KV cache, so every entry
the directory holds for it must stop matching — at once, by an epoch bump, never a scan.

Restarts are seen two ways (gateway.fleet.replicas): a new engine start marker (`observe_start`)
or a replica that came back without one (`forget`). With a shared directory the marker is
compared with what every gateway has seen, so one restart bumps the shared epoch once, and a
gateway that starts after an engine restarted still notices.
"""

from __future__ import annotations

import asyncio
import logging

from cachemap.memory import MemoryDirectory
from cachemap.redis.directory import RedisDirectory

log = logging.getLogger(__name__)


class RestartEpochs:
    def __init__(self, local: MemoryDirectory, deadline_s: float) -> None:
        self.local = local
        self.deadline_s = deadline_s
        self.shared: RedisDirectory | None = None
        self._markers: dict[str, str] = {}
        """The start marker this gateway last saw per replica."""

    async def forget(self, replica: str) -> None:
        await self.local.forget(replica)
        if self.shared is not None:
            try:
                await asyncio.wait_for(self.shared.forget(replica), self.deadline_s)
            except Exception as exc:
                log.warning("could not bump %s's epoch in Redis: %s", replica, exc)

    async def observe_start(self, replica: str, start_marker: str) -> bool:
        """A replica reported its start marker (first sight or a change); True when that is a
        restart, whose entries then stop matching."""
        previous = self._markers.get(replica)
        self._markers[replica] = start_marker
        if self.shared is None:
            if previous is not None and previous != start_marker:
                await self.local.forget(replica)
                return True
            return False
        try:
            bumped = await asyncio.wait_for(
                self.shared.restarted(replica, start_marker), self.deadline_s
            )
        except Exception as exc:
            log.warning("could not check %s's start marker in Redis: %s", replica, exc)
            return False
        if bumped:
            await self.local.forget(replica)
        return bumped
