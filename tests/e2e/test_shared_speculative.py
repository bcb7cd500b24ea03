"""Shared speculative entries (`kv_events_shared`): two real gateways, one real redis-server,
real engines publishing KV events over ZMQ. A request placed by gateway A is matched by gateway
B's next lookup as A's speculative entry, before the engine's BlockStored exists — so a fan-out
sibling routed by B goes to the leader's replica, not to the idle one."""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx
import pytest

from gateway.events.precise import PreciseKeys
from loadgen.engine.timing import TimingModel
from loadgen.harness.redis_servers import RedisServer
from tests.e2e.test_precise import CONVERSATION, chat, parts_of, via
from tests.e2e.test_precise_shared import join, owner_of, shared_settings, writer_of
from tests.loadgen.test_kv_events import events_config, free_ports
from tests.servers import Served, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.redis]
SLOW = TimingModel(prefill_tokens_per_s=100)
"""The conversation (~200 tokens) prefills in ~2 s: its blocks are announced only then."""


def precise_of(gateway: Served) -> PreciseKeys:
    keying = parts_of(gateway).keying
    assert keying is not None and keying.precise is not None
    return keying.precise


def test_a_sibling_at_another_gateway_sees_the_leaders_speculative_entry(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    fresh_redis: RedisServer,
) -> None:
    base = free_ports(2)
    engines = [
        start_engines(1, kv_events=events_config(base + i), timing=SLOW)[0] for i in range(2)
    ]
    ports = {e.url: base + i for i, e in enumerate(engines)}
    settings = shared_settings(ports, fresh_redis.url, speculative_ttl_s=10.0)
    a, b = (start_gateway(engines, **settings) for _ in "ab")
    join([a, b], engines)
    body = chat(CONVERSATION)
    leader = threading.Thread(target=via, args=(a, body))
    leader.start()
    shared = precise_of(a).shared
    assert shared is not None
    wait_until(lambda: shared.speculated >= 8, what="A's speculative entry shared")
    [home] = [e.url for e in engines if precise_of(a).index.num_speculative(e.url)]
    assert writer_of(owner_of([a, b], home)).num_blocks(home) == 0  # no event yet
    assert precise_of(b).index.num_speculative(home) == 0  # and nothing of it in B's process
    sibling = via(b, body)
    assert sibling.headers["x-kvgate-replica"] == home
    assert int(sibling.headers["x-kvgate-matched-blocks"]) >= 8
    leader.join(timeout=30)
    assert not leader.is_alive()
    assert httpx.get(home + "/health").status_code == 200
