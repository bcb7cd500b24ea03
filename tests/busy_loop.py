"""A loaded gateway's event loop, for the tests of lookup deadlines on Redis's time: the loop
held with CPU, and a wait (bounded, no sleeps) until Redis has run a script call."""

from __future__ import annotations

import asyncio
import time

import redis as sync_redis


def hog(seconds: float) -> None:
    """Hold the event loop with CPU, as other requests' work does under load."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def script_calls(stats: sync_redis.Redis) -> int:
    """The EVALSHA calls Redis has run (`INFO commandstats`)."""
    return int(stats.info("commandstats")["cmdstat_evalsha"]["calls"])


async def until_redis_ran(stats: sync_redis.Redis, calls: int) -> None:
    """Yield to the loop until Redis has run more than `calls` script calls (bounded)."""
    for _ in range(10_000):
        await asyncio.sleep(0)
        if script_calls(stats) > calls:
            return
    raise AssertionError("the lookup never reached Redis")
