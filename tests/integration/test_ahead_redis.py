"""The requests looked up ahead, live (`gateway.fleet.ahead`, `router.ahead`) against a real
redis-server: gateways on one Redis, each registering its requests and deciding with the ones
ahead placed first on the published load, place a burst as one gateway would; a request leaves
the list when its gateway publishes; a dead gateway's entries expire; a gateway of the commit
before (no registration, a plain `HSET` of its figures) beside a new one changes nothing for
either. Replica URLs and the list's key are unique per test."""

from __future__ import annotations

import asyncio
import random
import uuid
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachemap.redis.client import AnyRedis, open_redis
from gateway.fleet.replicas import FleetLoad, ReplicaSet, ReplicaState
from gateway.fleet.shared_load import SharedLoad
from router.ahead import place_ahead, ties_by_id
from router.registry import build_policy
from router.types import Replica, RouteRequest

pytestmark = pytest.mark.redis

POLICY = build_policy("cache_aware")


class Gateway:
    """One gateway's replica states, shared load and decisions, as the director makes them
    (`gateway.pipeline.director`, `_route`): register, decide on the published view with the
    requests ahead placed first, lease, report the decision."""

    def __init__(
        self, client: AnyRedis, urls: list[str], key: bytes, name: str, ahead: bool = True
    ) -> None:
        shared = FleetLoad()
        self.states = {url: ReplicaState(url, healthy=True, fleet=shared) for url in urls}
        self.set = ReplicaSet.__new__(ReplicaSet)  # the methods under test need its states only
        self.set.states = self.states
        self.load = SharedLoad(
            client, lambda: list(self.states.values()), 0.1, gateway_id=name, ahead=ahead
        )
        self.load.ahead_key = key
        self.set.shared_load = self.load
        self.unreported: list[tuple[str, str]] = []

    async def route(self, req: RouteRequest, report: bool = True) -> str:
        """`report` False: the decision is reported later (`report`), as if the whole burst
        were decided in one instant, before any gateway's publish."""
        peers, rank = self.load.herd()
        route = replace(req, peers=peers, peer_rank=rank)
        registered = await self.load.register(route)
        if registered is None:  # alone, or off: as before, on this gateway's exact view
            view = [s.snapshot() for s in self.states.values()]
        else:
            _, had, items = registered
            route = ties_by_id(route) if had else route
            published = [self.set.published(s) for s in self.states.values()]
            view = place_ahead(POLICY, items, published)[0]
        decision = POLICY.decide(route, view, random.Random(0))
        assert decision is not None
        self.states[decision.replica].lease(route.uncached_tokens(decision.replica)).keep()
        if registered is not None:
            self.unreported.append((registered[0], decision.replica))
        if report:
            self.report()
        return decision.replica

    def report(self) -> None:
        for rid, replica in self.unreported:
            self.load.decided(rid, replica)
        self.unreported.clear()


def one_gateway(burst: list[RouteRequest], view: list[Replica]) -> list[str]:
    """One gateway placing `burst` one request after another, ties by id."""
    placed, out = list(view), []
    for req in burst:
        decision = POLICY.decide(ties_by_id(req), placed, random.Random(0))
        assert decision is not None
        out.append(decision.replica)
        i = [r.id for r in placed].index(decision.replica)
        placed[i] = replace(
            placed[i],
            num_inflight=placed[i].num_inflight + 1,
            pending_prefill_tokens=placed[i].pending_prefill_tokens
            + req.uncached_tokens(decision.replica),
        )
    return out


def request(urls: list[str], blocks: int, held: dict[int, int]) -> RouteRequest:
    return RouteRequest(
        num_blocks=blocks,
        num_prompt_tokens=blocks * 64.0,
        overlap={urls[i]: min(n, blocks) for i, n in held.items()},
        tokens_per_block=64.0,
    )


async def started(client: AnyRedis, n: int, ahead: tuple[bool, ...] | None = None) -> list[Gateway]:
    run = uuid.uuid4().hex[:8]
    urls = [f"http://{run}-{i}:8000" for i in range(4)]
    key = b"kvg:{kvg-load}:ahead-" + run.encode()
    gateways = [  # ids in the gateways' order: their herd ranks
        Gateway(client, urls, key, f"{run}-g{g}", True if ahead is None else ahead[g])
        for g in range(n)
    ]
    for g in gateways:
        await g.load.round()
    for g in gateways:
        await g.load.round()  # every one has seen the others
    return gateways


@pytest.fixture
async def client(redis_url: str) -> AnyRedis:
    redis = await open_redis(redis_url)
    yield redis
    await redis.aclose()


