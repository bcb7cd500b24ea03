"""Holds and hot-prefix rates shared by two gateways through one Redis."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

import openai
import pytest
import redis

from loadgen.engine.timing import TimingModel
from loadgen.harness.redis_servers import without_pubsub
from tests.clients import director
from tests.conftest import MODEL, TENANT_KEY
from tests.e2e.test_fanout import SHARED_TOKENS, computed_tokens, send_all, sibling
from tests.servers import Served, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

SHARED = {"redis_deadline_s": 0.5, "server_secret": "fleet", "engine_prefill_tokens_per_s": 6_500}
SLOW_WRITE = TimingModel(prefill_tokens_per_s=1_000, decode_s_per_token=0.001)
"""The leader's write of the ~4k shared tokens takes ~4 s: the siblings, sent once its marker is
in Redis, are routed inside it even on a loaded machine (at 6,500 tokens/s, ~0.6 s, B's
siblings were routed after the landing under two CPU hogs, and rightly did not hold; 2 s was
still close under pytest-xdist at a load average of 18)."""
SLOW_WRITE_ESTIMATE = 500
"""The gateways' prefill estimate beside `SLOW_WRITE`: a hold's bound (twice the estimated
prefill, ~16 s) stays well past the landing, so only the landing releases the siblings."""
PACE_S = 0.2
"""The rate test's gap between one request and the next, on the clock the test drives (every
gateway's directory and rate clocks): each gateway alone sees 150 requests/min, the two
together 300 (the threshold is 180), however long a request takes on the wall clock (at a load
average of 18 one took ~0.9 s, and the wall-clock rate fell under the threshold)."""


def drive_clock(gateways: tuple[Served, ...], now: list[float]) -> None:
    """The gateways' directories and prefix rates read `now[0]` (the test sets it): the shared
    lookup's rate is computed at the caller's time, the local rate on its own clock."""

    def clock() -> float:
        return now[0]

    for g in gateways:
        routing = director(g).directory
        routing.local.index.clock = clock
        if routing.shared is not None:
            routing.shared.clock = clock
        if routing.rates is not None:
            routing.rates.clock = clock


@pytest.mark.parametrize("pubsub", ["working", "refused"])
def test_siblings_at_two_gateways_wait_for_one_leader(
    pubsub: str,
    fresh_redis: Any,
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
) -> None:
    """With pub/sub refused (item 14: the gateways' Redis user may not SUBSCRIBE) the landing
    still releases the siblings at B: their wait polls the leader's marker."""
    engines = start_engines(4, timing=SLOW_WRITE)
    url = fresh_redis.url if pubsub == "working" else without_pubsub(fresh_redis.url)
    settings = {**SHARED, "engine_prefill_tokens_per_s": SLOW_WRITE_ESTIMATE}
    a, b = (start_gateway(engines, redis_url=url, **settings) for _ in range(2))
    markers = redis.Redis.from_url(fresh_redis.url)

    def leader() -> Any:
        with openai.OpenAI(base_url=a.url + "/v1", api_key=TENANT_KEY, max_retries=0) as c:
            return c.chat.completions.create(model=MODEL, messages=sibling(0), max_tokens=2)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(leader)
        # the leader has announced its write (its markers are in Redis)
        wait_until(lambda: any(True for _ in markers.scan_iter(match="kvg:*:w")), what="markers")
        batch = [(TENANT_KEY, sibling(i)) for i in range(1, 16)]

        async def both() -> list[list[Any]]:
            return list(await asyncio.gather(send_all(b, batch[:8]), send_all(a, batch[8:])))

        results_b, results_a = asyncio.run(both())
        leader_reply = first.result(timeout=30)
    markers.close()
    # eight siblings at B waited for A's leader (through Redis), seven at A (in process)
    assert leader_reply.usage.engine_cached_tokens == 0
    for r in results_a + results_b:
        assert isinstance(r, tuple) and r[0].usage.engine_cached_tokens >= SHARED_TOKENS - 32
    stats_b = director(b).placement.flights.stats  # type: ignore[union-attr]
    assert stats_b.holds == 8 and stats_b.released_landed == 8 and stats_b.timeouts == 0
    assert computed_tokens(engines) < SHARED_TOKENS + 16 * 200


@pytest.mark.parametrize("shared", [True, False])
def test_two_gateways_add_up_one_rate(
    shared: bool,
    fresh_redis: Any,
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
) -> None:
    engines = start_engines(4)
    extra: dict[str, Any] = {"overflow_threshold_per_min": 180, "fanout_hold": False}
    if shared:
        extra |= {"redis_url": fresh_redis.url, "redis_deadline_s": 0.5}
    a, b = (start_gateway(engines, server_secret="fleet", **extra) for _ in range(2))
    now = [time.time()]
    drive_clock((a, b), now)
    for i in range(16):  # alternately at A and B, PACE_S apart on the driven clock
        now[0] += PACE_S
        gateway = (a, b)[i % 2]
        asyncio.run(send_all(gateway, [(TENANT_KEY, sibling(i, tag="rate"))]))
        wait_until(lambda g=gateway: director(g).directory.idle, what="record flushed")
    widenings = sum(director(g).placement.stats.widenings for g in (a, b))
    if shared:
        assert widenings >= 1
    else:
        assert widenings == 0
