"""Connecting to Redis or Redis Cluster, and stopping the directory's background tasks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff

log = logging.getLogger(__name__)

AnyRedis = aioredis.Redis | RedisCluster

PROTOCOL = 3
"""RESP3: what redis-py 8 (the pinned major) defaults to and the suite runs on; Redis >= 6 speaks
it. Set explicitly, so a change of the library's default cannot change the replies' types."""


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
    (`PROTOCOL`), stated rather than left to the library's default.
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
    return aioredis.Redis.from_url(url, **options)


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
