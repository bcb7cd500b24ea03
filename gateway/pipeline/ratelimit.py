"""Per-tenant rate limits: requests per minute and tokens per minute, as token buckets.

A bucket of limit L holds at most L units and refills at L/60 per second: a tenant may spend a
minute's budget in a burst, then gets it back as a trickle. A request needs 1 unit of the
requests bucket and its estimated tokens of the tokens bucket; it is admitted only when both
hold enough, and then both are debited together (never one without the other). A refused
request is told how long until it would fit (Retry-After). When the engine reports usage, the
tokens bucket is corrected by (used - estimated): it may go negative, a debt the next requests
wait out.

Where the buckets live:
- with a Redis URL, in Redis, as hashes `kvgate:ratelimit:{TENANT}:requests|tokens` (one hash
  tag, so one cluster slot): one Lua script per admission, on the Redis server's clock, so every
  gateway sharing the Redis enforces one limit between them;
- otherwise, or while Redis is unreachable, in this process, where a bucket that is full again
  is dropped as Redis expires it (`LocalBuckets`): the entries are bounded by the tenants whose
  buckets are still refilling, not by every tenant ever seen.
Every Redis call has a deadline. On a failure the limiter falls back to its local buckets for
`REDIS_RETRY_AFTER_S`, then tries Redis again; meanwhile each gateway enforces the full limit on
its own (N gateways admit up to N x the limit). Redis calls are never retried: a debit is not
idempotent, and a replayed one would charge twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as redis_async
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from cachemap.redis.client import PROTOCOL
from gateway.request.state import ExchangeRecord, idle_hook
from gateway.request.usage import EngineUsage

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 0.1
"""The deadline of one Redis round trip: on one network Redis answers in well under a
millisecond, so 100 ms means it is in trouble, and a request should not wait longer to learn
that it may proceed under the local limit."""
REDIS_RETRY_AFTER_S = 1.0
"""After a Redis failure, stay on the local buckets this long before trying Redis again, so an
outage costs one deadline per second, not one per request."""
SECONDS_PER_MINUTE = 60.0
KEY_PREFIX = "kvgate:ratelimit:"
MIN_SWEEP = 1024
"""The in-process buckets are swept for full ones no sooner than at this many entries (a few
hundred KB): below it a sweep would cost more than the entries it could drop."""

_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local limits = {tonumber(ARGV[1]), tonumber(ARGV[3])}
local costs = {tonumber(ARGV[2]), tonumber(ARGV[4])}
local levels = {}
local wait = 0
for i = 1, 2 do
  if limits[i] > 0 then
    local v = redis.call('HMGET', KEYS[i], 'level', 'at')
    local level, at = tonumber(v[1]), tonumber(v[2])
    if level == nil or at == nil then
      level = limits[i]
    else
      level = math.min(limits[i], level + (now - at) * limits[i] / 60)
    end
    levels[i] = level
    if level < costs[i] then
      wait = math.max(wait, (costs[i] - level) * 60 / limits[i])
    end
  end
end
if wait > 0 then return tostring(wait) end
for i = 1, 2 do
  if limits[i] > 0 then
    local level = levels[i] - costs[i]
    redis.call('HSET', KEYS[i], 'level', tostring(level), 'at', tostring(now))
    redis.call('PEXPIRE', KEYS[i], math.ceil((limits[i] - level) * 60000 / limits[i]) + 1000)
  end
end
return '0'
"""
"""KEYS: the requests and tokens buckets; ARGV: requests limit, 1, tokens limit, tokens (a
limit of 0 is no limit). Returns '0' (admitted, both debited) or the seconds to wait. A bucket
expires when it would be full again, which is the same as absent."""

_ADJUST = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local limit, delta = tonumber(ARGV[1]), tonumber(ARGV[2])
local v = redis.call('HMGET', KEYS[1], 'level', 'at')
local level, at = tonumber(v[1]), tonumber(v[2])
if level == nil or at == nil then
  level = limit
else
  level = math.min(limit, level + (now - at) * limit / 60)
