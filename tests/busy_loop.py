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


class CommandCalls:
    """The calls of one command (`INFO commandstats`) every server of a Redis — one, or a
    cluster's masters — has run."""

    def __init__(self, url: str, command: str = "evalsha") -> None:
        self.command = command
        server = sync_redis.Redis.from_url(url)
        self._servers = [server]
        if server.info("cluster").get("cluster_enabled"):
            cluster = sync_redis.RedisCluster.from_url(url)
            self._servers += [
                sync_redis.Redis(host=n.host, port=n.port)
                for n in cluster.get_primaries()  # type: ignore[no-untyped-call]
                if n.port != server.connection_pool.connection_kwargs["port"]
            ]
            cluster.close()

    def __call__(self) -> int:
        key = f"cmdstat_{self.command}"
        return sum(  # a server that ran none has no line
            int(server.info("commandstats").get(key, {"calls": 0})["calls"])
            for server in self._servers
        )

    def close(self) -> None:
        for server in self._servers:
            server.close()


async def until_ran(calls: CommandCalls, before: int) -> None:
    """Yield to the loop until Redis has run more than `before` of the command (bounded)."""
    for _ in range(10_000):
        await asyncio.sleep(0)
        if calls() > before:
            return
    raise AssertionError(f"the {calls.command} call never reached Redis")
