"""The tests' Redis holder (`tests.busy_loop.RedisHolder`): another client's back-to-back
calls, which must stop when told — whenever it is told — or the test using it hangs."""

from __future__ import annotations

import asyncio

import pytest

from cachemap.redis.client import open_redis
from loadgen.harness.redis_servers import RedisServer
from tests.busy_loop import RedisHolder

pytestmark = pytest.mark.redis


async def test_a_redis_holder_stops_when_told_as_its_next_call_is_sent(
    fresh_redis: RedisServer,
) -> None:
    """Told to stop 0-3 loop iterations after one of its calls returned, while redis-py sends
    the next. A holder stopped by cancelling its task went on holding Redis when told in the
    first three (CPython 3.11's `asyncio.wait_for` in redis-py's send returns the send's result
    and drops the cancellation, gh-86296): the CI run at fbdc0f5's parent hung 300 s in
    `test_a_shared_lookup_queued_behind_writes_within_the_cap_is_answered` on it."""
    client = await open_redis(fresh_redis.url)
    try:
        for yields in range(4):
            holder = RedisHolder(client, 2_000)
            async with holder:
                calls = holder.calls
                for _ in range(10_000):  # bounded: until a call of its returns
                    await asyncio.sleep(0)
                    if holder.calls > calls:
                        break
                else:
                    raise AssertionError("the holder's calls stopped returning")
                for _ in range(yields):
                    await asyncio.sleep(0)
            stopped = holder.calls  # the exit waited for it (at most STOP_WITHIN_S)
            for _ in range(20):
                await asyncio.sleep(0)
            assert holder.calls == stopped, yields
    finally:
        await client.aclose()
