"""Placement under cache pressure, live: real simulated engines with a small KV publishing
their events over real ZMQ, a precise gateway building each replica's eviction frontier from
them. A new conversation goes where it evicts a cold conversation's blocks, not a hot
session's — which `cache_aware`, blind to what a placement evicts, gets wrong."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from loadgen.harness.redis_servers import RedisServer
from loadgen.text import words
from tests.conftest import metrics_url
from tests.e2e.test_precise import (
    chat,
    direct,
    indexed,
    parts_of,
    precise_fleet,
    salt_of,
    via,
)
from tests.e2e.test_precise_shared import intake_of, join, owner_of, shared_settings
from tests.loadgen.test_kv_events import events_config, free_ports
from tests.servers import Served, wait_until

pytestmark = pytest.mark.e2e
__all__ = ["precise_fleet"]  # the fixture, used by name
CAPACITY = 48
"""KV blocks of 16 tokens per engine: room for one ~30-block conversation and a bit more."""
HOT_S, HALF_LIFE_S = 0.5, 0.05
"""The displacement's hot horizon and half-life, shrunk so the test need not wait 15 s: a
conversation idle for 1 s weighs 2^-10 of a live one."""

SYSTEM = {"role": "system", "content": "You are terse." + words("frontier-system", 60)}
HOT = [SYSTEM, {"role": "user", "content": words("frontier-hot", 420)}]
COLD = [
    {"role": "system", "content": "You are verbose." + words("frontier-other", 60)},
    {"role": "user", "content": words("frontier-cold", 420)},
]
NEW = [SYSTEM, {"role": "user", "content": words("frontier-new", 520)}]
"""Shares the hot session's system prompt: the longest cached prefix is on the hot replica."""


def oldest_idle_s(gateway: Served, order: Any, domain: str) -> float:
    """How long the domain's next evicted block has been idle; -1 before its order holds one.

    Read on the gateway's loop (`Served.on_loop`): the order drops its emptied runs as it is
    read, and a read from the test's thread between a store's new run and its blocks joining
    it dropped that run, leaving the order empty for good (CI: "X's conversation cold" timed
    out; before that, an IndexError on the empty order)."""
    runs = gateway.on_loop(lambda: order.eviction_runs(domain, 1, time.time()))
    return float(runs[0][1]) if runs else -1.0


