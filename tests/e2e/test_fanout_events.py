"""Precise mode: a fan-out leader lands when its engine's KV events report its prefix stored,
not only at its first byte. Real engines publishing over real ZMQ, two gateways sharing one
Redis (a sibling at another gateway is the one that holds: the leader's own gateway routes its
siblings straight to the leader's replica on the speculative entry)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
import redis

from cachemap.events import EventIndex, precise_keys, replica_of
from gateway.events.intake import EventIntake, EventsConfig
from gateway.pipeline.flights import Flights
from loadgen.engine.timing import TimingModel
from loadgen.text import words
from tests.clients import director
from tests.conftest import MODEL, TENANT_KEY
from tests.e2e.test_fanout import SHARED_TOKENS
from tests.e2e.test_precise import TOPIC, join, precise_settings
from tests.loadgen.test_kv_events import events_config, free_ports
from tests.servers import Served, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

SLOW_FIRST_CHUNK = {
    "timing": TimingModel(prefill_tokens_per_s=6_500, decode_s_per_token=0.01),
    "stream_interval": 50,
}
"""The shared prefix prefills in ~0.6 s; a completion's first chunk (no role chunk before it)
waits for 50 tokens, ~0.5 s of decode: the engine's BlockStored comes well before it."""
GATEWAY_PREFILL_ESTIMATE = 2_000
"""The gateways' prefill estimate, a third of those engines' speed: a hold's bound (twice the
expected prefill, ~2 s) outlasts a loaded machine's event path, so only the leader's landing
releases its siblings (at 6,500 the 0.65-s bound ran out in CI, then the leader landed)."""
SLOW_LEADER = {
    **SLOW_FIRST_CHUNK,
    "timing": TimingModel(prefill_tokens_per_s=2_000, decode_s_per_token=0.01),
}
"""Engines for a sibling sent to another gateway once the leader's marker is in Redis: the
leader prefills ~2 s, so the sibling reaches its gateway's lookup before the leader lands (at
6,500 tokens/s, ~0.6 s, it did not once under a fresh clone's suite: the sibling found the
entry landed and did not hold)."""
SLOW_LEADER_ESTIMATE = 1_000
"""The gateways' prefill estimate beside `SLOW_LEADER`: the hold's bound (twice the estimated
prefill) stays past the landing."""
SHARED_PROMPT = "You are a subagent." + words("events/shared", SHARED_TOKENS // 2)


def test_a_sibling_at_another_gateway_is_released_by_the_leaders_block_stored(
    fresh_redis: Any,
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
) -> None:
    base = free_ports(2)
    engines = [
        start_engines(1, kv_events=events_config(base + i), **SLOW_LEADER)[0] for i in range(2)
    ]
    ports = {e.url: base + i for i, e in enumerate(engines)}
    settings = {
        **precise_settings(ports),
        "fanout_hold": True,
        "redis_url": fresh_redis.url,
        "redis_deadline_s": 0.5,
        "server_secret": "fleet",
        "engine_prefill_tokens_per_s": SLOW_LEADER_ESTIMATE,
    }
    a, b = (start_gateway(engines, **settings) for _ in range(2))
    join([a, b], engines)
    markers = redis.Redis.from_url(fresh_redis.url)

    def ask(gateway: Served, task: str, max_tokens: int) -> Any:
        with openai.OpenAI(base_url=gateway.url + "/v1", api_key=TENANT_KEY, max_retries=0) as c:
            stream = c.completions.create(
                model=MODEL,
                prompt=SHARED_PROMPT + f"\n\nSubtask {task}: " + words(task, 50),
                max_tokens=max_tokens,
                stream=True,
                stream_options={"include_usage": True},
            )
            return [chunk.usage for chunk in stream if chunk.usage is not None][-1]

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        leader = pool.submit(ask, a, "leader", 100)
        wait_until(lambda: any(True for _ in markers.scan_iter(match="kvg:*:w")), what="markers")
        usage = ask(b, "sibling", 2)
        leader_usage = leader.result(timeout=30)
    markers.close()
    assert usage.prompt_tokens_details.cached_tokens >= 1_900  # the leader's write of the ~2k
    assert leader_usage.prompt_tokens_details.cached_tokens == 0
    stats_a = director(a).placement.flights.stats  # type: ignore[union-attr]
    stats_b = director(b).placement.flights.stats  # type: ignore[union-attr]
    assert stats_a.landed_on_events == 1  # before its first chunk, ~0.5 s later
    assert stats_b.holds == 1 and stats_b.released_landed == 1 and stats_b.timeouts == 0


def test_a_leader_whose_engine_never_sends_a_token_lands_on_its_block_stored(
    start_engines: Callable[..., list[Served]],
) -> None:
    """The parts alone: a real engine that prefills and then stalls before its first token
    (`stall_after_tokens=0`), its KV events over real ZMQ into the event index; a flight
    registered for the prompt's precise keys lands — only its BlockStored can have landed it."""
    port = free_ports(1)
    (engine,) = start_engines(1, kv_events=events_config(port), stall_after_tokens=0)
    prompt = "You are terse. " + words("events-leader", 400)
    ids = httpx.post(engine.url + "/tokenize", json={"model": MODEL, "prompt": prompt}).json()[
        "tokens"
    ]
    salt = "tenant-salt"
    keys = precise_keys(ids, salt, 16)
    assert len(keys) >= 8

    async def run() -> tuple[bool, int]:
        index = EventIndex(block_size=16)
        flights = Flights()
        index.on_stored = lambda domain, stored: flights.stored(replica_of(domain), stored)
        config = EventsConfig(endpoints={engine.url: f"tcp://127.0.0.1:{port}"}, topic=TOPIC)
        intake = EventIntake(config, index, lambda: [engine.url])
        await intake.start()
        async with httpx.AsyncClient(timeout=30) as client:
            for _ in range(200):  # PUB drops what it sends before the SUB joined: poll
                await client.post(engine.url + "/reset_prefix_cache")
                if intake.feeds(engine.url)[0].stats.wipes:
                    break
                await asyncio.sleep(0.05)
            assert intake.feeds(engine.url)[0].stats.wipes, "the feed never joined"
            flight = await flights.lead(engine.url, keys, expected_s=1.0, ttl_s=10.0)
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": True}
            body["cache_salt"] = salt
            async with client.stream("POST", engine.url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                landed = await flights.wait(flight, 10.0)  # no token is ever sent
        await intake.close()
        return landed, flights.stats.landed_on_events

    landed, on_events = asyncio.run(run())
    assert landed and on_events == 1