end
level = math.min(limit, level - delta)
redis.call('HSET', KEYS[1], 'level', tostring(level), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil((limit - level) * 60000 / limit) + 1000)
return tostring(level)
"""
"""KEYS: the tokens bucket; ARGV: its limit, the tokens used beyond the estimate (negative:
a refund, capped at a full bucket)."""


@dataclass(frozen=True, slots=True)
class Limits:
    requests_per_min: int | None = None
    tokens_per_min: int | None = None

    @property
    def unlimited(self) -> bool:
        return self.requests_per_min is None and self.tokens_per_min is None


class LocalBuckets:
    """The same buckets in process memory, on a monotonic clock (one gateway's view).

    Invariants: a bucket full again is the same as an absent one (as in Redis, where it expires
    then), so each entry keeps the instant it is full again and a sweep drops those past it;
    the sweep runs when the entries have doubled since the last one (amortised O(1) per
    write), so at most 2 x max(the buckets not yet full at the last sweep, `MIN_SWEEP`) are
    held: a revoked or idle tenant's buckets go once they refill, whatever the tenants file.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[tuple[str, str], tuple[float, float, float]] = {}
        """(tenant, kind) -> (level, when it was that, when it is full again)"""
        self._sweep_at = MIN_SWEEP

    def __len__(self) -> int:
        return len(self._buckets)

    def _level(self, key: tuple[str, str], limit: int, now: float) -> float:
        stored = self._buckets.get(key)
        if stored is None:
            return float(limit)
        level, at, _ = stored
        return min(float(limit), level + (now - at) * limit / SECONDS_PER_MINUTE)

    def _store(self, key: tuple[str, str], limit: int, level: float, now: float) -> None:
        full_s = now + max(limit - level, 0.0) * SECONDS_PER_MINUTE / limit
        self._buckets[key] = (level, now, full_s)
        if len(self._buckets) >= self._sweep_at:
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        full = [key for key, (_, _, full_s) in self._buckets.items() if full_s <= now]
        for key in full:
            del self._buckets[key]
        self._sweep_at = max(MIN_SWEEP, 2 * len(self._buckets))

    def acquire(self, tenant: str, limits: Limits, tokens: int) -> float:
        """0.0 when admitted (both buckets debited), else the seconds until it would fit."""
        now = self._clock()
        wanted = [
            ((tenant, "requests"), limits.requests_per_min, 1),
            ((tenant, "tokens"), limits.tokens_per_min, tokens),
        ]
        levels: list[tuple[tuple[str, str], int, float, int]] = []
        wait = 0.0
        for key, limit, cost in wanted:
            if limit is None:
                continue
            level = self._level(key, limit, now)
            if level < cost:
                wait = max(wait, (cost - level) * SECONDS_PER_MINUTE / limit)
            levels.append((key, limit, level, cost))
        if wait > 0:
            return wait
        for key, limit, level, cost in levels:
            self._store(key, limit, level - cost, now)
        return 0.0

    def adjust(self, tenant: str, tokens_per_min: int, delta: int) -> None:
        now = self._clock()
        key = (tenant, "tokens")
        level = self._level(key, tokens_per_min, now)
        self._store(key, tokens_per_min, min(float(tokens_per_min), level - delta), now)


class RateLimiter:
    """Admission against per-tenant limits, in Redis when configured, else (or while Redis is
    failing) in process. Methods never raise for a Redis problem: they fall back."""

    def __init__(
        self,
        redis_url: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError("the rate limit's Redis timeout must be positive")
        self.local = LocalBuckets(clock)
        self.timeout_s = timeout_s
        self.num_redis_failures = 0
        self._clock = clock
        self._redis_down_until = 0.0
        self._redis: redis_async.Redis | None = None
        if redis_url:
            self._redis = redis_async.Redis.from_url(
                redis_url,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0),  # a replayed debit would charge twice
                protocol=PROTOCOL,
            )
            self._acquire_script = self._redis.register_script(_ACQUIRE)
            self._adjust_script = self._redis.register_script(_ADJUST)

    @staticmethod
    def keys(tenant: str) -> list[str]:
        tag = "{" + tenant + "}"  # tenant names never hold braces: one hash tag, one slot
        return [f"{KEY_PREFIX}{tag}:requests", f"{KEY_PREFIX}{tag}:tokens"]

    def _redis_usable(self) -> bool:
        return self._redis is not None and self._clock() >= self._redis_down_until

    def _redis_failed(self, exc: BaseException) -> None:
        self.num_redis_failures += 1
        if self._clock() >= self._redis_down_until:
            log.warning(
                "rate limits: Redis failed (%s: %s); enforcing them per gateway for %.0f s",
                type(exc).__name__,
                exc,
                REDIS_RETRY_AFTER_S,
            )
        self._redis_down_until = self._clock() + REDIS_RETRY_AFTER_S

    async def acquire(self, tenant: str, limits: Limits, tokens: int) -> float:
        """0.0 when the request is admitted (and charged), else the seconds to wait."""
        if limits.unlimited:
            return 0.0
        if self._redis_usable():
            args = [limits.requests_per_min or 0, 1, limits.tokens_per_min or 0, tokens]
            try:
                async with asyncio.timeout(self.timeout_s):
                    reply = await self._acquire_script(keys=self.keys(tenant), args=args)
                return float(reply)
            except (RedisError, OSError, TimeoutError) as exc:
                self._redis_failed(exc)
        return self.local.acquire(tenant, limits, tokens)

    async def adjust(self, tenant: str, tokens_per_min: int, delta: int) -> None:
        """Correct the tokens bucket by the tokens used beyond the admission's estimate."""
        if delta == 0:
            return
        if self._redis_usable():
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self._adjust_script(
                        keys=self.keys(tenant)[1:], args=[tokens_per_min, delta]
                    )
                return
            except (RedisError, OSError, TimeoutError) as exc:
                self._redis_failed(exc)
        self.local.adjust(tenant, tokens_per_min, delta)

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()


class TokenSettlement:
    """An exchange observer: settles a tokens/min charge made at admission (an estimate) with
    the tokens the engine reports the request used."""

    def __init__(self, limiter: RateLimiter) -> None:
        self.limiter = limiter

    @idle_hook
    async def on_first_token(self, record: ExchangeRecord) -> None:
        return None

    async def on_usage(self, record: ExchangeRecord, usage: EngineUsage) -> None:
        tenant = record.tenant
        tokens_per_min = tenant.policy.tokens_per_min
        used = usage.used_tokens
        if tokens_per_min is None or used is None:
            return
        await self.limiter.adjust(tenant.name, tokens_per_min, used - record.routed.admitted_tokens)

    @idle_hook
    async def on_finish(self, record: ExchangeRecord) -> None:
        return None
