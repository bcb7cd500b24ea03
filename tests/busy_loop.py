"""A loaded gateway's event loop, for the tests of lookup deadlines on Redis's time: the loop
held with CPU, a wait (bounded, no sleeps) until Redis has run a script call, and Redis itself
held by another client's back-to-back calls."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import redis as sync_redis

from cachemap.redis.lookups import _unread


def hog(seconds: float) -> None:
    """Hold the event loop with CPU, as other requests' work does under load."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def hog_until_answered(lane: Any, seconds: float, bound_s: float = 0.2) -> None:
    """`hog` for `seconds`, and on until a reply waits unread on one of `lane`'s connections
    (a `LookupLane`, or a Cluster's `NodeLanes`; at most `bound_s`, inside the lookups' grace
    past their deadline): on a loaded machine Redis may not have run within the fixed hog,
    and a reply that came after the deadline is a timeout, not a late answer."""
    hog(seconds)
    lanes = list(lane._lanes.values()) if hasattr(lane, "_lanes") else [lane]
    end = time.perf_counter() + bound_s
    while time.perf_counter() < end and not any(
        wire is not None and wire.live and _unread(wire.conn)
        for wire in (one._wire for one in lanes)
    ):
        pass


@contextlib.contextmanager
def lent_connections(pool: Any, counts: Callable[[], bool] = lambda: True) -> Iterator[list[int]]:
    """The connections `pool` (a redis-py async pool) lends inside the block, counted: a
    one-element list read as it grows (`counts`: whether the lending at hand counts, e.g. not
    a background task's); the pool lends as before after the block."""
    plain = pool.get_connection
    taken = [0]

    async def counted(*args: object, **kwargs: object) -> object:
        if counts():
            taken[0] += 1
        return await plain(*args, **kwargs)

    pool.get_connection = counted
    try:
        yield taken
    finally:
        pool.get_connection = plain


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


HOLD = """
local t = redis.call('TIME')
local start = t[1] * 1000000 + t[2]
repeat
    t = redis.call('TIME')
until t[1] * 1000000 + t[2] - start >= tonumber(ARGV[1])
return 1
"""
"""Holds Redis for ARGV[1] µs: another client's write chunk (`WRITE_CHUNK` calls of a few ms
each; tools.flush_stall measured a lookup's p99 at 5-8 ms behind a flush, ~16 ms at worst)."""

STOP_WITHIN_S = 5.0
"""How long a `RedisHolder` may take to stop: its call in flight (a few ms of Redis, bounded by
the client's socket timeout) and nothing more."""


class RedisHolder:
    """Another client holding Redis with `HOLD` calls of `micros` µs, back to back, from
    `async with` until its exit (bounded: `STOP_WITHIN_S`). `calls`: the calls Redis answered.

    It stops on a flag it checks between calls, not on a cancellation. On CPython 3.11 a task
    cancelled while redis-py sends its command does not stop: redis-py sends under
    `asyncio.wait_for`, whose 3.11 version returns the inner send's result when the cancellation
    arrives as that send completes (gh-86296, fixed in 3.12) — and the send completes at once
    when the socket takes the bytes, so a cancellation in the loop iteration after the holder's
    call returned is always lost. A holder that was only cancelled went on holding Redis, and
    the test awaiting it hung until the suite's 300-s timeout (test_event_index_redis's
    `..._queued_behind_writes_...`, CI at fbdc0f5's parent)."""

    def __init__(self, client: Any, micros: int) -> None:
        self._client = client
        self._micros = micros
        self._stop = False
        self._first = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.calls = 0

    async def _hold(self) -> None:
        while not self._stop:
            await self._client.eval(HOLD, 0, self._micros)
            self.calls += 1
            self._first.set()

    async def __aenter__(self) -> RedisHolder:
        self._task = asyncio.create_task(self._hold(), name="redis holder")
        first = asyncio.create_task(self._first.wait())
        await asyncio.wait(
            {self._task, first}, timeout=STOP_WITHIN_S, return_when=asyncio.FIRST_COMPLETED
        )
        if not self._first.is_set():  # its first call failed (raised below) or never returned
            first.cancel()
            await self.stop()
            raise AssertionError("the holder's first call was not answered")
        return self

    async def stop(self) -> None:
        """Stop after the call in flight; raises its error if it failed."""
        self._stop = True
        task = self._task
        if task is None:
            return
        done, _ = await asyncio.wait({task}, timeout=STOP_WITHIN_S)
        if not done:
            task.cancel()  # a last resort, which may be lost (above): the assertion says so
            raise AssertionError(f"the Redis holder did not stop within {STOP_WITHIN_S} s")
        task.result()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
