"""Restart epochs: a replica that restarted (or was wiped) has an empty KV cache, so every entry
the directory holds for it must stop matching — at once, by an epoch bump, never a scan.

Restarts are seen two ways (gateway.fleet.replicas): the engine's start marker, reported with
every scrape (`observe_start`), or a replica that came back without one (`forget`). A replica's
identity is what this gateway saw and what Redis holds, together:
- A marker that differs from the one this gateway saw before is a restart here at once (its
  local entries go), whatever Redis answers or fails to answer.
- Redis compares it with the marker every gateway stored (so one restart bumps the shared epoch
  once), and — when Redis has no marker, having lost its state — with the one this gateway saw
  (`RedisDirectory.restarted`): a Redis restarted empty cannot hide a restart.
- Until Redis has been told a marker (the call failed or timed out), every report retries it:
  the marker is confirmed only by Redis's answer.
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
        self._seen: dict[str, str] = {}
        """The start marker this gateway last saw per replica."""
        self._confirmed: dict[str, str] = {}
        """The start marker Redis last acknowledged per replica."""

    async def forget(self, replica: str) -> None:
        await self.local.forget(replica)
        if self.shared is not None:
            try:
                await asyncio.wait_for(self.shared.forget(replica), self.deadline_s)
            except Exception as exc:
                log.warning("could not bump %s's epoch in Redis: %s", replica, exc)

    def left(self, replica: str) -> None:
        """The replica left the fleet: nothing of it is kept (a pod at its address later is a
        new engine)."""
        self._seen.pop(replica, None)
        self._confirmed.pop(replica, None)

    async def observe_start(self, replica: str, start_marker: str) -> bool:
        """A replica reported its start marker (every scrape); True when that is a restart,
        whose entries then stop matching. Costs nothing once Redis has confirmed it."""
        previous = self._seen.get(replica)
        shared = self.shared
        if previous == start_marker and (
            shared is None or self._confirmed.get(replica) == start_marker
        ):
            return False
        self._seen[replica] = start_marker
        restarted = previous is not None and previous != start_marker
        if restarted:
            await self.local.forget(replica)
        if shared is None:
            return restarted
        # what Redis should compare with when it has no marker: the last one it confirmed,
        # else the one this gateway saw before (never the new one: that says "no restart")
        before = self._confirmed.get(replica) or (previous if restarted else "") or ""
        try:
            bumped = await asyncio.wait_for(
                shared.restarted(replica, start_marker, before), self.deadline_s
            )
        except Exception as exc:  # not confirmed: the next report tries again
            log.warning("could not check %s's start marker in Redis: %s", replica, exc)
            return restarted
        self._confirmed[replica] = start_marker
        if bumped and previous is None:  # a restart this gateway did not see itself
            await self.local.forget(replica)
        return restarted or bumped
