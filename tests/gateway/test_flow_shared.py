"""Fairness counters shared through a real redis-server (gateway.pipeline.flow_shared): two fair
queues, as two gateways would hold them, converge to the fleet's shares.

Gateway 1 has tenants A and B backlogged, gateway 2 only A (an uneven spread of traffic over a
Service); each dispatches one request a step. On their own counters gateway 1 alternates and A
gets three quarters of the fleet; sharing, gateway 1 sees what gateway 2 served A and serves B,
so the fleet's shares follow the (equal) weights."""

from __future__ import annotations

import uuid

from cachemap.redis.client import open_redis
from gateway.pipeline.flow_shared import SharedCounters, band_key
from loadgen.harness.redis_servers import RedisServer
from router.fairness import FairQueue
from tests.busy_loop import lent_connections

COST = 1_000.0
STEPS = 240
ROUND_EVERY = 4
"""A sync round every four dispatches of each gateway: the batching the shared mode relies on."""


def _keep_backlogged(queue: FairQueue[str], scopes: list[str], step: int) -> None:
    """Two requests of each flooding scope waiting at every step (a flood never empties its
    sub-queue: an emptied one would be lifted on its return, sharing or not)."""
    for scope in scopes:
        while queue.depth(scope) < 2:
            queue.push(scope, scope=scope, band=0, weight=1.0, cost=COST, now_s=float(step))


async def _served(shared: bool, redis_url: str) -> dict[str, float]:
    a, b = f"a-{uuid.uuid4().hex}", f"b-{uuid.uuid4().hex}"
    q1: FairQueue[str] = FairQueue()
    q2: FairQueue[str] = FairQueue()
    client = await open_redis(redis_url)
    counters = [SharedCounters(client, q, 0.1) for q in (q1, q2)] if shared else []
    served = {a: 0.0, b: 0.0}
    try:
        for step in range(STEPS):
            _keep_backlogged(q1, [a, b], step)
            _keep_backlogged(q2, [a], step)
            for queue in (q1, q2):
                queued = queue.pop()
                assert queued is not None
                served[queued.scope] += queued.cost
            if step % ROUND_EVERY == ROUND_EVERY - 1:
                for c in counters:
                    await c.round()
        if shared:
            totals = await client.hmget(band_key(0), [a, b])
            assert [float(t) for t in totals] == [served[a], served[b]]  # every dispatch published
            assert all(c.rounds == STEPS // ROUND_EVERY and c.failed == 0 for c in counters)
            await client.hdel(band_key(0), a, b)
    finally:
        await client.aclose()
    total = sum(served.values())
    return {"a": served[a] / total, "b": served[b] / total}


async def test_two_gateways_sharing_counters_converge_to_the_weights(redis_url: str) -> None:
    alone = await _served(shared=False, redis_url=redis_url)
    assert 0.70 <= alone["a"] <= 0.80  # gateway 1 alternates, gateway 2 serves only A
    shared = await _served(shared=True, redis_url=redis_url)
    assert abs(shared["b"] - 0.5) <= 0.05, shared  # gateway 1 serves B while A is ahead


async def test_a_round_without_redis_keeps_its_service_for_the_next(
    fresh_redis: RedisServer,
) -> None:
    """Redis away: the round fails (counted), the service it carried is kept and published by
    the first round that gets through, once, and nothing raises."""
    queue: FairQueue[str] = FairQueue()
    scope = f"s-{uuid.uuid4().hex}"
    client = await open_redis(fresh_redis.url, timeout_s=0.2)
    counters = SharedCounters(client, queue, 0.1)
    try:
        _keep_backlogged(queue, [scope], 0)
        assert queue.pop() is not None  # COST served
        fresh_redis.stop()
        await counters.round()
        assert (counters.rounds, counters.failed) == (0, 1)
        fresh_redis.start()
        await counters.round()
        await counters.round()  # nothing new: published once
        assert counters.rounds == 2
        assert float(await client.hget(band_key(0), scope)) == COST
    finally:
        await client.aclose()


async def test_rounds_go_down_a_connection_of_their_own(redis_url: str) -> None:
    """On a single Redis a round's commands are written down the counters' own connection
    (`LookupLane.commands`), taken from the client's pool once, not a pooled pipeline a round
    (a connection taken and given back, ~0.6 ms of a busy gateway's CPU); what they publish
    and read is the same."""
    queue: FairQueue[str] = FairQueue()
    peer: FairQueue[str] = FairQueue()
    scope = f"s-{uuid.uuid4().hex}"
    client = await open_redis(redis_url)
    with lent_connections(client.connection_pool) as taken:
        counters = SharedCounters(client, queue, 0.1)
        other = SharedCounters(await open_redis(redis_url), peer, 0.1)
        try:
            for step in range(3):
                _keep_backlogged(queue, [scope], step)
                _keep_backlogged(peer, [scope], step)
                assert queue.pop() is not None and peer.pop() is not None
                await counters.round()
                await other.round()
            assert (counters.rounds, counters.failed, taken[0]) == (3, 0, 1)
            assert float(await client.hget(band_key(0), scope)) == 6 * COST
            assert 0 < await client.ttl(band_key(0)) <= 3600
            before = queue.counter(scope, 0)
            assert before is not None
            await counters.round()  # reads the peer's last dispatch, published after its read
            assert queue.counter(scope, 0) == before + COST
        finally:
            await counters.stop()
            await other.stop()
            await client.hdel(band_key(0), scope)
            await client.aclose()
            await other.client.aclose()
