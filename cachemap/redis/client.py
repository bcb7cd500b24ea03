"""Connecting to Redis or Redis Cluster, and stopping the directory's background tasks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import (
    AbstractConnection,
    Connection,
    SSLConnection,
    UnixDomainSocketConnection,
)
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff

log = logging.getLogger(__name__)

AnyRedis = aioredis.Redis | RedisCluster

PROTOCOL = 3
"""RESP3: what redis-py 8 (the pinned major) defaults to and the suite runs on; Redis >= 6 speaks
it. Set explicitly, so a change of the library's default cannot change the replies' types."""


def pack_whole(args: tuple[Any, ...]) -> bytes | None:
    """A command packed by hiredis in one call, or None where redis-py's own packer must do it.

    redis-py 8 packs with hiredis too, but first checks and encodes every argument in Python
    (`HiredisRespSerializer.pack`: a generator, isinstance checks and an encoder call each):
    ~8 µs a script call of ten arguments against ~1.5 µs, and 5% of a gateway's busy samples
    on Redis (py-spy, bench point 1 @2; docs/design/directory.md, "The tier's CPU per
    request"). The bytes are the same for what kvgate sends — str (UTF-8, the client's
    encoding), bytes and int; anything else goes the library's way: a float (redis-py writes
    its repr), a memoryview or bytearray, a bool (refused), and a command name with a space in
    it ("CONFIG GET": redis-py splits it)."""
    first = args[0]
    if type(first) is str:
        spaced = " " in first
    elif type(first) is bytes:
        spaced = b" " in first
    else:
        return None
    if spaced or float in map(type, args):
        return None
    try:
        return hiredis.pack_command(args)  # type: ignore[no-any-return]
    except TypeError:  # memoryview, bytearray, bool, ...
        return None


class HiredisPacked(AbstractConnection):
    """`pack_whole` before the library's packer."""

    def pack_command(self, *args: Any) -> list[bytes]:
        packed = pack_whole(args)
        return super().pack_command(*args) if packed is None else [packed]


class PackedConnection(HiredisPacked, Connection):
    """TCP (`redis://`)."""


class PackedSSLConnection(HiredisPacked, SSLConnection):
    """TLS (`rediss://`)."""


class PackedUnixConnection(HiredisPacked, UnixDomainSocketConnection):
    """A unix socket (`unix://`)."""


PACKED: dict[type[AbstractConnection], type[AbstractConnection]] = {
    Connection: PackedConnection,
    SSLConnection: PackedSSLConnection,
    UnixDomainSocketConnection: PackedUnixConnection,
}


async def close_pubsub(pubsub: Any) -> None:
    """Close a pub/sub connection. redis-py types `PubSub.aclose` from 8.2 on and not before,
    so a call site's `type: ignore` is an error on one side of the pin and needed on the other:
    the call goes through here, as a typed callable, for both."""
    close: Callable[[], Awaitable[None]] = pubsub.aclose
    await close()


async def open_redis(url: str, *, cluster: bool | None = None, timeout_s: float = 1.0) -> AnyRedis:
    """One client for `redis://`, `rediss://` or `unix://` URLs; a Redis Cluster when
    `cluster` is True, or when None and the server says `cluster_enabled:1`.

    Retries only connection errors and timeouts (3 times, exponential backoff with jitter);
    every write kvgate makes is idempotent, so a replayed one does no harm. Speaks RESP3
    (`PROTOCOL`), stated rather than left to the library's default. A single Redis's
    connections pack commands with hiredis in one call (`pack_whole`); a cluster's nodes keep
    the library's packer (redis-py builds their connections itself).
    """
    options: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(ExponentialWithJitterBackoff(), 3),
        "protocol": PROTOCOL,
    }
    if cluster is None:
        probe = aioredis.Redis.from_url(url, **options)
        try:
            info = await probe.info("cluster")
            cluster = bool(info.get("cluster_enabled"))
        finally:
            await probe.aclose()
    if cluster:
        if url.startswith("unix://"):
            raise ValueError("a Redis Cluster is reached over TCP (redis:// or rediss://)")
        return RedisCluster.from_url(url, **options)
    client = aioredis.Redis.from_url(url, **options)
    pool = client.connection_pool
    pool.connection_class = PACKED.get(pool.connection_class, pool.connection_class)
    return client


async def stop_task(task: asyncio.Task[Any], grace_s: float) -> None:
    """Cancel a background task and wait for it, at most `grace_s`. A pub/sub read inside
    redis-py has been seen to swallow the cancellation (a teardown hung on it), so loops also
    check a closing flag, and a close never waits on them unbounded."""
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=grace_s)
    if not done:
        log.warning("a background task did not stop within %.1f s: %r", grace_s, task)
    elif not task.cancelled() and task.exception() is not None:
        log.debug("background task ended with %r", task.exception())