@settings(max_examples=25, deadline=None)
@given(
    burst=st.lists(
        st.tuples(
            st.sampled_from((2, 8, 60, 400, 1_500)),
            st.dictionaries(st.integers(0, 3), st.sampled_from((1, 4, 30)), max_size=2),
        ),
        min_size=1,
        max_size=10,
    ),
    n=st.integers(2, 4),
)
def test_gateways_on_one_redis_place_a_burst_as_one_gateway(
    redis_session: str, burst: list[tuple[int, dict[int, int]]], n: int
) -> None:
    """The burst spread round robin over `n` gateways, every request decided before any
    publish (a burst's instant): each gateway's decisions are one gateway's, in Redis's order."""

    async def run() -> None:
        client = await open_redis(redis_session)
        gateways = await started(client, n)
        urls = list(gateways[0].states)
        reqs = [request(urls, blocks, held) for blocks, held in burst]
        placed = [await gateways[i % n].route(req, report=False) for i, req in enumerate(reqs)]
        idle = [Replica(url, True, 0, 0.0) for url in urls]
        assert placed == one_gateway(reqs, idle)
        for i, g in enumerate(gateways):
            assert g.load.registered == len(reqs[i::n])
            g.report()
            await g.load.stop()
        await client.aclose()

    asyncio.run(run())


@pytest.fixture(scope="module")
def redis_session(redis_url: str) -> str:
    return redis_url


async def test_a_request_leaves_the_list_when_its_gateway_publishes(client: AnyRedis) -> None:
    a, b = await started(client, 2)
    urls = list(a.states)
    where = await a.route(request(urls, 400, {}), report=False)
    registered = await b.load.register(request(urls, 8, {}))
    assert registered is not None
    [item] = registered[2]
    assert item.replica is None and item.req.num_blocks == 400  # a's, unpublished
    b.load.decided(registered[0], None)
    a.report()
    future = a.load.publish()  # a's figures with its request, and it out of the list
    assert future is not None
    await future
    registered = await b.load.register(request(urls, 8, {}))
    assert registered is not None and registered[2] == []  # b's own was decided: gone too
    peer = b.states[where].peer
    assert peer is not None and peer.num_inflight == 1  # a's is in its figures now
    assert b.set.published(b.states[where]).pending_prefill_tokens == 400 * 64.0
    for g in (a, b):
        await g.load.stop()


async def test_a_dead_gateways_requests_stop_counting_after_the_bound(client: AnyRedis) -> None:
    a, b = await started(client, 2)
    urls = list(a.states)
    a.load.ahead_ttl_ms = b.load.ahead_ttl_ms = 1
    await a.route(request(urls, 400, {}))  # a dies: never publishes
    a.load._stopped = True

    async def redis_ms() -> int:
        seconds, micros = await client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    registered_by = await redis_ms()
    while await redis_ms() <= registered_by + 2:
        pass  # bounded by Redis's clock moving on, which it does
    registered = await b.load.register(request(urls, 8, {}))
    assert registered is not None and registered[2] == []  # a's dropped: past the bound
    await b.load.stop()
    await a.load._call("", 1.0)  # its load entry too (the stale bound would, in seconds)


async def test_a_gateway_of_the_commit_before_beside_a_new_one(client: AnyRedis) -> None:
    """The old one neither registers nor removes: its placements reach the new one in its
    figures (plain HSET), and the new one's entries are its own to remove."""
    old, new = await started(client, 2, ahead=(False, True))
    urls = list(old.states)
    assert await old.load.register(request(urls, 8, {})) is None  # the commit before: none
    where = await old.route(request(urls, 1_500, {}))
    future = old.load.publish()
    assert future is not None
    await future
    registered = await new.load.register(request(urls, 8, {}))
    assert registered is not None and registered[2] == []
    assert new.states[where].peer is not None
    assert new.states[where].peer.prefill_tokens == 1_500 * 64.0
    new.load.decided(registered[0], urls[0])
    future = new.load.publish()
    assert future is not None
    await future
    assert await client.zcard(new.load.ahead_key) == 0
    for g in (old, new):
        await g.load.stop()


async def test_a_gateway_alone_registers_nothing(client: AnyRedis) -> None:
    """No peer: no registration, no round trip; it routes as it always did."""
    (alone,) = await started(client, 1)
    urls = list(alone.states)
    assert await alone.load.register(request(urls, 8, {})) is None
    req = request(urls, 8, {})
    before = POLICY.decide(req, [s.snapshot() for s in alone.states.values()], random.Random(0))
    assert before is not None and await alone.route(req) == before.replica
    assert alone.load.registered == 0
    await alone.load.stop()