def cached(response: dict[str, object]) -> int:
    usage = response["usage"]
    assert isinstance(usage, dict)
    return int(usage["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.parametrize("policy", ["cache_pressure", "cache_aware"])
def test_a_new_conversation_evicts_the_cold_conversation_not_the_hot_session(
    policy: str,
    precise_fleet: Callable[..., tuple[list[Served], list[Served]]],
) -> None:
    (x, y), (gateway,) = precise_fleet(
        2,
        capacity_blocks=CAPACITY,
        gateway_overrides={
            "policy": policy,
            "displacement_hot_s": HOT_S,
            "displacement_half_life_s": HALF_LIFE_S,
            "metrics_interval_s": 0.05,
        },
    )
    states = parts_of(gateway).replicas.states
    wait_until(
        lambda: all((m := states[e.url].metrics) and m.num_gpu_blocks == CAPACITY for e in (x, y)),
        what="the engines' capacity scraped",
    )
    salt = salt_of(gateway)
    direct(x, chat(COLD), salt)  # X: a conversation nobody has used since
    wait_until(indexed(gateway, x.url, 20), what="X's blocks indexed")
    index = parts_of(gateway).keying.precise.index  # type: ignore[union-attr]
    if index.track_recency:  # cache_aware reads no age: nothing to wait for
        wait_until(  # the cold conversation ages past the hot horizon
            lambda: oldest_idle_s(gateway, index, x.url) >= 2 * HOT_S,
            what="X's conversation cold",
        )
    hot = direct(y, chat(HOT), salt)  # Y: a session in use now
    wait_until(indexed(gateway, y.url, 20), what="Y's blocks indexed")
    hot_cached = direct(y, chat(HOT), salt)
    assert cached(hot_cached) >= 16 * 20  # the session's blocks are all on Y

    placed = via(gateway, chat(NEW))
    matched_on_y = int(placed.headers["x-kvgate-matched-blocks"])
    step = chat([*HOT, hot["choices"][0]["message"], {"role": "user", "content": "next"}])
    after = direct(y, step, salt)
    if policy == "cache_pressure":
        # the frontier: on Y it would evict the session's live blocks, on X only cold ones
        assert placed.headers["x-kvgate-replica"] == x.url
        assert cached(after) >= cached(hot_cached)  # the session's next step finds them all
        frontiers = parts_of(gateway).director.frontiers
        assert frontiers is not None and frontiers.num_built >= 2
    else:
        # the longest prefix (the shared system prompt) wins, and the session pays for it
        assert placed.headers["x-kvgate-replica"] == y.url and matched_on_y > 0
        assert cached(after) < cached(hot_cached)
        assert parts_of(gateway).director.frontiers is None


SHARED_HOT_S, SHARED_HALF_LIFE_S = 1.5, 0.15
"""Shared mode reads another owner's order up to two rounds (~0.2 s) late: a horizon with
room for that on a loaded machine."""


@pytest.mark.redis
def test_two_gateways_sharing_the_index_place_on_the_owners_published_order(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    fresh_redis: RedisServer,
) -> None:
    """`kv_events_shared`: each gateway owns one engine's events. The gateway placing the new
    conversation owns X (its order in memory) and reads Y's as Y's owner publishes it: the
    same choice as in process, where `cache_aware` would evict the hot session."""
    base = free_ports(2)
    x, y = (
        start_engines(1, kv_events=events_config(base + i), capacity_blocks=CAPACITY)[0]
        for i in range(2)
    )
    ports = {x.url: base, y.url: base + 1}
    settings = shared_settings(
        ports,
        fresh_redis.url,
        policy="cache_pressure",
        displacement_hot_s=SHARED_HOT_S,
        displacement_half_life_s=SHARED_HALF_LIFE_S,
        metrics_interval_s=0.05,
    )
    gateways = [start_gateway([x, y], **settings) for _ in "ab"]
    join(gateways, [x, y])
    gateway = owner_of(gateways, x.url)
    assert y.url not in intake_of(gateway).owned()  # Y's order comes over Redis
    states = parts_of(gateway).replicas.states
    wait_until(
        lambda: all((m := states[e.url].metrics) and m.num_gpu_blocks == CAPACITY for e in (x, y)),
        what="the engines' capacity scraped",
    )
    frontiers = parts_of(gateway).director.frontiers
    assert frontiers is not None
    order = frontiers.index
    salt = salt_of(gateway)
    direct(x, chat(COLD), salt)
    wait_until(
        lambda: (
            order.num_blocks(x.url) >= 20
            and oldest_idle_s(gateway, order, x.url) >= 2 * SHARED_HOT_S
        ),
        what="X's conversation indexed and cold",
    )
    hot = direct(y, chat(HOT), salt)
    wait_until(lambda: order.num_blocks(y.url) >= 20, what="Y's order published and read")
    hot_cached = direct(y, chat(HOT), salt)
    assert cached(hot_cached) >= 16 * 20

    placed = via(gateway, chat(NEW))
    step = chat([*HOT, hot["choices"][0]["message"], {"role": "user", "content": "next"}])
    after = direct(y, step, salt)
    assert placed.headers["x-kvgate-replica"] == x.url
    assert cached(after) >= cached(hot_cached)
    assert frontiers.num_built >= 2
    shared = intake_of(owner_of(gateways, y.url)).frontiers
    assert shared is not None and shared.published >= 1
    # the owner keeps publishing while the test scrapes: the count scraped lies between the
    # counts read just before and just after the scrape
    before = shared.published
    scraped = httpx.get(metrics_url(owner_of(gateways, y.url)) + "/metrics").text
    after = shared.published
    line = 'kvgate_events_shared_frontiers_total{event="published"} '
    values = [float(s.split(" ")[1]) for s in scraped.splitlines() if s.startswith(line)]
    assert len(values) == 1 and before <= values[0] <= after, (before, values, after)
